"""How long each fault of docs/troubleshooting.md takes to end a run, measured on the real command line.

    python -m measure.fault_timings          # three torchrun launches, about 2 minutes

1. ``stall``: dp_shard 2 x tp 2 with a 15 s collective timeout; after step 3 one worker gets SIGSTOP. Prints
   when each surviving rank reported (seconds after the stall) and when the job ended.
2. ``sigterm``: fsdp2; after step 5 the launcher gets SIGTERM. Prints how long the ranks took to finish the
   step, save it and exit, and which step was saved.
3. ``restart``: fsdp2 under ``--max-restarts 1`` with ``--checkpoint.resume auto``; after step 5 a worker gets
   SIGKILL. Prints how long until the restarted workers resumed and how long until the run completed.

The pass/fail versions of these are tests/test_faults.py; this script only prints the figures the docs quote.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import tempfile
import time
from pathlib import Path


def stall(tmp: Path) -> None:
    from launch.local_runs import TorchrunLaunch

    run = TorchrunLaunch(
        tmp,
        4,
        "--parallel.dp_shard",
        "2",
        "--parallel.tp",
        "2",
        "--training.steps",
        "500",
        "--parallel.collective_timeout_s",
        "15",
        "--run.dir",
        str(tmp / "stall"),
    )
    run.wait_for(r"step +3 \|")
    start = time.monotonic()
    os.kill(run.workers()[3], signal.SIGSTOP)
    seen: dict[int, float] = {}
    while run.proc.poll() is None:
        for rank in map(int, re.findall(r"meshloom: rank (\d): ", run.text())):
            seen.setdefault(rank, time.monotonic() - start)
        time.sleep(0.1)
    ended = time.monotonic() - start
    run.wait(timeout=5)
    reports = ", ".join(f"rank {r} after {s:.1f} s" for r, s in sorted(seen.items()))
    print(f"stall   (timeout 15 s): {reports}; the job ended after {ended:.1f} s (torchrun's 30 s grace included)")


def sigterm(tmp: Path) -> None:
    from launch.local_runs import TorchrunLaunch

    run = TorchrunLaunch(
        tmp,
        2,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        "200",
        "--checkpoint.interval",
        "100",
        "--run.dir",
        str(tmp / "sigterm"),
    )
    run.wait_for(r"step +5 \|")
    start = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    run.wait(timeout=60)
    saved = re.search(r"stopped by SIGTERM after step (\d+)", run.text())
    step = saved.group(1) if saved else "?"
    print(
        f"sigterm: the ranks finished step {step}, saved it and exited {time.monotonic() - start:.1f} s after SIGTERM"
    )


def restart(tmp: Path) -> None:
    from launch.local_runs import TorchrunLaunch

    run = TorchrunLaunch(
        tmp,
        2,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        "12",
        "--checkpoint.interval",
        "3",
        "--checkpoint.resume",
        "auto",
        "--run.dir",
        str(tmp / "restart"),
        restarts=1,
    )
    run.wait_for(r"step +5 \|")
    start = time.monotonic()
    os.kill(run.workers()[1], signal.SIGKILL)
    resumed = run.seconds_until(r"checkpoint: resumed .* at step (\d+)", timeout=120)
    code, _ = run.wait(timeout=240)
    step = re.search(r"checkpoint: resumed .* at step (\d+)", run.text())
    print(
        f"restart: the restarted workers resumed step {step.group(1) if step else '?'} {resumed:.1f} s after the "
        f"SIGKILL; the run completed (exit {code}) after {time.monotonic() - start:.1f} s"
    )


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.fault_timings", description=__doc__.splitlines()[0])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="meshloom-faults-") as tmp:
        for measure in (stall, sigterm, restart):
            measure(Path(tmp))


if __name__ == "__main__":
    build_parser().parse_args()
    main()
