"""ZeRO-1 from scratch: every rank keeps the whole model, but the optimizer state of only 1/dp of it.

    torchrun --standalone --nproc-per-node 2 examples/zero1_from_scratch.py

AdamW keeps two fp32 moments per parameter: twice the model. ZeRO-1 gives each rank the optimizer state of
one contiguous slice of the flattened parameters:

1. backward as usual: every rank has full-size gradients of its own data;
2. reduce-scatter the flat gradient: rank r receives the *sum* over ranks of slice r, the only slice it
   updates (a plain all-reduce would also work; the reduce-scatter moves half the bytes);
3. AdamW on the slice: moments exist for this slice only;
4. all-gather the updated slices into every rank's full parameters.

Reduce-scatter + all-gather is exactly an all-reduce's traffic (chapter 0), so the memory saving is free
in bandwidth. ZeRO-2 would also free the gradient outside the slice after step 2; ZeRO-3
(examples/zero3_from_scratch.py) shards the parameters too, which is what meshloom's FSDP2 does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ZeRO1AdamW:
    def __init__(self, params, group=None, **adamw):
        self.params, self.group = [p for p in params if p.requires_grad], group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.total = sum(p.numel() for p in self.params)
        self.size = -(-self.total // self.world)  # slice length (the last one padded)
        mine = self._flat([p.detach() for p in self.params])[self.rank * self.size : (self.rank + 1) * self.size]
        self.slice = nn.Parameter(mine.clone())  # an fp32 master copy of my slice
        self.optimizer = torch.optim.AdamW([self.slice], **adamw)  # moments for my slice only

    def _flat(self, tensors) -> torch.Tensor:
        flat = torch.cat([t.flatten() for t in tensors])
        return F.pad(flat, (0, self.size * self.world - self.total))

    @torch.no_grad()
    def step(self) -> None:
        grad = torch.empty(self.size)
        dist.reduce_scatter_tensor(grad, self._flat([p.grad for p in self.params]), group=self.group)
        self.slice.grad = grad
        self.optimizer.step()
        full = torch.empty(self.size * self.world)
        dist.all_gather_into_tensor(full, self.slice.detach(), group=self.group)
        for p, new in zip(self.params, full[: self.total].split([p.numel() for p in self.params]), strict=True):
            p.copy_(new.view_as(p))

    def state_numel(self) -> int:
        return sum(t.numel() for s in self.optimizer.state.values() for t in s.values() if t.dim() > 0)


def run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    reference = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    reference.load_state_dict(model.state_dict())
    zero = ZeRO1AdamW(model.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8 * world, 16, generator=gen), torch.randn(8 * world, 4, generator=gen)
        mine = slice(8 * rank, 8 * (rank + 1))
        ((model(x[mine]) - y[mine]) ** 2).sum().div(y.numel()).backward()  # my share of the global mean
        zero.step()
        model.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()  # one process, whole batch
        plain.step()
        plain.zero_grad()
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "max parameter difference after 3 steps": max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        ),
        "Adam moment elements here / for the whole model": (zero.state_numel(), 2 * n_params),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
