"""Data parallelism from scratch: replicate the model, all-reduce gradients in buckets while backward runs.

    torchrun --standalone --nproc-per-node 2 examples/ddp_from_scratch.py

What torch's DistributedDataParallel does, in plain torch.distributed:

1. broadcast rank 0's parameters, so every replica starts equal;
2. group the parameters into buckets of about ``bucket_bytes``, in reverse order (roughly the order in which
   backward produces their gradients);
3. a hook on each parameter notes when its gradient is final; when the last gradient of a bucket is ready,
   the bucket is flattened and its all-reduce *launched* (``async_op=True``) while backward carries on with
   earlier layers: that is the overlap;
4. before the optimizer step, wait for every bucket and copy the sums back into ``.grad``.

Gradients are summed, not averaged: the loss each rank backpropagates is already its share of the global
mean (examples/loss_bookkeeping.py). meshloom gets the same result from FSDP2 on the replicate dim
(``--parallel.dp_replicate N --parallel.dp_shard 1``), with one FSDP unit per block in place of a bucket;
tests/test_from_scratch.py checks that both give the same outputs and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module: nn.Module, bucket_bytes: int = 2**16, group=None):
        super().__init__()
        self.module, self.group = module, group
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        self.buckets: list[list[nn.Parameter]] = [[]]
        for p in reversed(params):  # backward meets the last layers first
            if sum(q.numel() * q.element_size() for q in self.buckets[-1]) >= bucket_bytes:
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # the bucket is complete: start its all-reduce now
            flat = torch.cat([p.grad.flatten() for p in self.buckets[i]])
            self.in_flight.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish_gradient_sync(self) -> int:
        """Wait for every bucket's all-reduce and write the sums into .grad; returns how many there were."""
        launched = len(self.in_flight)
        for i, flat, work in self.in_flight:
            work.wait()
            for p, g in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]]), strict=True):
                p.grad.copy_(g.view_as(p))
        self.in_flight, self.ready = [], [0] * len(self.buckets)
        return launched


def run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # deliberately different weights per rank: the broadcast must fix that
    model = BucketedDDP(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)),
        bucket_bytes=16 * 1024,
    )
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8 * world, 16, generator=gen), torch.randn(8 * world, 4, generator=gen)
    mine = slice(8 * rank, 8 * (rank + 1))  # each rank takes its slice of the global batch
    ((model(x[mine]) - y[mine]) ** 2).sum().div(y.numel()).backward()
    buckets = model.finish_gradient_sync()
    reference = model.module  # after the sync, every replica's gradient is the full-batch gradient
    ref_grads = [
        g.clone()
        for g in torch.autograd.grad(((reference(x) - y) ** 2).sum().div(y.numel()), list(reference.parameters()))
    ]
    error = max((p.grad - g).abs().max().item() for p, g in zip(reference.parameters(), ref_grads, strict=True))
    return {"buckets": [len(b) for b in model.buckets], "all-reduces launched": buckets, "max grad error": error}


if __name__ == "__main__":
    from _launch import main

    main(run)
