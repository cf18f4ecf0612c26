"""One command for a GPU machine: every GPU check meshloom has, on one GPU, with a report.

    python3 -m measure.gpu_check --out "$OUT/gpu_check" --budget 480                     # from the repository root
    python3 -m measure.gpu_check --out "$OUT/gpu_check" --only NAME1,NAME2 --budget 240  # rerun some, time left

``--out DIR`` is required: the folder for the report and the logs, which on a lent GPU machine must lie under
the folder the machine sends back (``$OUT``). Left out, it is ``$OUT/gpu_check`` when the environment variable
``OUT`` is set, and an error otherwise. Without a visible GPU it says so, writes a report whose every check is
"not run", and exits 0. Only the standard library is imported at module level (torch and pytest inside
functions): it runs as it is where nothing can be installed (the lent machine: Python 3.12, torch 2.11).

How it runs:

1. ``CHECKS`` lists the checks, each a ``Check(name, run, budget_s, what)``: ``run`` is a module-level
   function that returns a dict of measured figures (its ``summary`` entry is the report's one-line
   summary) or raises. They run in this order; the budgets of the checks up to ``compile-1b`` add up to at most
   ``TOTAL_S`` (8 minutes), so a first run reports them whatever happens, and the kernel and save checks after
   them run in the time the earlier ones left (their budgets are upper bounds), or in a rerun with ``--only``.
2. The report starts from ``DIR/report.json`` when one is there (an earlier invocation into the same DIR):
   its entries for the checks this invocation does not run are kept as they are, and those it runs are
   replaced. Each entry names the invocation that measured it (``run``), and ``runs`` lists the invocations.
   So a second call with ``--only`` reruns what failed or timed out, in the time left (``--budget``), and the
   report holds both calls' figures. This invocation's checks start "pending" ("not run" without a GPU), and
   the report is written at once.
3. Each check runs in a process of its own (``python -m measure.gpu_check --child module:function``): a fresh
   CUDA context, and a hard limit. Its stdout and stderr go straight to ``DIR/<name>.log``, unbuffered
   (``gpu-tests`` lets pytest write there too), so what a check printed survives whatever comes after. A
   check still running at its budget, or when the invocation's ``--budget`` seconds (default ``TOTAL_S``)
   are spent, is killed with its whole process group (the ranks it spawned too) and reported "timed out";
   the next check starts. So one hung check cannot eat the others' time.
4. The report (``report.json`` for machines, ``report.md`` for people, each replaced whole) is rewritten
   before each check, which it shows "running", and after it, with its status (passed, failed, timed out),
   seconds and figures. A kill at any moment loses nothing already measured: the report has every finished
   check, "running" for the one cut short and "pending" for the rest. SIGTERM or Ctrl-C kills the running
   check, reports it "timed out" and stops. Every figure was measured by the invocation its entry names;
   nothing is filled in.
5. The exit status is 1 if a check of this invocation failed or timed out, else 0. The last line printed
   gives the ``--only`` command that reruns every check of the report that did not pass.

The checks:

- ``gpu-tests``: ``pytest -m gpu`` (tests/test_gpu.py and any other test marked ``gpu``): GPU runs against the
  CPU reference, on one GPU (tests needing two skip on one).
- ``throughput-1b``: measure/tokens_per_second.py's ``gpu_1b`` (its ``--gpu-1b``): a Llama-3.2-1B-shaped model
  in bf16, meshloom against a plain PyTorch loop, tokens/s, TFLOP/s, MFU (with a known peak) and peak memory.
- ``compile-tp-free``: ``training.compile`` on one GPU, no tensor parallelism: the debug model and the debug MoE
  model (its grouped GEMM inside the compiled region) eagerly and compiled, 10 steps each: the largest loss
  difference, the speedup, the compilation's seconds and the recompiles after the first step.
- ``compile-1b``: ``throughput-1b``'s 1B shape with selective AC, compiled (tokens/s beside that check's eager row
  in the report), with the compilation's seconds and the recompiles after the first step.
- ``ring-attention-16k``: measure/ring_attention.py (its ``--cp 1``): ring attention as mesh/context_parallel.py
  runs it (a one-rank ring on one GPU: one causal block through the fused kernel, no messages) against plain
  SDPA (models/llama.py: ``causal_attention``) on 16,384 tokens in bf16, forward and backward: time and peak
  memory.
- ``moe-experts``: measure/moe_grouped_mm.py: models/moe.py's experts as one grouped GEMM (``torch._grouped_mm``)
  against the per-expert loop, forward and backward on 65,536 routed rows, 8 experts of 2048 -> 1408, bf16:
  rows per second of each.
- ``async-save``: measure/async_save.py (its ``--gpu``): the training thread's stall per save, synchronous
  against asynchronous.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
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
    """``pytest -m gpu`` from the repository root; fails unless every selected test passed or skipped.

    Under ``run_check`` pytest writes straight into the check's log (``GPU_CHECK_LOG``, this process's own
    stdout) as it runs, and the summary is read back from there."""
    import re

    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    log = os.environ.get("GPU_CHECK_LOG")
    if log:
        sys.stdout.flush()
        sys.stderr.flush()
        start = os.path.getsize(log)
        proc = subprocess.run(command, cwd=ROOT)  # inherits stdout and stderr: the log file
        output = Path(log).read_bytes()[start:].decode(errors="replace")
    else:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        print(output, flush=True)
    lines = output.strip().splitlines()
    summary = next(
        (line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error|skipped)", line)), ""
    )
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    if proc.returncode != 0:
        raise CheckFailed(f"pytest -m gpu exited {proc.returncode}: {summary}\n" + "\n".join(lines[-60:]))
    return {"summary": summary, **counts}


def throughput_1b(smoke: bool = False, event=None, peak_tflops: float = 0.0) -> dict:
    """measure/tokens_per_second.py's ``gpu_1b`` (measure/tokens_per_second.py --gpu-1b), one round, without the compiled run (its
    compile alone takes minutes). Passes only with a finite, positive tokens/s for every run, an MFU in (0, 1]
    where a peak is known, and the first step's loss of every run within ``LOSS_RTOL`` of the plain loop's.
    ``smoke``, ``event``, ``peak_tflops``: the CPU stand-in's run of this code path (tests/test_throughput.py)."""
    import math

    from measure.tokens_per_second import gpu_1b

    result = gpu_1b(rounds=1, no_compile=True, smoke=smoke, event=event, peak_tflops_arg=peak_tflops)
    runs = result["runs"]
    for name, run in runs.items():
        if not (math.isfinite(run["tokens_per_s"]) and run["tokens_per_s"] > 0):
            raise CheckFailed(f"{name}: tokens/s is {run['tokens_per_s']}")
        if run["mfu"] is not None and not 0 < run["mfu"] <= 1:
            raise CheckFailed(f"{name}: MFU {run['mfu']} is not in (0, 1]: the FLOP count or the peak is wrong")
    plain = next(iter(runs.values()))["first_loss"]
    for name, run in runs.items():
        if not abs(run["first_loss"] - plain) <= LOSS_RTOL * abs(plain):
            raise CheckFailed(f"{name}: first loss {run['first_loss']} vs the plain loop's {plain} (rtol {LOSS_RTOL})")
    best = runs.get("meshloom bf16, selective AC", next(iter(runs.values())))
    mfu = f", MFU {best['mfu']:.1%}" if best["mfu"] is not None else " (no peak known for this GPU: no MFU)"
    result["summary"] = (
        f"meshloom bf16 selective AC: {best['tokens_per_s']:,.0f} tok/s, {best['tflops']:.1f} TFLOP/s{mfu}, "
        f"peak {best['peak_gib']:.1f} GiB"
    )
    return result


