"""FSDP CPU offload: device memory per rank with and without ``parallel.fsdp_cpu_offload``, against the formula.

    torchrun --standalone --nproc-per-node dp -m bench.offload_memory      # on dp GPUs (dp = 1 works)
    .venv/bin/python -m bench.offload_memory --formula                    # the arithmetic only (any machine)

The measurement, and what it counts and why: measure/offload_memory.py. This file prints it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from measure.offload_memory import MODEL, measure, print_formula


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help=">= 2: Adam's moments exist from the second step")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--formula", action="store_true", help="print the formula only")
    args = parser.parse_args()
    from runtime.config import load_config, model_args

    psi = model_args(load_config(overrides=MODEL)).num_params()
    if args.formula or not torch.cuda.is_available():
        if not torch.cuda.is_available():
            print("no CUDA device: device memory NOT measured; the formula for this model:")
        print_formula(psi, int(os.environ.get("WORLD_SIZE", "1")))
        return
    from runtime.process import destroy_process_group, init_process_group, select_device

    control = init_process_group(select_device("cuda"), 600)
    rows = {}
    for offload in (False, True):
        mine = measure(offload, args.steps, args.seq_len, args.batch, torch.device("cuda", torch.cuda.current_device()))
        rows[offload] = max(control.all_gather_object(mine), key=lambda r: r["peak"])
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print_formula(psi, n)
        print(f"{'offload':<8} {'resident GiB':>13} {'peak GiB':>9} {'device state GiB':>17} {'host state GiB':>15}")
        for offload, r in rows.items():
            print(
                f"{str(offload):<8} {r['resident'] / 2**30:>13.2f} {r['peak'] / 2**30:>9.2f} "
                f"{r['device_state'] / 2**30:>17.2f} {r['host_state'] / 2**30:>15.2f}"
            )
    destroy_process_group()


if __name__ == "__main__":
    main()
