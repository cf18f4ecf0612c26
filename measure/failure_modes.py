"""What gloo does when a rank misbehaves: the troubleshooting table of docs/combining.md, Appendix C.

    python -m measure.failure_modes        # four 2-rank torchrun launches, about a minute

1. ``mismatch``: rank 0 all-reduces a tensor of shape [2], rank 1 one of shape [3];
2. the same with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``;
3. ``exit``: rank 1 exits before the all-reduce that rank 0 waits in;
4. ``timeout``: the process group has a 10 s timeout and rank 1 sleeps 20 s before the all-reduce.

Each launch prints, per rank, what the all-reduce returned or raised and after how many seconds; this
script prints those lines and torchrun's root-cause summary.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

SCENARIOS = {"mismatch": {}, "mismatch-detail": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "exit": {}, "timeout": {}}


def worker(scenario: str) -> None:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=10 if scenario == "timeout" else 60)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    x = torch.ones(3 if (scenario.startswith("mismatch") and rank == 1) else 2)
    if scenario == "exit" and rank == 1:
        sys.exit(1)
    if scenario == "timeout" and rank == 1:
        time.sleep(20)
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        print(
            f"[{scenario}] rank {rank}: all_reduce returned {x.tolist()} after {time.monotonic() - start:.1f} s",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - the point is to show it
        first = str(exc).strip().splitlines()[0][:120]
        print(
            f"[{scenario}] rank {rank}: {type(exc).__name__} after {time.monotonic() - start:.1f} s: {first}",
            flush=True,
        )
        raise


def build_parser() -> argparse.ArgumentParser:
    """No options but the one main() gives its torchrun ranks (tests/test_input_walk.py walks every parser)."""
    parser = argparse.ArgumentParser(prog="python -m measure.failure_modes", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=tuple(SCENARIOS), help=argparse.SUPPRESS)
    return parser


def main() -> None:
    for scenario, extra in SCENARIOS.items():
        env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "measure.failure_modes",
            "--worker",
            scenario,
        ]
        start = time.monotonic()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        print(
            f"--- {scenario}{' ' + str(extra) if extra else ''}: torchrun exit code {out.returncode} after "
            f"{time.monotonic() - start:.0f} s (launch included)"
        )
        text = out.stdout + out.stderr
        for line in text.splitlines():
            if line.startswith(f"[{scenario}]") or "local_rank:" in line or "exitcode" in line:
                print("   ", line.strip())


if __name__ == "__main__":
    worker_scenario = build_parser().parse_args().worker
    if worker_scenario:
        worker(worker_scenario)
    else:
        main()
