"""Context parallelism from scratch: the balanced split, attention over all-gathered K/V, and the ring's
log-sum-exp merge, on plain torch.distributed.

    torchrun --standalone --nproc-per-node 2 examples/ring_attention_from_scratch.py

One sequence of s tokens is cut into 2·cp chunks; rank r keeps chunks r and 2·cp−1−r (``positions``), so every
rank has the same causal work. A query at position i sees the keys at positions j <= i: with positions in
hand, the mask between any queries and any keys is ``q_pos[:, None] >= k_pos[None, :]``.

- ``gathered_attention``: all-gather every rank's K and V (``AllGatherKV``: its backward reduce-scatters dK
  and dV, since every rank's queries used every rank's keys), then attend the local queries to all keys.
- ``ring_attention_forward``: cp steps; at step t this rank holds the K and V of rank r − t, attends to
  them, merges the partial result into the running one with the log-sum-exp rule, and passes the block on.
  A query row that sees none of a block's keys has lse = −inf there, and must add 0, not NaN.

Tensors are (batch, heads, tokens, head_dim). Both check themselves against one device, and
tests/test_from_scratch.py checks them against meshloom's mesh/context_parallel.py (outputs, and all
gradients for the gathered version).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])


def attend(q, k, v, q_pos, k_pos) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of q over these keys under the causal mask of their positions."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # a row with no visible key: all zeros
    return weights @ v, lse


class AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # (b, h, n, d) -> (b, h, cp·n, d), rank order
        cp = dist.get_world_size()
        out = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype)  # ranks' tensors one after another
        dist.all_gather_into_tensor(out, x.contiguous())
        return out.unflatten(0, (cp, -1)).movedim(0, 2).flatten(2, 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # sum every rank's gradient of my keys
        cp = dist.get_world_size()
        pieces = grad.unflatten(2, (cp, -1)).movedim(2, 0).flatten(0, 1).contiguous()  # rank j's keys at j
        mine = torch.empty((pieces.shape[0] // cp, *pieces.shape[1:]), dtype=grad.dtype)
        dist.reduce_scatter_tensor(mine, pieces)
        return mine


def gathered_attention(q, k, v) -> torch.Tensor:
    rank, cp = dist.get_rank(), dist.get_world_size()
    seq = cp * q.shape[2]
    k_pos = torch.cat([positions(seq, j, cp) for j in range(cp)])  # the gathered keys' positions, rank by rank
    out, _ = attend(q, AllGatherKV.apply(k), AllGatherKV.apply(v), positions(seq, rank, cp), k_pos)
    return out


def ring_attention_forward(q, k, v) -> torch.Tensor:
    rank, cp = dist.get_rank(), dist.get_world_size()
    seq = cp * q.shape[2]
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for step in range(cp):
        src = (rank - step) % cp  # whose K and V this rank holds now
        block_out, block_lse = attend(q, k, v, positions(seq, rank, cp), positions(seq, src, cp))
        new_lse = torch.logaddexp(lse, block_lse)  # log(e^lse + e^block_lse)
        out = out * torch.exp(lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)[..., None]
        lse = new_lse
        if step < cp - 1:  # pass the block on: to rank + 1, from rank - 1
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            sends = [dist.isend(k, (rank + 1) % cp), dist.isend(v, (rank + 1) % cp)]
            dist.recv(k_next, (rank - 1) % cp)
            dist.recv(v_next, (rank - 1) % cp)
            for request in sends:
                request.wait()
            k, v = k_next, v_next
    return out


def run() -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)  # the same full sequence on every rank
    q, k, v = (torch.randn(1, 2, 8 * cp, 4, generator=gen) for _ in "qkv")
    mine = positions(8 * cp, rank, cp)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = (
        torch.softmax(
            (full[0] @ full[1].transpose(-1, -2) / 2.0).masked_fill(torch.ones(8 * cp, 8 * cp).triu(1).bool(), -1e9), -1
        )
        @ full[2]
    )
    reference.square().sum().backward()
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    gathered = gathered_attention(*local)
    gathered.square().sum().backward()
    ring = ring_attention_forward(*(t[:, :, mine] for t in (q, k, v)))
    return {
        "my positions": mine.tolist(),
        "gathered output error": (gathered - reference[:, :, mine]).abs().max().item(),
        "gathered gradient error (q, k, v)": [
            (t.grad - f.grad[:, :, mine]).abs().max().item() for t, f in zip(local, full, strict=True)
        ],
        "ring output error": (ring - reference[:, :, mine]).abs().max().item(),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
