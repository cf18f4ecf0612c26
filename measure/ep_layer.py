"""One expert-parallel MoE block against the single-device block: rows per rank and the differences.

    python -m measure.ep_layer        # docs/expert_parallel.md, Appendix G (about 15 s)

Runs the layer comparison that tests/test_expert_parallel.py bounds (8 experts, top-2, a shared expert; each rank routes its
own 12 tokens) on ep = 2 and 4 gloo ranks, with routing spread out and with every token forced onto rank 0's
experts, and prints what the test only bounds: how many rows each rank's experts received, and the largest
absolute differences from one device processing every rank's tokens.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from mesh.expert_parallel import ExpertParallel
from models.moe import MoE, MoEArgs

DIM = 32


def make_moe(args: MoEArgs) -> MoE:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    moe = MoE(DIM, args, shared_hidden_dim=48)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def ep_layer_vs_single_device(ep: int, starve_other_ranks: bool) -> dict:
    """Each rank routes its own tokens through the EP block; compare with one device on all ranks' tokens."""
    rank = dist.get_rank()
    args = MoEArgs(n_experts=8, top_k=2, hidden_dim=24, n_shared_experts=1)
    reference, sharded = make_moe(args), make_moe(args)
    if starve_other_ranks:  # every token picks rank 0's experts: the other ranks receive no tokens at all
        for moe in (reference, sharded):
            moe.expert_bias[: 8 // ep] = 100.0
    ExpertParallel()._apply(sharded.experts, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)))
    processed = []  # tokens this rank's experts actually received, recorded inside the dispatch/combine
    plain_forward = sharded.experts.forward
    sharded.experts.forward = lambda x, counts: processed.append(x.shape[0]) or plain_forward(x, counts)

    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 6, DIM, generator=gen) for _ in range(ep)]  # rank r's tokens are xs[r]
    weights = [torch.randn(2, 6, DIM, generator=gen) for _ in range(ep)]

    x_ref = torch.cat(xs).requires_grad_()
    (reference(x_ref) * torch.cat(weights)).sum().backward()
    x = xs[rank].clone().requires_grad_()
    out = sharded(x)
    (out * weights[rank]).sum().backward()

    with torch.no_grad():
        out_ref = reference(torch.cat(xs)).chunk(ep)[rank]
    router_grad = sharded.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)  # the router saw only this rank's tokens: sum over data-parallel ranks
    local = slice(rank * 8 // ep, (rank + 1) * 8 // ep)
    return {
        "received": processed[0],
        "out": (out - out_ref).abs().max().item(),
        "input_grad": (x.grad - x_ref.grad.chunk(ep)[rank]).abs().max().item(),
        "router_grad": (router_grad - reference.router.gate.weight.grad).abs().max().item(),
        "expert_grad": max(
            (getattr(sharded.experts, w).grad.to_local() - getattr(reference.experts, w).grad[local]).abs().max().item()
            for w in ("w1", "w2", "w3")
        ),
        "expert_grad_scale": reference.experts.w1.grad.abs().max().item(),
    }


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.ep_layer", description=__doc__.splitlines()[0])


def main() -> None:
    from launch.spawn import run_on_ranks

    keys = ("out", "input_grad", "router_grad", "expert_grad")
    print(f"{'ep':>2} {'routing':<18} {'rows received per rank':<24} " + " ".join(f"{k:>12}" for k in keys))
    for ep in (2, 4):
        for starve in (False, True):
            results = run_on_ranks(ep_layer_vs_single_device, ep, ep, starve)
            received = " / ".join(str(r["received"]) for r in results)
            worst = [max(r[k] for r in results) for k in keys]
            name = "one rank gets all" if starve else "spread"
            print(f"{ep:>2} {name:<18} {received:<24} " + " ".join(f"{w:>12.1e}" for w in worst))


if __name__ == "__main__":
    build_parser().parse_args()
    main()
