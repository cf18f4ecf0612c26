"""Expert parallelism from scratch: send each token to the rank that owns its expert, and its output back.

    torchrun --standalone --nproc-per-node 2 examples/moe_from_scratch.py

E experts, ep ranks: rank r owns experts r*E/ep ... (r+1)*E/ep - 1. Each rank routes its own tokens, sorts
the (token, expert) assignments by expert id and counts them per expert (models/moe.py does this, then
calls its experts with ``(x_sorted, counts)``: the seam this function replaces). Then:

1. exchange the counts (``all_to_all_single`` of E integers): rank r learns how many rows each peer will
   send to each of its experts, so it can size its receive buffer;
2. dispatch: ``all_to_all_single`` the rows; sorted by expert id they are already grouped by owner rank,
   and arrive grouped by (source rank, local expert);
3. run each local expert on its rows from every source;
4. combine: put the outputs back in arrival order and ``all_to_all_single`` them back, the splits swapped.

Steps 2 and 4 move activations that need gradients: ``AllToAll`` is the autograd-aware exchange, whose
backward is the reverse exchange. So an MoE layer costs one count exchange plus two all-to-alls forward,
and two more backward. meshloom's version is mesh/expert_parallel.py: ExpertParallel;
tests/test_from_scratch.py checks that both give the same outputs and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits  # the gradient goes back the way the data came
        return AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def expert_parallel(x: torch.Tensor, counts: torch.Tensor, local_experts, group=None) -> torch.Tensor:
    """``x``: this rank's rows sorted by global expert id, ``counts[e]`` of them for expert e.
    ``local_experts(rows, local_counts)`` runs this rank's experts on rows sorted by local expert."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # 1. received[s*n + e]: rows from s for my expert e
    received = received.view(ep, -1)
    send_splits, recv_splits = counts.view(ep, -1).sum(1).tolist(), received.sum(1).tolist()
    rows = AllToAll.apply(x, recv_splits, send_splits, group)  # 2. dispatch
    blocks = rows.split(received.flatten().tolist())  # (source 0, expert 0), (source 0, expert 1), ...
    n_local = received.shape[1]
    by_expert = [torch.cat([blocks[s * n_local + e] for s in range(ep)]) for e in range(n_local)]
    out = local_experts(torch.cat(by_expert), received.sum(0))  # 3. my experts, every source's rows
    pieces = [chunk.split(received[:, e].tolist()) for e, chunk in enumerate(out.split(received.sum(0).tolist()))]
    arrival_order = torch.cat([pieces[e][s] for s in range(ep) for e in range(n_local)])
    return AllToAll.apply(arrival_order, send_splits, recv_splits, group)  # 4. combine


def example_routing(ep: int, n_experts: int = 4, dim: int = 8, tokens_per_rank: int = 6):
    """Every rank builds all experts (a linear map each) and every rank's tokens with their expert (top-1).
    docs/img/ep_dispatch.svg draws this same example."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(n_experts, dim, dim, generator=gen) * 0.3
    tokens = [torch.randn(tokens_per_rank, dim, generator=gen) for _ in range(ep)]
    choice = [torch.randint(0, n_experts, (tokens_per_rank,), generator=gen) for _ in range(ep)]
    return weights, tokens, choice


def run(n_experts: int = 4) -> dict:
    rank, ep = dist.get_rank(), dist.get_world_size()
    weights, tokens, choice = example_routing(ep, n_experts)
    n_local = n_experts // ep
    mine = weights[rank * n_local : (rank + 1) * n_local].clone().requires_grad_()

    def local_experts(rows, local_counts):
        return torch.cat([F.tanh(chunk @ mine[e]) for e, chunk in enumerate(rows.split(local_counts.tolist()))])

    order = torch.argsort(choice[rank], stable=True)
    x = tokens[rank][order].clone().requires_grad_()
    out = expert_parallel(x, torch.bincount(choice[rank], minlength=n_experts), local_experts)
    out.sum().backward()
    full = weights.clone().requires_grad_()  # one device, all experts, every rank's tokens
    ref_out = [F.tanh(t[:, None] @ full[c]).squeeze(1) for t, c in zip(tokens, choice, strict=True)]
    sum(o.sum() for o in ref_out).backward()
    return {
        "rows my experts received": sum(int((c // n_local == rank).sum()) for c in choice),
        "output error": (out - ref_out[rank][order]).abs().max().item(),
        "expert-gradient error": (mine.grad - full.grad[rank * n_local : (rank + 1) * n_local]).abs().max().item(),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