def compile_1b(smoke: bool = False, event=None) -> dict:
    """measure/tokens_per_second.py's ``gpu_1b``, its compiled run alone (``throughput-1b`` has the eager twin): finite,
    positive tokens/s and no frame recompiled after the first step. ``smoke``, ``event``: the CPU stand-in."""
    import math

    from measure.tokens_per_second import gpu_1b

    name = "meshloom bf16, selective AC, compile"
    result = gpu_1b(rounds=1, smoke=smoke, event=event, only=(name,))
    run = result["runs"][name]
    if not (math.isfinite(run["tokens_per_s"]) and run["tokens_per_s"] > 0):
        raise CheckFailed(f"{name}: tokens/s is {run['tokens_per_s']}")
    if run["recompiles"]:
        raise CheckFailed(f"{name}: {run['recompiles']:.0f} frames recompiled after the first step")
    mfu = f", MFU {run['mfu']:.1%}" if run["mfu"] is not None else ""
    result["summary"] = (
        f"compiled, selective AC: {run['tokens_per_s']:,.0f} tok/s, {run['tflops']:.1f} TFLOP/s{mfu}; first step "
        f"+{run['first_step_extra_s']:.0f} s (compiling), {run['recompiles']:.0f} recompiles; peak {run['peak_gib']:.1f} GiB"
    )
    return result


