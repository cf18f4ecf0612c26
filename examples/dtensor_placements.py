"""DTensor: one logical tensor, stored across a mesh as Shard, Replicate or Partial, and what moving costs.

    torchrun --standalone --nproc-per-node 2 examples/dtensor_placements.py

A DTensor is a local tensor plus (mesh, placements). With one placement per mesh dim:

- ``Shard(d)``: each rank holds one slice of the logical tensor along dim d;
- ``Replicate()``: each rank holds all of it;
- ``Partial()``: each rank holds a full-size tensor and the logical value is their *sum* (what a
  row-parallel matmul produces before its reduction).

``redistribute`` changes placements and runs whatever collective the change needs. ``run`` records each
one with CommDebugMode: Shard -> Replicate is an all-gather, Partial -> Replicate an all-reduce, Partial ->
Shard a reduce-scatter, Replicate -> Shard is free (each rank keeps its slice), Shard(0) -> Shard(1) is an
all-to-all in principle (gloo has none, so DTensor all-gathers and slices, and logs a warning).
It also shows the two private placements docs/tensor_parallel.md mentions: ``_StridedShard`` (a shard of
a shard: what FSDP holds of a weight that TP already split on the same dim) and ``_NormPartial`` (a
partial *norm*: reducing it sums the p-th powers of the ranks' norms and takes the p-th root).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

PLACEMENTS = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate()": Replicate(), "Partial()": Partial()}
MOVES = [
    ("Shard(0)", "Replicate()"),
    ("Partial()", "Replicate()"),
    ("Partial()", "Shard(0)"),
    ("Replicate()", "Shard(0)"),
    ("Shard(0)", "Shard(1)"),
]


def collectives(mode: CommDebugMode) -> list[str]:
    return sorted(f"{str(op).split('.')[-1]} x{n}" for op, n in mode.get_comm_counts().items())


def run() -> dict:
    from torch.distributed.tensor.placement_types import _StridedShard  # private in torch 2.13

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("x",))
    full = torch.arange(4.0 * n * n).view(2 * n, 2 * n)  # the logical tensor, the same on every rank
    out = {
        f"local piece of {p}": distribute_tensor(full, mesh, [PLACEMENTS[p]]).to_local().tolist()
        for p in ("Shard(0)", "Shard(1)", "Replicate()")
    }
    moves = {}
    for src, dst in MOVES:
        if src == "Partial()":  # each rank holds full / n: the logical value, their sum, is `full`
            start = DTensor.from_local(full / n, mesh, [Partial()])
        else:
            start = distribute_tensor(full, mesh, [PLACEMENTS[src]])
        with CommDebugMode() as comm:
            moved = start.redistribute(mesh, [PLACEMENTS[dst]])
        assert torch.equal(moved.full_tensor(), full)  # the logical tensor never changes, only its storage
        moves[f"{src} -> {dst}"] = collectives(comm) or ["no communication"]
    out["redistribute"] = moves
    # _StridedShard(0, split_factor=2): dim 0 cut into n * 2 blocks, rank r keeps blocks r, r + n, ...
    rows = torch.arange(4.0 * n).view(4 * n, 1)
    strided = distribute_tensor(rows, mesh, [_StridedShard(0, split_factor=2)])
    out["_StridedShard(0, split_factor=2) rows"] = strided.to_local().flatten().tolist()
    # A norm of a sharded tensor: each rank's local norm, as a _NormPartial; full_tensor() all-reduces.
    norm = torch.linalg.vector_norm(distribute_tensor(full, mesh, [Shard(0)]))
    with CommDebugMode() as comm:
        value = norm.full_tensor()
    out["norm placement"] = str(norm.placements[0])
    out["norm: local piece, reduced, reference"] = (norm.to_local().item(), value.item(), full.norm().item())
    out["norm reduction"] = collectives(comm)
    return out


if __name__ == "__main__":
    from _launch import main

    main(run)
