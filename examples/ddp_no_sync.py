"""Gradient accumulation with DDP's ``no_sync``: the forward must run inside it too.

    torchrun --standalone --nproc-per-node 2 examples/ddp_no_sync.py

Accumulating two micro-batches per step, only the last backward needs to all-reduce. ``no_sync()`` turns the
all-reduce off, but DDP decides during *forward* whether the coming backward will reduce (its forward
prepares the reducer for backward when sync is on). So:

- ``no no_sync``: both backwards all-reduce (2 reductions per step);
- ``backward inside, forward outside``: the pattern many write-ups show; both backwards still reduce;
- ``forward and backward inside``: the first micro-batch is not reduced, only the last one (1 per step).

``run`` counts the reductions with a communication hook (``register_comm_hook``, which every DDP bucket
reduction goes through) and checks that all three end with the same averaged gradient (an average of a tensor
that is already equal on every rank leaves it unchanged, so reducing the first micro-batch early costs traffic,
not correctness).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def accumulate(variant: str) -> tuple[int, torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    reductions = []

    def counting_all_reduce(state, bucket):  # DDP's default reduction (an average), counted
        reductions.append(bucket.index())
        averaged = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(averaged, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, counting_all_reduce)
    gen = torch.Generator().manual_seed(rank)
    micro = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    first, last = micro
    if variant == "no no_sync":
        model(first).sum().backward()
    elif variant == "backward inside, forward outside":
        out = model(first)
        with model.no_sync():
            out.sum().backward()
    else:
        with model.no_sync():
            model(first).sum().backward()
    model(last).sum().backward()  # the last micro-batch always synchronises
    return len(reductions), model.module.weight.grad.clone()


def run() -> dict:
    out, grads = {}, []
    for variant in ("no no_sync", "backward inside, forward outside", "forward and backward inside"):
        count, grad = accumulate(variant)
        out[f"{variant}: all-reduces"] = count
        grads.append(grad)
    # The same averaged gradient in the end, whichever variant (to round-off: the sums run in another order).
    out["same final gradient"] = all(torch.allclose(grads[0], g, rtol=1e-5, atol=1e-6) for g in grads[1:])
    return out


if __name__ == "__main__":
    from _launch import main

    main(run)
