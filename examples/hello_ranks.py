"""Processes, ranks and the process group: what torchrun gives each process.

    torchrun --standalone --nproc-per-node 2 examples/hello_ranks.py

torchrun starts N copies of this script. Each copy finds its identity in environment variables (RANK, its
number in the whole job; LOCAL_RANK, its number on this machine; WORLD_SIZE) and where to meet the others
(MASTER_ADDR, MASTER_PORT). ``init_process_group`` uses them to connect every process to every other: the
*default process group*. A collective such as ``all_reduce`` is then a call that every rank of a group
makes; it returns once all of them have made it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    x = torch.tensor([float(rank)])  # every rank holds a different number ...
    dist.all_reduce(x)  # ... and after the all-reduce every rank holds their sum
    return {"rank": rank, "world_size": world, "backend": dist.get_backend(), "env": env, "sum_of_ranks": x.item()}


if __name__ == "__main__":
    from _launch import main

    main(run)
