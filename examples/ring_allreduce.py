"""All-reduce by hand on a ring: a reduce-scatter, then an all-gather, each n - 1 neighbour-to-neighbour steps.

    torchrun --standalone --nproc-per-node 4 examples/ring_allreduce.py     (or 2 ranks, or 3)

Every rank cuts its N-element vector into n chunks. In step s of the reduce-scatter, rank r sends chunk
(r - s) mod n to rank r + 1 and adds the chunk it receives from rank r - 1 into its own copy; after n - 1
steps rank r holds chunk (r + 1) mod n fully summed. The all-gather then passes the summed chunks around
the same ring. Each step moves N/n elements per rank, so the whole all-reduce sends 2(n - 1)/n * N
elements per rank: just under 2N, whatever n is. ``run`` counts them and checks the result against
``dist.all_reduce``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_all_reduce(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum ``x`` over all ranks in place; returns (x, elements this rank sent)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.chunk(n))  # views into x: adding into them changes x
    right, left, sent = (rank + 1) % n, (rank - 1) % n, 0

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_idx])
        request = dist.isend(chunks[send_idx].contiguous(), right)  # send and receive at once: no deadlock
        dist.recv(incoming, left)
        request.wait()
        sent += chunks[send_idx].numel()
        return incoming

    for step in range(n - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
        chunks[recv_idx] += exchange(send_idx, recv_idx)
    for step in range(n - 1):  # all-gather: pass the finished chunks around
        send_idx, recv_idx = (rank + 1 - step) % n, (rank - step) % n
        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))
    return x, sent


def run(numel: int = 1200) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expected = x.clone()
    dist.all_reduce(expected)
    mine, sent = ring_all_reduce(x.clone())
    return {
        "max_error": (mine - expected).abs().max().item(),
        "elements_sent": sent,
        "2(n-1)/n*N": 2 * (n - 1) / n * numel,
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
