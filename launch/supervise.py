"""Relaunch a training command until it completes: the restart path for multi-node runs.

    python -m launch.supervise --max-relaunches 3 -- \\
        torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id myrun \\
        train.py --config ... --checkpoint.interval 500 --checkpoint.resume auto

Why: ``torchrun --max-restarts`` restarts the workers *inside* one launcher, reusing its key-value store.
meshloom keeps each restart's keys apart by the restart count (runtime/process.py), which every worker of a
single node agrees on. Across nodes the count can differ: a launcher whose own workers look healthy restarts
them when another node re-joins, without counting a restart, and the nodes then look for each other's keys
under different names. A fresh launcher has a fresh store, so relaunching the whole command sidesteps this.

1. The command must resume (``--checkpoint.resume auto``): a relaunch that started from scratch would lose
   the run. Checked before the first launch.
2. Run it, passing its output through. Exit 0: done.
3. A failure that a relaunch cannot fix stops the supervisor with the same code: bad input (2) and
   divergence (3), read from train.py's exit status or, under torchrun, from the exit codes its failure
   summary lists for the workers.
4. A signal to the supervisor (SIGTERM/SIGINT: preemption, Ctrl-C) is passed to the command, which saves and
   stops; the supervisor then stops too.
5. Otherwise (a worker died, a collective timed out, a node was lost): wait ``--wait`` seconds and relaunch,
   at most ``--max-relaunches`` times.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import time

FINAL = {2: "bad input", 3: "the run diverged"}


def resumes(command: list[str]) -> bool:
    text = " ".join(command)
    return bool(re.search(r"--checkpoint\.resume(=|\s+)auto\b", text))


def worker_codes(output: str) -> set[int]:
    """The workers' exit codes listed in torchrun's failure summary (empty for a plain command)."""
    return {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}


def run_once(command: list[str], forwarded: list[int]) -> tuple[int, str]:
    """Run ``command``; its output is passed through and kept. A signal received meanwhile is forwarded."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def forward(signum, frame):
        forwarded.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    kept = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            kept.append(line)
        return proc.wait(), "".join(kept)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py): a bad value is refused with exit 2."""
    from runtime.options import float_option, int_option

    parser = argparse.ArgumentParser(prog="python -m launch.supervise", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--max-relaunches", type=int_option(ge=0, le=10**6), default=3, help="relaunches after the first launch"
    )
    parser.add_argument(
        "--wait", type=float_option(ge=0, le=86400), default=10.0, help="seconds between a failure and the relaunch"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        parser.error("give the training command after --")
    if not resumes(command):
        print(
            "meshloom supervise: the command must include --checkpoint.resume auto, or each relaunch would start "
            "the run from scratch; add it (the first launch then starts fresh).",
            file=sys.stderr,
        )
        return 2
    if shutil.which(command[0]) is None:  # Popen's FileNotFoundError would be a traceback
        print(
            f"meshloom supervise: the command {command[0]!r} is not found (not a file, not on PATH); give the training "
            "command after --, e.g. -- torchrun --nproc-per-node 8 train.py ...",
            file=sys.stderr,
        )
        return 2
    for attempt in range(opts.max_relaunches + 1):
        forwarded: list[int] = []
        code, output = run_once(command, forwarded)
        if code == 0:
            return 0
        if forwarded:
            print(
                f"meshloom supervise: stopped by {signal.Signals(forwarded[0]).name}; not relaunching", file=sys.stderr
            )
            return code
        final = (worker_codes(output) or {code}) & set(FINAL)
        if final:
            reason = FINAL[min(final)]
            print(f"meshloom supervise: {reason} (exit code {min(final)}); a relaunch would not help", file=sys.stderr)
            return min(final)
        if attempt == opts.max_relaunches:
            print(f"meshloom supervise: failed (exit code {code}) and no relaunch is left", file=sys.stderr)
            return code
        print(
            f"meshloom supervise: failed (exit code {code}); relaunch {attempt + 1} of {opts.max_relaunches} in "
            f"{opts.wait:g} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(opts.wait)
    return 1


if __name__ == "__main__":
    sys.exit(main())