# Compiled against eager, the same layout, 10 steps. On CUDA "auto" precision is bf16 (runtime/process.py): both runs
# round to bf16, at places inductor's fusions move, and the difference grows with the steps; the fp32 CPU runs agree
# to ~1e-7 (tests/test_expert_parallel.py). LOSS_RTOL's 2% (below) is far from that and fails a wrong gradient, which
# shows within a few steps at the loss's own size.
def compile_tp_free(device_name: str = "cuda", steps: int = 10) -> dict:
    """``training.compile`` against eager on one device, no tensor parallelism: configs/debug.toml and
    configs/debug_moe.toml, ``steps`` steps each (module docstring, ``compile-tp-free``)."""
    import statistics
    import tempfile

    from launch.spawn import run_on_ranks
    from measure.tokens_per_second import DEBUG, MOE, compile_cost, median_after, meshloom_steps

    gpus = device_name == "cuda"
    rows = {}
    for label, config in (("dense", DEBUG), ("moe", MOE)):
        runs = {}
        for compiled in (False, True):
            overrides = {"training.steps": steps, "training.compile": compiled, "run.tensorboard": False}
            overrides["training.device"] = device_name
            with tempfile.TemporaryDirectory(prefix="meshloom-compile-") as run_dir:
                runs[compiled] = run_on_ranks(meshloom_steps, 1, config, overrides, run_dir, timeout=600, gpus=gpus)[0]
        eager, compiled = runs[False], runs[True]
        diff = max(abs(a - b) / abs(b) for a, b in zip(compiled["loss"], eager["loss"], strict=True))
        if not diff <= LOSS_RTOL:
            raise CheckFailed(f"{label}: compiled loss differs from eager by {diff:.2e} (rtol {LOSS_RTOL})")
        first_extra, recompiles = compile_cost([compiled], 2)
        if recompiles:
            raise CheckFailed(f"{label}: {recompiles:.0f} frames recompiled after the first step")
        rows[label] = {
            "loss_rel_diff": diff,
            "speedup": median_after(eager["full_s"], 2) / median_after(compiled["full_s"], 2),
            "compile_s": first_extra,
            "recompiles": recompiles,
            "eager_step_s": statistics.median(eager["full_s"][2:]),
        }
    result = {"device": device_name, "steps": steps, "rows": rows}
    result["summary"] = "; ".join(
        f"{label}: {r['speedup']:.2f}x eager, loss within {r['loss_rel_diff']:.1e}, compile +{r['compile_s']:.0f} s, "
        f"{r['recompiles']:.0f} recompiles"
        for label, r in rows.items()
    )
    return result


