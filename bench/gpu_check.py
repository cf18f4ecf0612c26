"""One command for a GPU machine: every GPU check meshloom has, within 8 minutes on one GPU, with a report.

    python -m bench.gpu_check                       # writes gpu_check/report.json and gpu_check/report.md
    python -m bench.gpu_check --out DIR --only gpu-tests,async-save

Without a visible GPU it says so, writes a report whose every check is "not run", and exits 0.

How it runs:

1. ``CHECKS`` lists the checks, each a ``Check(name, run, budget_s, what)``: ``run`` is a module-level
   function that returns a dict of measured figures (its ``summary`` entry is the report's one-line
   summary) or raises. The budgets add up to at most ``TOTAL_S`` (8 minutes).
2. Each check runs in a process of its own (``python -m bench.gpu_check --child module:function``): a fresh
   CUDA context, and a hard limit. A check still running at its budget (or when the 8 minutes are spent)
   is killed with its whole process group (the ranks it spawned too) and reported "timed out"; the next
   check starts. So one hung check cannot eat the others' time.
3. The report lists every check with its status (passed, failed, timed out, not run), its seconds and its
   figures: ``report.json`` for machines, ``report.md`` for people. Every figure in it was measured in this
   invocation; nothing is filled in. The exit status is 1 if any check failed or timed out, else 0.

The checks:

- ``gpu-tests``: ``pytest -m gpu`` (tests/test_gpu.py and any other test marked ``gpu``): GPU runs against the
  CPU reference, on one GPU (tests needing two skip on one).
- ``throughput-1b``: bench/throughput.py ``--gpu-1b``: a Llama-3.2-1B-shaped model in bf16, meshloom against a
  plain PyTorch loop, tokens/s, TFLOP/s, MFU (with a known peak) and peak memory.
- ``ring-attention-16k``: bench/ring_attention.py ``--cp 1``: ring attention as mesh/context_parallel.py runs
  it (a one-rank ring on one GPU: one causal block through the fused kernel, no messages) against plain SDPA
  (models/llama.py: ``causal_attention``) on 16,384 tokens in bf16, forward and backward: time and peak
  memory.
- ``moe-experts``: bench/moe_grouped_mm.py: models/moe.py's experts as one grouped GEMM
  (``torch._grouped_mm``) against the per-expert loop, forward and backward on 65,536 routed rows, 8 experts of
  2048 -> 1408, bf16: rows per second of each.
- ``async-save``: bench/async_save.py ``--gpu``: the training thread's stall per save, synchronous against
  asynchronous.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[1]
TOTAL_S = 8 * 60


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], dict]  # module-level: the child process imports it by name
    budget_s: int
    what: str


class CheckFailed(AssertionError):
    """A check ran and its result is wrong (a test failed, a run crashed)."""


# ---- the checks (each runs in a process of its own, on the GPU) ---------------------------------------------
def gpu_tests() -> dict:
    """``pytest -m gpu`` from the repository root; fails unless every selected test passed or skipped."""
    import re

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    if proc.returncode != 0:
        raise CheckFailed(f"pytest -m gpu exited {proc.returncode}: {summary}\n" + "\n".join(lines[-60:]))
    return {"summary": summary, **counts}


def throughput_1b() -> dict:
    """bench/throughput.py --gpu-1b, one round, without the compiled run (its compile alone takes minutes)."""
    from bench import throughput

    result = throughput.main(["--gpu-1b", "--rounds", "1", "--no-compile"])
    runs = result["runs"]
    best = runs.get("meshloom bf16, selective AC", next(iter(runs.values())))
    mfu = f", MFU {best['mfu']:.1%}" if best["mfu"] is not None else " (no peak known for this GPU: no MFU)"
    result["summary"] = (
        f"meshloom bf16 selective AC: {best['tokens_per_s']:,.0f} tok/s, {best['tflops']:.1f} TFLOP/s{mfu}, "
        f"peak {best['peak_gib']:.1f} GiB"
    )
    return result


def peak_tracker(device):
    """(reset, peak): the allocator's peak bytes since ``reset`` on a GPU; on a CPU (the smoke test) 0."""
    import torch

    if device.type != "cuda":
        return (lambda: 0), (lambda: 0)

    def reset() -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)

    return reset, lambda: torch.cuda.max_memory_allocated(device)


