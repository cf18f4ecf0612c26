"""The collectives, one by one, on tensors small enough to read.

    torchrun --standalone --nproc-per-node 2 examples/collectives.py

Rank r starts every collective from x_r = [10r + 1, 10r + 2, ..., 10r + 2n] (n ranks, 2n numbers), so the
printout shows where each number went. docs/img/collectives.svg draws the same six operations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def start(rank: int, world: int) -> torch.Tensor:
    return torch.arange(1, 2 * world + 1, dtype=torch.float32) + 10 * rank


def run() -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {"x": start(rank, n).tolist()}

    x = start(rank, n)
    dist.broadcast(x, src=0)  # everyone gets rank 0's tensor
    out["broadcast"] = x.tolist()

    x = start(rank, n)
    dist.reduce(x, dst=0)  # rank 0 gets the sum; the others' buffers are unspecified afterwards
    out["reduce"] = x.tolist() if rank == 0 else None

    x = start(rank, n)
    dist.all_reduce(x)  # everyone gets the sum
    out["all_reduce"] = x.tolist()

    chunk = torch.empty(2)
    dist.reduce_scatter_tensor(chunk, start(rank, n))  # rank r gets chunk r of the sum
    out["reduce_scatter"] = chunk.tolist()

    gathered = torch.empty(2 * n)
    dist.all_gather_into_tensor(gathered, start(rank, n)[2 * rank : 2 * rank + 2])  # everyone gets every chunk
    out["all_gather"] = gathered.tolist()

    exchanged = torch.empty(2 * n)
    dist.all_to_all_single(exchanged, start(rank, n))  # chunk j of rank r goes to rank j, as its chunk r
    out["all_to_all"] = exchanged.tolist()

    if n >= 2 and rank in (0, 1):  # point to point: rank 0 sends, rank 1 receives
        msg = start(rank, n)
        dist.send(msg, dst=1) if rank == 0 else dist.recv(msg, src=0)
        out["send_recv"] = msg.tolist()
    return out


if __name__ == "__main__":
    from _launch import main

    main(run)
