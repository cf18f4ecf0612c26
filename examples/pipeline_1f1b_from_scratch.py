"""Pipeline parallelism from scratch: 1F1B over send/recv between stages on consecutive ranks.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_1f1b_from_scratch.py

Rank r holds stage r of p. The local batch is cut into m micro-batches. A forward of micro-batch i receives
its input activation from rank r - 1 (rank 0 reads the data), runs the stage and sends the output to rank
r + 1 (the last rank computes the loss instead). Its backward receives the output's gradient from rank
r + 1 (the last rank starts from the loss), backpropagates through the stage and sends the input's
gradient to rank r - 1. The 1F1B order on rank r:

1. warm-up: p - 1 - r forwards;
2. steady state: one forward, one backward, until every forward has run;
3. cool-down: the remaining backwards.

So rank r never holds more than p - r micro-batches' activations, however large m is. Sends are
non-blocking (``isend``) and waited for at the end; receives block. meshloom builds the same thing from
``torch.distributed.pipelining`` (mesh/pipeline.py: build_pipeline_schedule with ``1F1B``);
tests/test_from_scratch.py checks that both give the same losses and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def one_f_one_b(stage: nn.Module, microbatches: list, targets: list, loss_fn, activation_shape) -> tuple[list, int]:
    """One 1F1B step of ``stage`` on this rank: (micro-batch losses on the last rank, most activations held)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last, m = rank == 0, rank == p - 1, len(microbatches)
    saved, losses, sends, most = {}, [], [], 0

    def forward(i: int) -> None:
        if first:
            x = microbatches[i]
        else:
            x = torch.empty(activation_shape)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, targets[i])
            losses.append(y.detach())
        else:
            sends.append(dist.isend(y.detach(), rank + 1))
        saved[i] = (x, y)
        nonlocal most
        most = max(most, len(saved))

    def backward(i: int) -> None:
        x, y = saved.pop(i)  # this micro-batch's activations are freed after its backward
        if last:
            y.backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 1)
            y.backward(grad)
        if not first:
            sends.append(dist.isend(x.grad, rank - 1))

    warmup = min(p - 1 - rank, m)
    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    for request in sends:
        request.wait()
    return losses, most


def run(m: int = 4) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank builds the whole model, keeps its own stage
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(p)])
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * m, 16, generator=gen), torch.randn(4 * m, 16, generator=gen)
    loss_fn = lambda out, target: ((out - target) ** 2).sum() / y.numel()  # noqa: E731  (share of the mean)
    losses, held = one_f_one_b(model[rank], list(x.chunk(m)), list(y.chunk(m)), loss_fn, (4, 16))
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(p)])
    reference.load_state_dict(model.state_dict())
    loss = loss_fn(reference(x), y)  # one process, whole batch
    loss.backward()
    return {
        "micro-batches held at most (p - rank)": held,
        "loss (last rank) / one process": (sum(losses).item() if losses else None, loss.item()),
        "gradient error of my stage": max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(model[rank].parameters(), reference[rank].parameters(), strict=True)
        ),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