def ring_attention_16k(seq: int = 16384, device_name: str = "cuda") -> dict:
    """bench/ring_attention.py on one GPU: a one-rank ring (one causal block through the fused kernel, no
    messages) against plain SDPA on ``seq`` local tokens, bf16, forward and backward: time and peak memory."""
    from bench import ring_attention

    dtype = "bf16" if device_name == "cuda" else "fp32"
    argv = ["--device", device_name, "--dtype", dtype, "--cp", "1", "--lengths", str(seq), "--repeats", "2", "--json"]
    result = ring_attention.main(argv)
    row = result["rows"][-1]
    result["summary"] = (
        f"{row['n']:,} tokens, {dtype}: ring {row['ring_s']:.3f} s vs SDPA {row['sdpa_s']:.3f} s; peak "
        f"{row['ring_bytes'] / 2**30:.2f} GiB vs {row['sdpa_bytes'] / 2**30:.2f} GiB ({row['ring_vs_sdpa']:.2f}x)"
    )
    return result


def moe_experts(rows: int = 65536, dim: int = 2048, hidden: int = 1408, rounds: int = 5, device_name="cuda") -> dict:
    """bench/moe_grouped_mm.py on the GPU: 8 experts as one grouped GEMM against the per-expert loop, bf16,
    forward and backward on ``rows`` routed rows: rows per second of each path."""
    from bench import moe_grouped_mm

    dtype = "bf16"
    argv = ["--device", device_name, "--dtypes", dtype, "--tokens", str(rows), "--dim", str(dim)]
    result = moe_grouped_mm.main([*argv, "--hidden", str(hidden), "--rounds", str(rounds), "--json"])
    row = result["rows"][0]
    grouped = (
        f"grouped {row['grouped_rows_per_s']:,.0f} rows/s ({row['grouped_speedup']:.2f}x the loop)"
        if row["grouped_mm_runs"]
        else "torch._grouped_mm does not run here"
    )
    result["summary"] = (
        f"{rows:,} rows, {dim}->{hidden}, {dtype}: loop {row['looped_rows_per_s']:,.0f} rows/s, {grouped}"
    )
    return result


def async_save_stall() -> dict:
    """bench/async_save.py on the GPU: the stall per save of a synchronous and an asynchronous save."""
    from bench import async_save

    result = async_save.measure(world=1, steps=7, interval=2, gpu=True, timeout=300)
    result["summary"] = (
        f"stall per save: sync {result['sync']['stall_s']:.3f} s, async {result['async']['stall_s']:.3f} s "
        f"({result['ratio']:.1f}x) for {result['state_bytes'] / 2**30:.1f} GiB"
    )
    return result


CHECKS = [
    Check("gpu-tests", gpu_tests, 190, "pytest -m gpu"),
    Check("throughput-1b", throughput_1b, 140, "1B bf16 tokens/s, TFLOP/s, MFU, peak memory"),
    Check("ring-attention-16k", ring_attention_16k, 45, "ring attention vs plain SDPA at 16k: time, memory"),
    Check("moe-experts", moe_experts, 25, "MoE experts: grouped GEMM vs loop (rows/s)"),
    Check("async-save", async_save_stall, 70, "training-thread stall per save, sync vs async"),
]


# ---- running them ----------------------------------------------------------------------------------------
def reference(fn: Callable) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def run_child(ref: str, result_path: str) -> int:
    """Step 2, in the child: run the check ``module:function``; write its figures or its error as JSON."""
    module, _, name = ref.partition(":")
    try:
        outcome = {"ok": True, "result": getattr(importlib.import_module(module), name)()}
    except BaseException as exc:  # noqa: BLE001 - every failure goes into the report
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(outcome, default=str))
    return 0 if outcome["ok"] else 1