# The first step's loss (same weights, same batch) of a bf16 run against the plain loop's: bf16 keeps 8 bits of
# mantissa (a relative step of 2**-8 = 0.4%) and the runs round at different places (autocast against a bf16
# parameter copy), so a loss near ln(vocab) may move by a few tenths of a percent; 2% is far from that, and a
# wrong normalisation (by micro-batch or rank instead of the global token count) or a NaN fails it.
LOSS_RTOL = 2e-2
# Grouped GEMM against the per-expert loop, bf16, the largest difference over the output and each gradient
# relative to that tensor's largest value: the two round the same products in a different order and at
# different places (bf16's relative step 2**-8); 3%, as tests/test_gpu_kernels.py allows, leaves room for
# sums over thousands of rows and fails a wrong expert, offset or transpose, which move the result by its size.
GROUPED_RTOL = 3e-2
# Ring attention (one causal block through the fused kernel) against plain SDPA, bf16: the same kernel family
# with and without the log-sum-exp merge; 3% as above (tests/test_gpu_kernels.py's bf16 flash tolerance). In
# fp32 (the CPU check) they agree to round-off.
RING_RTOL = 3e-2


def ring_attention_16k(seq: int = 16384, device_name: str = "cuda") -> dict:
    """measure/ring_attention.py on one GPU: a one-rank ring (one causal block through the fused kernel, no
    messages) against plain SDPA on ``seq`` local tokens, bf16, forward and backward: time and peak memory."""
    from measure.ring_attention import measure

    dtype = "bf16" if device_name == "cuda" else "fp32"
    result = measure([seq], device_name, dtype, cp=1, repeats=2)
    row = result["rows"][-1]
    for key in ("out_rel_diff", "grad_rel_diff"):
        if not row[key] <= RING_RTOL:
            raise CheckFailed(f"ring attention vs SDPA: {key} {row[key]:.3g} > {RING_RTOL} at {row['s_cp']} tokens")
    result["summary"] = (
        f"{row['s_cp']:,} tokens, {dtype}: ring {row['ring_s']:.3f} s vs SDPA {row['sdpa_s']:.3f} s; peak "
        f"{row['ring_bytes'] / 2**30:.2f} GiB vs {row['sdpa_bytes'] / 2**30:.2f} GiB ({row['ring_vs_sdpa']:.2f}x); "
        f"max rel diff out {row['out_rel_diff']:.1e}, grads {row['grad_rel_diff']:.1e} (<= {RING_RTOL})"
    )
    return result


def moe_experts(rows: int = 65536, dim: int = 2048, hidden: int = 1408, rounds: int = 5, device_name="cuda") -> dict:
    """measure/moe_grouped_mm.py on the GPU: 8 experts as one grouped GEMM against the per-expert loop, bf16,
    forward and backward on ``rows`` routed rows: rows per second of each path."""
    import torch

    from measure.moe_grouped_mm import measure

    dtype = "bf16"
    if device_name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    row = measure(torch.device(device_name), torch.bfloat16, rows, 8, dim, hidden, rounds)
    if row["grouped_mm_runs"]:
        for key in ("forward_rel_diff", "backward_rel_diff"):
            if not row[key] <= GROUPED_RTOL:
                raise CheckFailed(f"grouped GEMM vs the loop: {key} {row[key]:.3g} > {GROUPED_RTOL}")
    result = {
        "device": device_name,
        "shape": {"tokens": rows, "experts": 8, "dim": dim, "hidden": hidden},
        "rows": [row],
    }
    grouped = (
        f"grouped {row['grouped_rows_per_s']:,.0f} rows/s ({row['grouped_speedup']:.2f}x the loop)"
        if row["grouped_mm_runs"]
        else "torch._grouped_mm does not run here"
    )
    result["summary"] = (
        f"{rows:,} rows, {dim}->{hidden}, {dtype}: loop {row['looped_rows_per_s']:,.0f} rows/s, {grouped}"
        + (
            f"; max rel diff forward {row['forward_rel_diff']:.1e}, backward {row['backward_rel_diff']:.1e} "
            f"(<= {GROUPED_RTOL})"
            if row["grouped_mm_runs"]
            else ""
        )
    )
    return result


