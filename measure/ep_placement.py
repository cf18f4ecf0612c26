"""Where the experts live: expert bytes per rank with ep borrowing tp, against ep carved from dp_shard alone.

    .venv/bin/python -m measure.ep_placement        # from the repository root, about a minute on 2 cores

The MoE debug model (configs/debug_moe.toml: 4 MoE layers, dim 128, expert hidden 128) with 4 experts is
parallelized on 4 gloo ranks, dp_shard 2 x tp 2, as train.py parallelizes it (training/build.py:
``build_step``), three ways:

- ``ep 4 over dp_shard x tp``: the ep group is all four ranks (mesh/dims.py), each holds one expert per layer;
- ``ep 2 over dp_shard x tp``: the ep groups are the tp pairs, FSDP shards each expert pair over dp_shard (efsdp);
- ``ep 2 within dp_shard``: the earlier layout (``build_layout_mesh(..., ep_within_dp_shard=True)``, here: no run
  takes it), ep groups across dp_shard, every tp rank holding the same two experts per layer whole.

What is measured, per rank: the bytes of the expert weights it holds (the local shards of every
``experts`` module, mesh/expert_parallel.local_expert_bytes), fp32. Gradients and the two fp32 AdamW moments
follow the same shards, so the expert training state is 4x that. Nothing is trained: placement only.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mesh.dims import Meshes, ParallelDims

WORLD = 4
MOE = {"model.n_experts": 4, "parallel.dp_shard": 2, "parallel.tp": 2}
LAYOUTS = {  # name: (parallel.ep, ep_within_dp_shard)
    "ep 4 over dp_shard x tp": (4, False),
    "ep 2 over dp_shard x tp": (2, False),
    "ep 2 within dp_shard (earlier)": (2, True),
}


def build_layout_mesh(
    dims: ParallelDims,
    device: torch.device,
    timeout_s: float,
    fsdp_with_tp: bool = False,
    ep_within_dp_shard: bool = False,
) -> Meshes:
    """mesh/dims.py's ``build_mesh`` for an MoE model; ``ep_within_dp_shard``: the earlier expert layout instead,
    dp_shard = efsdp x ep (row-major), experts FSDP-sharded over (dp_replicate, efsdp) and replicated over tp, whose
    ranks then sum their expert gradients (``Meshes.experts_replicated_over_tp``). Every rank calls it."""
    from mesh.dims import build_mesh, mesh_backend_options
    from mesh.private_api import unflatten_mesh

    if not ep_within_dp_shard:
        return build_mesh(dims, device, timeout_s, has_experts=True, fsdp_with_tp=fsdp_with_tp)
    if dims.cp > 1:
        raise ValueError(
            f"ep_within_dp_shard with cp={dims.cp}: experts would be FSDP-sharded over efsdp x cp "
            "with ep in between; build the default expert meshes (ep over dp_shard x cp x tp)"
        )
    # the mesh without meshloom's expert views (ep 1), then the earlier ones, views of the same root
    meshes = build_mesh(dataclasses.replace(dims, ep=1), device, timeout_s, has_experts=True, fsdp_with_tp=fsdp_with_tp)
    options = mesh_backend_options(device, timeout_s)
    shape, names = (dims.dp_shard // dims.ep, dims.ep), ("efsdp", "ep")
    experts = unflatten_mesh(meshes.world, "dp_shard", shape, names, options)
    fsdp = experts[("dp_replicate", "efsdp") if dims.dp_replicate > 1 else ("efsdp",)]
    return dataclasses.replace(meshes, ep=experts["ep"], expert_fsdp=fsdp, experts_replicated_over_tp=True)


def measure(ep: int, ep_within_dp_shard: bool) -> dict:
    """Rank body: the model parallelized for the layout; this rank's expert weight bytes and experts held."""
    from launch.local_runs import ROOT
    from mesh.expert_parallel import local_expert_bytes
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from training.build import build_step

    cfg = load_config(path=str(ROOT / "configs" / "debug_moe.toml"), overrides={**MOE, "parallel.ep": ep})
    plan = LayoutPlan.resolve(cfg, dist.get_world_size(), dist.get_rank())
    device = torch.device("cpu")
    meshes = build_layout_mesh(plan.dims, device, 120, fsdp_with_tp=True, ep_within_dp_shard=ep_within_dp_shard)
    model = build_step(cfg, plan, meshes, device).parts[0]
    n_local = plan.model.moe.n_experts // ep
    first = meshes.ep.get_local_rank() * n_local
    return {
        "bytes": sum(local_expert_bytes([model]).values()),
        "experts": list(range(first, first + n_local)),
        "efsdp": meshes.expert_fsdp.size(),
    }


def table() -> dict[str, list[dict]]:
    from launch.spawn import run_on_ranks

    return {name: run_on_ranks(measure, WORLD, *layout, timeout=600) for name, layout in LAYOUTS.items()}


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.ep_placement", description=__doc__.splitlines()[0])


def main() -> None:
    result = table()
    print("MoE debug model, 4 experts, 4 MoE layers, fp32, on dp_shard 2 x tp 2 (4 ranks); expert weights per rank")
    print(f"{'layout':<32} {'experts on rank 0..3':<34} {'bytes per rank':>14} {'all ranks / one copy':>21}")
    one_copy = None
    per_rank = {}
    for name, ranks in result.items():
        held = [
            f"E{r['experts'][0]}-{r['experts'][-1]}" if len(r["experts"]) > 1 else f"E{r['experts'][0]}" for r in ranks
        ]
        held = [h + (f"/{r['efsdp']}" if r["efsdp"] > 1 else "") for h, r in zip(held, ranks, strict=True)]
        per_rank[name] = max(r["bytes"] for r in ranks)
        total = sum(r["bytes"] for r in ranks)
        one_copy = one_copy or total  # the first layout holds each expert once (checked by the tests)
        print(f"{name:<32} {' '.join(held):<34} {per_rank[name]:>14,} {total / one_copy:>20.1f}x")
    old, new = per_rank["ep 2 within dp_shard (earlier)"], per_rank["ep 4 over dp_shard x tp"]
    print(f"expert bytes per rank, earlier / ep 4 over dp_shard x tp: {old / new:.1f}x")
    print(f"expert training state per rank (weights, grads, 2 AdamW moments): {4 * new:,} vs {4 * old:,} bytes")


if __name__ == "__main__":
    from measure import ep_placement

    ep_placement.build_parser().parse_args()

    ep_placement.main()
