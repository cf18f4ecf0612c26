"""ZeRO-3 (FSDP) from scratch: parameters sharded too; gather a unit before use, free it after, reduce-scatter
its gradients.

    torchrun --standalone --nproc-per-node 2 examples/zero3_from_scratch.py

Each *unit* (a layer, a block) keeps only a flat 1/dp slice of its parameters, an ``nn.Parameter`` that the
optimizer updates (so gradients and Adam states are 1/dp too). Around the unit's computation:

1. forward: all-gather the slices into the full flat parameters, run the unit, drop the full parameters;
2. backward: all-gather them again, recompute the unit's forward, backpropagate through it;
3. reduce-scatter the full gradient: each rank keeps the summed gradient of its own slice.

Per unit and step that is two all-gathers and one reduce-scatter, the pattern meshloom's FSDP2 units show
with ``parallel.fsdp_reshard_after_forward always`` (tests/test_collective_counts.py). One liberty keeps
this short: step 2 recomputes the unit's forward (as activation checkpointing would), while FSDP2 keeps the
activations and only refills the parameters' storage it freed. tests/test_from_scratch.py checks that this
computes the same outputs and gradients as ``mesh/data_parallel.py: apply_fsdp``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call


class ShardedUnit(nn.Module):
    """Wraps ``module``: holds 1/dp of its parameters as ``shard`` and gathers them around each use."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.group, world, rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.names, self.shapes = zip(*[(n, p.shape) for n, p in module.named_parameters()], strict=True)
        flat = torch.cat([p.detach().flatten() for p in module.parameters()])
        self.numel, size = flat.numel(), -(-flat.numel() // world)
        self.shard = nn.Parameter(F.pad(flat, (0, size * world - self.numel))[rank * size : (rank + 1) * size].clone())
        self.module = [module.to("meta")]  # a list hides it from .parameters(); meta: no full weights kept

    def gather(self) -> torch.Tensor:
        full = torch.empty(self.shard.numel() * dist.get_world_size(self.group))
        dist.all_gather_into_tensor(full, self.shard.detach(), group=self.group)
        return full

    def call(self, full: torch.Tensor, *inputs):
        views = [
            t.view(s)
            for t, s in zip(full[: self.numel].split([s.numel() for s in self.shapes]), self.shapes, strict=True)
        ]
        return functional_call(self.module[0], dict(zip(self.names, views, strict=True)), inputs)

    def forward(self, *inputs):
        return _GatherRunFree.apply(self, self.shard, *inputs)


class _GatherRunFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit: ShardedUnit, shard: torch.Tensor, *inputs):
        ctx.unit = unit
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return unit.call(unit.gather(), *inputs)  # the gathered weights die when this returns

    @staticmethod
    def backward(ctx, grad_out):
        unit = ctx.unit
        full = unit.gather().requires_grad_()  # gather again
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            torch.autograd.backward(unit.call(full, *inputs), grad_out)  # recompute, then backpropagate
        grad_shard = torch.empty_like(unit.shard)
        dist.reduce_scatter_tensor(grad_shard, full.grad, group=unit.group)  # keep the sum of my slice
        return (None, grad_shard, *(x.grad if x.requires_grad else None for x in inputs))


def run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    reference = nn.Sequential(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 4)
    )
    sharded = nn.Sequential(*[ShardedUnit(copy.deepcopy(unit)) for unit in reference])  # three units
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * world, 16, generator=gen), torch.randn(8 * world, 4, generator=gen)
    mine = slice(8 * rank, 8 * (rank + 1))  # my slice of the global batch
    out = sharded(x[mine])
    ((out - y[mine]) ** 2).sum().div(y.numel()).backward()  # my share of the global mean
    ((reference(x) - y) ** 2).mean().backward()  # one process, whole batch
    errors = []
    for unit, ref in zip(sharded, reference, strict=True):  # gather my gradient slices to compare
        full = torch.empty(unit.shard.numel() * world)
        dist.all_gather_into_tensor(full, unit.shard.grad)
        errors.append((full[: unit.numel] - torch.cat([p.grad.flatten() for p in ref.parameters()])).abs().max())
    return {
        "output error": (out - reference(x)[mine]).abs().max().item(),
        "gradient error": max(errors).item(),
        "parameters held here / in the model": (
            sum(u.shard.numel() for u in sharded),
            sum(p.numel() for p in reference.parameters()),
        ),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