def async_save_stall() -> dict:
    """measure/async_save.py on the GPU: the stall per save of a synchronous and an asynchronous save."""
    from measure.async_save import measure

    result = measure(world=1, steps=7, interval=2, gpu=True, timeout=300)
    result["summary"] = (
        f"stall per save: sync {result['sync']['stall_s']:.3f} s, async {result['async']['stall_s']:.3f} s "
        f"({result['ratio']:.1f}x) for {result['state_bytes'] / 2**30:.1f} GiB"
    )
    return result


CHECKS = [
    Check("gpu-tests", gpu_tests, 190, "pytest -m gpu"),
    Check("throughput-1b", throughput_1b, 140, "1B bf16 tokens/s, TFLOP/s, MFU, peak memory"),
    Check("compile-tp-free", compile_tp_free, 60, "compiled vs eager, one GPU, dense and MoE: loss, speed, recompiles"),
    Check("compile-1b", compile_1b, 90, "1B bf16 selective AC compiled: tokens/s, compile s, recompiles"),
    Check("ring-attention-16k", ring_attention_16k, 45, "ring attention vs plain SDPA at 16k: time, memory"),
    Check("moe-experts", moe_experts, 25, "MoE experts: grouped GEMM vs loop (rows/s)"),
    Check("async-save", async_save_stall, 70, "training-thread stall per save, sync vs async"),
]


# ---- running them ----------------------------------------------------------------------------------------
def reference(fn: Callable) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def run_child(ref: str, result_path: str) -> int:
    """Step 3, in the child: run the check ``module:function``; write its figures or its error as JSON."""
    module, _, name = ref.partition(":")
    try:
        outcome = {"ok": True, "result": getattr(importlib.import_module(module), name)()}
    except BaseException as exc:  # noqa: BLE001 - every failure goes into the report
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(outcome, default=str))
    return 0 if outcome["ok"] else 1


def entry_of(check: Check, status: str, run: int, **more) -> dict:
    return {"name": check.name, "what": check.what, "budget_s": check.budget_s, "status": status, "run": run, **more}


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_bytes()[-4 * chars :].decode(errors="replace")[-chars:]
    except OSError:
        return ""


def run_check(check: Check, limit_s: float, out: Path, run: int = 1) -> dict:
    """Step 3, in the parent: the check in its own process group, its stdout and stderr straight into
    ``out/<name>.log``, killed at ``limit_s`` (or when this process is stopped: the stop then goes on up)."""
    log_path = out / f"{check.name}.log"
    result_path = out / f"{check.name}.result.json"
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_LOG": str(log_path)}
    command = [sys.executable, "-m", "measure.gpu_check", "--child", reference(check.run), "--result", str(result_path)]
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills the ranks it spawned too
        )
        timed_out = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:  # the check, or what it left running (ranks holding the GPU), or both
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # none left
                pass
            proc.wait()
    entry = entry_of(check, "", run, seconds=round(time.monotonic() - start, 1), log_file=log_path.name)
    if timed_out:
        return {
            **entry,
            "status": "timed out",
            "error": f"still running after {limit_s:.0f} s",
            "log": log_tail(log_path),
        }
    if not result_path.exists():
        error = f"exited {proc.returncode} with no result"
        return {**entry, "status": "failed", "error": error, "log": log_tail(log_path)}
    outcome = json.loads(result_path.read_text())
    result_path.unlink()
    if outcome["ok"]:
        return {**entry, "status": "passed", "result": outcome["result"]}
    return {**entry, "status": "failed", "error": outcome["error"], "log": outcome["traceback"][-4000:]}


