"""The few lines every example's ``__main__`` needs: join the group torchrun describes, run, leave.

Started without torchrun (no RANK in the environment), a script runs as one process without a process group;
only examples/mixed_precision_fp16.py, which does not communicate, is meant to be run that way.
"""

from __future__ import annotations

import gc
import os
import pprint

import torch
import torch.distributed as dist


def main(run) -> None:
    torch.set_num_threads(1)  # ranks share the CPU cores; one thread each is fastest
    if "RANK" not in os.environ:
        print(pprint.pformat(run(), width=110, sort_dicts=False), flush=True)
        return
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from torchrun
    try:
        result = run()
        for rank in range(dist.get_world_size()):  # print rank by rank so the lines do not interleave
            if rank == dist.get_rank():
                print(f"--- rank {rank} ---\n{pprint.pformat(result, width=110, sort_dicts=False)}", flush=True)
            dist.barrier()
    finally:
        # A DDP model left in a reference cycle keeps its reducer, and the reducer the gloo group, alive past
        # destroy_process_group; the group's threads then meet interpreter shutdown still running ("terminate
        # called without an active exception", SIGABRT: examples/ddp_no_sync.py, 3 runs in 25 on torch 2.15).
        # Collecting the cycles first lets the group go while its threads can still be joined.
        gc.collect()
        dist.destroy_process_group()