def run_check(check: Check, limit_s: float) -> dict:
    """Step 2, in the parent: the check in its own process group, killed at ``limit_s``."""
    with tempfile.TemporaryDirectory(prefix="meshloom-gpu-check-") as tmp:
        result_path = Path(tmp) / "result.json"
        log_path = Path(tmp) / "output.log"
        start = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.gpu_check",
                    "--child",
                    reference(check.run),
                    "--result",
                    str(result_path),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills the ranks it spawned too
            )
            try:
                proc.wait(timeout=limit_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
        seconds = time.monotonic() - start
        output = log_path.read_text(errors="replace")
        entry = {"name": check.name, "what": check.what, "budget_s": check.budget_s, "seconds": round(seconds, 1)}
        if timed_out:
            return {
                **entry,
                "status": "timed out",
                "error": f"still running after {limit_s:.0f} s",
                "log": output[-4000:],
            }
        if not result_path.exists():
            return {
                **entry,
                "status": "failed",
                "error": f"exited {proc.returncode} with no result",
                "log": output[-4000:],
            }
        outcome = json.loads(result_path.read_text())
        if outcome["ok"]:
            return {**entry, "status": "passed", "result": outcome["result"]}
        return {**entry, "status": "failed", "error": outcome["error"], "log": outcome["traceback"][-4000:]}


def gpu_description() -> str | None:
    """The visible GPU's name, or None without one (asked in this process; the checks run in others)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def run_checks(checks: list[Check], out: Path, total_s: float = TOTAL_S, gpu: str | None = None) -> dict:
    """Steps 2-3: run ``checks`` one after the other (or mark them "not run" without a ``gpu``); write the
    report into ``out``; return it."""
    import torch

    deadline = time.monotonic() + total_s
    entries = []
    for check in checks:
        left = deadline - time.monotonic()
        if gpu is None:
            entries.append({"name": check.name, "what": check.what, "budget_s": check.budget_s, "status": "not run"})
            continue
        if left <= 1:
            spent = f"the {total_s:.0f} s of the whole check were spent before it started"
            entries.append(
                {
                    "name": check.name,
                    "what": check.what,
                    "budget_s": check.budget_s,
                    "status": "timed out",
                    "error": spent,
                }
            )
            continue
        print(f"gpu_check: {check.name} ({check.what}; at most {min(check.budget_s, left):.0f} s) ...", flush=True)
        entry = run_check(check, min(check.budget_s, left))
        print(f"gpu_check: {check.name}: {entry['status']} in {entry['seconds']} s", flush=True)
        entries.append(entry)
    report = {
        "gpu": gpu,
        "ran": gpu is not None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_budget_s": total_s,
        "checks": entries,
        "ok": all(e["status"] in ("passed", "not run") for e in entries),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    """The report for people: one row per check, then each failure's error and the end of its output."""
    if report["ran"]:
        head = f"GPU: {report['gpu']}; torch {report['torch']}; {report['date']}. Every figure below was measured now."
    else:
        head = f"No GPU visible (torch.cuda.is_available() is False): nothing was run or measured. torch {report['torch']}."
    lines = [
        "# meshloom GPU check",
        "",
        head,
        "",
        "| check | status | seconds (budget) | result |",
        "|---|---|---|---|",
    ]
    for e in report["checks"]:
        seconds = f"{e['seconds']} ({e['budget_s']})" if "seconds" in e else f"- ({e['budget_s']})"
        result = e.get("result", {}).get("summary", "") if e["status"] == "passed" else e.get("error", "")
        lines.append(
            f"| {e['name']}: {e['what']} | {e['status']} | {seconds} | {result.splitlines()[0] if result else ''} |"
        )
    for e in report["checks"]:
        if e["status"] in ("failed", "timed out"):
            lines += ["", f"## {e['name']}: {e['status']}", "", "```", e.get("error", ""), e.get("log", ""), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="folder for report.json and report.md")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # module:function, run in this process
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.result)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in CHECKS})
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(c.name for c in CHECKS)}")
    checks = [c for c in CHECKS if not names or c.name in names]
    gpu = gpu_description()
    if gpu is None:
        print("gpu_check: no GPU visible (torch.cuda.is_available() is False): nothing run", flush=True)
    report = run_checks(checks, Path(args.out), gpu=gpu)
    for e in report["checks"]:
        summary = e.get("result", {}).get("summary") or e.get("error", "")
        print(f"  {e['name']:<20} {e['status']:<10} {summary.splitlines()[0] if summary else ''}")
    print(f"gpu_check: report in {Path(args.out) / 'report.md'} and report.json", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