def gpu_description() -> str | None:
    """The visible GPU's name, or None without one (asked in this process; the checks run in others)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def earlier_report(out: Path) -> dict:
    """Step 2: the report already in ``out`` (an earlier invocation's), or an empty one. A check it still shows
    "running" was cut short when that invocation was killed: it is reported "timed out"."""
    path = out / "report.json"
    if not path.exists():
        return {"runs": [], "checks": []}
    try:
        report = json.loads(path.read_text())
        report.setdefault("runs", [])
        assert isinstance(report["checks"], list)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        print(f"gpu_check: {path} cannot be read ({exc!r}): a new report replaces it", flush=True)
        return {"runs": [], "checks": []}
    for e in report["checks"]:
        if e["status"] == "running":
            e["status"] = "timed out"
            e["error"] = f"run {e.get('run')} was killed while this check ran; {e['name']}.log has what it printed"
    return report


def write_report(report: dict, out: Path) -> None:
    """Step 4: ``report.json`` and ``report.md``, each replaced whole (a kill never leaves half a file)."""
    report["ok"] = all(e["status"] in ("passed", "not run") for e in report["checks"])
    for name, text in (("report.json", json.dumps(report, indent=1, default=str)), ("report.md", markdown(report))):
        part = out / f".{name}.part"
        part.write_text(text)
        os.replace(part, out / name)


def run_checks(checks: list[Check], out: Path, total_s: float = TOTAL_S, gpu: str | None = None) -> dict:
    """Steps 2-4: run ``checks`` one after the other within ``total_s`` seconds (or mark them "not run" without
    a ``gpu``), merging them into the report in ``out``, which is rewritten before and after each; return it."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    report = earlier_report(out)
    run = max([r["run"] for r in report["runs"]], default=0) + 1
    date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    names = [c.name for c in checks]
    report.update(gpu=gpu, ran=gpu is not None, torch=torch.__version__, date=date, total_budget_s=total_s)
    report["runs"].append(
        {"run": run, "date": date, "gpu": gpu, "torch": torch.__version__, "total_budget_s": total_s, "checks": names}
    )
    entries = report["checks"]

    def put(entry: dict) -> None:
        """This invocation's entry for a check replaces the earlier one in place, or comes last."""
        at = [e["name"] for e in entries]
        if entry["name"] in at:
            entries[at.index(entry["name"])] = entry
        else:
            entries.append(entry)

    for check in checks:
        put(entry_of(check, "pending" if gpu is not None else "not run", run))
    write_report(report, out)
    if gpu is None:
        return report
    deadline = time.monotonic() + total_s
    for check in checks:
        left = deadline - time.monotonic()
        if left <= 1:
            put(
                entry_of(check, "timed out", run, error=f"the {total_s:.0f} s of this run were spent before it started")
            )
            write_report(report, out)
            continue
        limit = min(check.budget_s, left)
        print(f"gpu_check: {check.name} ({check.what}; at most {limit:.0f} s) ...", flush=True)
        started = time.monotonic()
        note = f"started {time.strftime('%H:%M:%S')}; still running when this report was last written"
        put(entry_of(check, "running", run, log_file=f"{check.name}.log", error=note))
        write_report(report, out)
        try:
            entry = run_check(check, limit, out, run)
        except KeyboardInterrupt:  # SIGTERM (see main) or Ctrl-C: run_check has killed the check
            seconds = round(time.monotonic() - started, 1)
            error = f"stopped (SIGTERM or Ctrl-C) after {seconds} s"
            log = log_tail(out / f"{check.name}.log")
            put(entry_of(check, "timed out", run, seconds=seconds, log_file=f"{check.name}.log", error=error, log=log))
            write_report(report, out)
            raise
        print(f"gpu_check: {check.name}: {entry['status']} in {entry['seconds']} s", flush=True)
        put(entry)
        write_report(report, out)
    return report


def markdown(report: dict) -> str:
    """The report for people: the runs, one row per check, then each failure's error and the end of its
    output (the whole output is in the check's log, beside the report)."""
    lines = ["# meshloom GPU check", ""]
    for r in report.get("runs", []):
        head = f"- run {r['run']}, {r['date']}, torch {r['torch']}: "
        if r["gpu"] is None:
            head += "no GPU visible (torch.cuda.is_available() is False): nothing was run or measured."
        else:
            head += f"GPU {r['gpu']}, a budget of {r['total_budget_s']:.0f} s for {', '.join(r['checks'])}."
        lines.append(head)
    lines += [
        "",
        "Every figure below was measured by the run its row names, in this invocation or an earlier one into the",
        'same folder. "running" or "pending": that run was killed before the check finished or started.',
        "",
        "| check | status | seconds (budget) | result | run |",
        "|---|---|---|---|---|",
    ]
    for e in report["checks"]:
        seconds = f"{e['seconds']} ({e['budget_s']})" if "seconds" in e else f"- ({e['budget_s']})"
        result = e.get("result", {}).get("summary", "") if e["status"] == "passed" else e.get("error", "")
        first = result.splitlines()[0] if result else ""
        lines.append(f"| {e['name']}: {e['what']} | {e['status']} | {seconds} | {first} | {e.get('run', '')} |")
    for e in report["checks"]:
        if e["status"] in ("failed", "timed out", "running"):
            lines += ["", f"## {e['name']}: {e['status']}", ""]
            if e.get("log_file"):
                lines += [f"Its whole output: `{e['log_file']}`.", ""]
            lines += ["```", e.get("error", ""), e.get("log", ""), "```"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command's options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    from runtime.options import float_option, path_option, text_option

    parser = argparse.ArgumentParser(prog="python3 -m measure.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=path_option(),
        help="folder for report.json, report.md and each check's <name>.log; on a lent GPU machine one under the "
        'folder it sends back, e.g. "$OUT/gpu_check" (the default when the environment variable OUT is set)',
    )
    parser.add_argument("--only", default="", type=text_option(), help="comma-separated check names (default: all)")
    parser.add_argument(
        "--budget",
        type=float_option(gt=0),
        default=TOTAL_S,
        help=f"seconds for this whole invocation (default {TOTAL_S}); each check also has its own budget",
    )
    parser.add_argument("--child", type=text_option(), help=argparse.SUPPRESS)  # module:function, run in this process
    parser.add_argument("--result", type=path_option(), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: ``CHECKS`` on the GPU ``gpu_description`` finds (the tests patch both)."""
    checks = CHECKS
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.result)
    if args.out is None:
        if not os.environ.get("OUT"):
            parser.error(
                "pass --out DIR, the folder for the report and the logs: on a lent GPU machine one under the "
                'folder the machine sends back, e.g. --out "$OUT/gpu_check"'
            )
        args.out = str(Path(os.environ["OUT"]) / "gpu_check")
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in checks})
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(c.name for c in checks)}")
    selected = [c for c in checks if not names or c.name in names]
    gpu = gpu_description()
    if gpu is None:
        print("gpu_check: no GPU visible (torch.cuda.is_available() is False): nothing run", flush=True)
    out = Path(args.out)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop kills the check, then reports
    try:
        report = run_checks(selected, out, total_s=args.budget, gpu=gpu)
    except KeyboardInterrupt:
        print(f"gpu_check: stopped; {out / 'report.md'} has every check finished before", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    run = report["runs"][-1]["run"]
    for e in report["checks"]:
        summary = e.get("result", {}).get("summary") or e.get("error", "")
        first = summary.splitlines()[0] if summary else ""
        print(f"  {e['name']:<20} {e['status']:<10} (run {e.get('run', '?')}) {first}".rstrip())
    print(f"gpu_check: report in {out / 'report.md'} and report.json, each check's output in <name>.log", flush=True)
    redo = [e["name"] for e in report["checks"] if e["status"] not in ("passed", "not run")]
    if redo:
        print(
            "gpu_check: to rerun what did not pass, in the time left: python3 -m measure.gpu_check "
            f"--out {shlex.quote(args.out)} --only {','.join(redo)} --budget SECONDS",
            flush=True,
        )
    return 0 if all(e["status"] in ("passed", "not run") for e in report["checks"] if e.get("run") == run) else 1


if __name__ == "__main__":  # the child processes of step 3 (the command is measure/gpu_check.py)
    sys.exit(main())
