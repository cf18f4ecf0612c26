"""Tensor parallelism from scratch: Megatron's column- then row-parallel MLP and its two operators f and g.

    torchrun --standalone --nproc-per-node 2 examples/tp_from_scratch.py

The SwiGLU MLP is Z = (silu(X W1ᵀ) * (X W3ᵀ)) W2ᵀ (``nn.Linear`` stores weights as (out, in)). On t ranks:

- W1 and W3 are split by output features (*column-parallel*, rows of the stored weight): rank r computes
  its own hidden columns of silu(X W1ᵀ) * (X W3ᵀ), complete, with no communication;
- W2 is split by input features (*row-parallel*, columns of the stored weight), matching those hidden
  columns: rank r's product is a full-size *partial* Z, and the partials must be summed.

Two autograd functions place the communication (Megatron-LM's names):

- ``g`` after the row-parallel matmul: all-reduce in forward, identity in backward;
- ``f`` before the column-parallel matmuls: identity in forward, all-reduce in backward, because every rank
  used all of X and holds only its part of X's gradient.

One all-reduce each way per MLP. meshloom gets the same from ``parallelize_module`` with ColwiseParallel /
RowwiseParallel (mesh/tensor_parallel.py: block_plan); tests/test_from_scratch.py checks that both give the
same output, input gradient and weight gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToTensorParallel(torch.autograd.Function):  # Megatron's f
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # sum the ranks' partial input gradients
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):  # Megatron's g
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)  # sum the partial outputs
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None  # every rank already holds the full output gradient


def shard_mlp(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, rank: int, world: int):
    """This rank's pieces: rows of W1 and W3 (column-parallel), the matching columns of W2 (row-parallel)."""
    return w1.chunk(world, dim=0)[rank], w3.chunk(world, dim=0)[rank], w2.chunk(world, dim=1)[rank]


def parallel_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, group=None) -> torch.Tensor:
    x = CopyToTensorParallel.apply(x, group)
    hidden = F.silu(x @ w1.t()) * (x @ w3.t())  # this rank's hidden columns, complete
    return ReduceFromTensorParallel.apply(hidden @ w2.t(), group)


def run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)  # the same full weights and input on every rank
    w1, w3, w2 = (0.2 * torch.randn(shape, generator=gen) for shape in ((64, 16), (64, 16), (16, 64)))
    x = torch.randn(4, 16, generator=gen)
    pieces = [w.clone().requires_grad_() for w in shard_mlp(w1, w3, w2, rank, world)]
    x_tp = x.clone().requires_grad_()
    out = parallel_mlp(x_tp, *pieces)
    out.square().sum().backward()
    full = [w.clone().requires_grad_() for w in (w1, w3, w2)]
    x_ref = x.clone().requires_grad_()
    ref = (F.silu(x_ref @ full[0].t()) * (x_ref @ full[1].t())) @ full[2].t()
    ref.square().sum().backward()
    ref_pieces = shard_mlp(*(w.grad for w in full), rank, world)
    return {
        "local weight shapes (w1, w3, w2)": [tuple(p.shape) for p in pieces],
        "output error": (out - ref).abs().max().item(),
        "input-gradient error": (x_tp.grad - x_ref.grad).abs().max().item(),
        "weight-gradient error": max((p.grad - g).abs().max().item() for p, g in zip(pieces, ref_pieces, strict=True)),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
