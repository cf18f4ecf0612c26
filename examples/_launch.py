"""The three lines every example's ``__main__`` needs: join the group torchrun describes, run, leave."""

from __future__ import annotations

import pprint

import torch
import torch.distributed as dist


def main(run) -> None:
    torch.set_num_threads(1)  # ranks share the CPU cores; one thread each is fastest
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from torchrun
    try:
        result = run()
        for rank in range(dist.get_world_size()):  # print rank by rank so the lines do not interleave
            if rank == dist.get_rank():
                print(f"--- rank {rank} ---\n{pprint.pformat(result, width=110, sort_dicts=False)}", flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()
