"""Compute, communication and *exposed* communication per rank, from the traces of a profiled run.

    torchrun --standalone --nproc-per-node 2 train.py --config configs/debug.toml --training.steps 4 \\
        --profile.enabled true --profile.start_step 3 --profile.steps 2 --run.dir runs/prof
    python -m training.comm_share runs/prof          # table on the console, runs/prof/profile/comm_share.json

Communication only costs step time when nothing else runs meanwhile. For each profiled step (a
``ProfilerStep#N`` range of ``profiling.StepProfiler``) and each rank the command measures three sets of
time, each the union of intervals (nested or overlapping events count once):

1. **Compute** C. On GPUs: every kernel that is not an NCCL kernel. On CPU (gloo): the training thread's
   operators (``cpu_op`` events), minus the stretches it spends inside a collective call or a wait
   (``c10d::*``, ``_c10d_functional::*``, ``record_param_comms``), which may be nested inside an operator
   (a DTensor matmul all-gathers its input from inside ``aten::mm``).
2. **Communication** M. On GPUs: the NCCL kernels. On CPU: gloo's own ``gloo:*`` ranges, which run on
   gloo's worker threads, together with the training thread's collective calls and waits.
3. **Exposed communication** M - C: communication while no compute runs. ``overlapped`` = M ∩ C is
   communication hidden behind compute; ``other`` is the rest of the step: Python, the framework's
   bookkeeping, the data loader, or waiting for a peer with no collective in flight yet.

So ``compute + exposed + other = step``, and ``exposed + overlapped = communication``. The rule of thumb
printed next to each rank: exposed communication under 30% of the step. One row per rank; under the rows,
the spread of compute across the ranks (max / min of their compute, the slowest rank named) against the
15% rule that observers/rank_balance.py applies to every step of a run. (On a 2-core CPU, gloo's threads
compete with the training thread for the same cores, so "overlapped" time is not free there the way it is
with NCCL's kernels beside a GPU's compute kernels.)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RULE_OF_THUMB = 0.30  # exposed communication should stay under this share of the step
COMM_CALL = re.compile(r"^(c10d::|_c10d_functional::|_c10d_functional_autograd::|record_param_comms|nccl:)")

Intervals = list[tuple[float, float]]


# ---- interval arithmetic (microseconds) ------------------------------------------------------------------
def union(intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a minus b (each sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def clip(intervals: Intervals, window: tuple[float, float]) -> Intervals:
    return intersect(intervals, [window])


# ---- reading one rank's trace ---------------------------------------------------------------------------
def load_trace(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _span(e: dict) -> tuple[float, float]:
    return (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))


def step_shares(trace: dict) -> list[dict]:
    """Per profiled step of one rank's trace: the step's time and its compute/communication split (ms)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace has no ProfilerStep#N range: was it written by profile.enabled?")
    main_thread = steps[0]["tid"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # GPU: kernels on the device streams
        comm_spans = [_span(e) for e in kernels if "nccl" in e["name"].lower()]
        compute_spans = union(_span(e) for e in kernels if "nccl" not in e["name"].lower())
        device = "gpu"
    else:  # CPU: gloo's threads, and the training thread's own operators
        ops = [e for e in events if e.get("cat") == "cpu_op" and e["tid"] == main_thread]
        calls = union(_span(e) for e in ops if COMM_CALL.match(e["name"]))
        comm_spans = [_span(e) for e in events if e["name"].startswith("gloo:")] + calls
        compute_spans = subtract(union(_span(e) for e in ops if not COMM_CALL.match(e["name"])), calls)
        device = "cpu"
    comm_all = union(comm_spans)
    rows = []
    for step in steps:
        window = _span(step)
        compute, comm = clip(compute_spans, window), clip(comm_all, window)
        step_us = window[1] - window[0]
        exposed = total(subtract(comm, compute))
        rows.append(
            {
                "step": int(step["name"].split("#")[1]),
                "device": device,
                "step_ms": step_us / 1e3,
                "compute_ms": total(compute) / 1e3,
                "communication_ms": total(comm) / 1e3,
                "exposed_ms": exposed / 1e3,
                "overlapped_ms": total(intersect(comm, compute)) / 1e3,
                "other_ms": (step_us - total(union(compute + comm))) / 1e3,
            }
        )
    return rows


def rank_summary(rank: int, rows: list[dict]) -> dict:
    """Mean over the profiled steps, with shares of the step and the 30% verdict."""
    keys = ("step_ms", "compute_ms", "communication_ms", "exposed_ms", "overlapped_ms", "other_ms")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    shares = {k.replace("_ms", "_share"): mean[k] / mean["step_ms"] for k in keys if k != "step_ms"}
    return {
        "rank": rank,
        "device": rows[0]["device"],
        "steps": [r["step"] for r in rows],
        **mean,
        **shares,
        "under_30_percent_rule": shares["exposed_share"] < RULE_OF_THUMB,
        "per_step": rows,
    }


def comm_share(run_dir: str | Path) -> list[dict]:
    """One summary per rank for the traces in ``<run_dir>/profile``."""
    folder = Path(run_dir) / "profile"
    paths = sorted(folder.glob("rank*.pt.trace.json"), key=lambda p: int(p.name[4:].split(".")[0]))
    if not paths:
        raise FileNotFoundError(f"no rank*.pt.trace.json in {folder}: run train.py with --profile.enabled true first")
    return [rank_summary(int(p.name[4:].split(".")[0]), step_shares(load_trace(p))) for p in paths]


def format_table(summaries: list[dict]) -> str:
    lines = [
        f"{'rank':>4} {'step ms':>9} {'compute':>16} {'communication':>16} {'exposed':>16} "
        f"{'overlapped':>10} {'other':>16}  exposed < 30% of step?"
    ]
    for s in summaries:
        cell = lambda k, s=s: f"{s[k + '_ms']:8.1f} ({s[k + '_share']:5.1%})"  # noqa: E731
        verdict = "yes" if s["under_30_percent_rule"] else "NO: communication-bound"
        lines.append(
            f"{s['rank']:>4} {s['step_ms']:9.1f} {cell('compute'):>16} {cell('communication'):>16} "
            f"{cell('exposed'):>16} {s['overlapped_ms']:10.1f} {cell('other'):>16}  {verdict}"
        )
    lines.append(spread_line(summaries))
    return "\n".join(lines)


def spread_line(summaries: list[dict]) -> str:
    """The ranks' compute spread, max / min, against observers/rank_balance.py's 15% rule."""
    from observers.rank_balance import SPREAD_RULE

    slowest = max(summaries, key=lambda s: s["compute_ms"])
    fastest = min(s["compute_ms"] for s in summaries)
    spread = slowest["compute_ms"] / fastest if fastest > 0 else float("inf")
    verdict = "within" if spread <= SPREAD_RULE else "ABOVE"
    return (
        f"compute across ranks: max / min {spread:.2f} (slowest rank {slowest['rank']}), {verdict} the "
        f"{SPREAD_RULE - 1:.0%} rule"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command's options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    from runtime.options import path_option

    parser = argparse.ArgumentParser(prog="python -m training.comm_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=path_option(), help="the run.dir of a run trained with --profile.enabled true")
    parser.add_argument(
        "--json", type=path_option(), help="where to write the JSON (default <run_dir>/profile/comm_share.json)"
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        summaries = comm_share(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"comm_share: {exc}", file=sys.stderr)
        return 2
    out = Path(args.json) if args.json else Path(args.run_dir) / "profile" / "comm_share.json"
    compute = [s["compute_ms"] for s in summaries]
    spread = max(compute) / min(compute) if min(compute) > 0 else float("inf")
    report = {"rule_of_thumb_exposed_share": RULE_OF_THUMB, "compute_spread": spread, "ranks": summaries}
    out.write_text(json.dumps(report, indent=1))
    device = summaries[0]["device"]
    print(f"{args.run_dir}: mean over profiled steps {summaries[0]['steps']} ({device} trace), times in ms")
    print(format_table(summaries))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
