"""Profiling on demand: torch.profiler over chosen steps, one trace per rank, and where memory goes.

With ``profile.enabled = true`` the training loop runs under ``StepProfiler``:

1. **Which steps.** Steps ``profile.start_step`` .. ``start_step + steps - 1`` are recorded; the step before
   them is a profiler warm-up step (tracing starts, results are dropped), so the first recorded step does
   not pay the profiler's own start-up. A run that resumes past ``start_step`` records its first steps.
   Each step is one ``ProfilerStep#N`` range, N being the training step, from the end of step N-1 to the end
   of step N: data loading, forward, backward, clipping, the optimizer, logging and any checkpoint save.
2. **Named ranges.** ``named_range`` marks meshloom's phases inside a step (``meshloom::forward``,
   ``meshloom::backward``, ``meshloom::optimizer``, ...; ``RANGES``). They are ``record_function`` ranges:
   they cost a few microseconds when nobody records. Under pipelining the schedule's own per-action ranges
   (``Forward 0``, ``Backward 0``, or ``stage 0 F 1`` style names) come through inside
   ``meshloom::pipeline schedule``; FSDP2 adds its ``FSDP::*`` ranges.
3. **Traces.** When the last recorded step ends, each rank writes ``<run.dir>/profile/rank<R>.pt.trace.json``:
   Chrome trace format, which Perfetto (ui.perfetto.dev) and chrome://tracing open, and which TensorBoard's
   profiler plugin (``pip install torch-tb-profiler``; ``tensorboard --logdir <run.dir>/profile``) lists
   as worker ``rank<R>``. ``rank<R>.ops.txt`` holds the op table (self time, sorted). ``python -m training.comm_share
   <run.dir>`` reads the traces and prints compute, communication and exposed communication per rank.
4. **Memory** (``profile.memory_snapshot = true``). On CUDA the caching allocator records every allocation
   and free (with its Python stack) during the recorded steps, and ``rank<R>.memory_snapshot.pickle`` is
   written at the end: drop it on pytorch.org/memory_viz. On CPU there is no allocator history; the
   profiler's own memory profile is written instead, as ``rank<R>.memory_timeline.json`` (bytes over time
   by category: parameter, optimizer state, input, temporary, activation, gradient, autograd detail), and
   ``summarize_memory_timeline`` prints the peak of each category.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from observers.base import Observer, RunContext

if TYPE_CHECKING:
    import torch

# The ranges meshloom itself opens (train.py); every name is prefixed with "meshloom::".
RANGES = (
    "data loading",
    "forward",
    "backward",
    "pipeline schedule",
    "gradient clipping",
    "optimizer",
    "checkpoint save",
)
PREFIX = "meshloom::"


def named_range(name: str) -> record_function:
    """A profiler range ``meshloom::<name>`` (a no-op unless a profiler records)."""
    assert name in RANGES, f"add {name!r} to profiling.RANGES"
    return record_function(PREFIX + name)


def trace_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "profile" / f"rank{rank}.pt.trace.json"


class StepProfiler(Observer):
    """torch.profiler over the configured steps of this rank (see the module docstring)."""

    def __init__(self, cfg, rank: int, device: torch.device, first_step: int, steps: int):
        p = cfg.profile
        self.rank, self.device = rank, device
        self.out = Path(cfg.run.dir) / "profile"
        self.start = max(p.start_step, first_step)
        self.last = min(self.start + p.steps - 1, steps)
        self.memory = p.memory_snapshot
        self.cuda_memory = self.memory and device.type == "cuda"
        self.written: list[Path] = []
        start, last = self.start, self.last

        def schedule(step: int) -> ProfilerAction:
            # ``step`` is the training step about to run (step_num is set to the loop's first step below).
            if start <= step < last:
                return ProfilerAction.RECORD
            if step == last:
                return ProfilerAction.RECORD_AND_SAVE
            return ProfilerAction.WARMUP if step == start - 1 else ProfilerAction.NONE

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        # The CPU memory timeline needs shapes, allocations and stacks; stacks make traces large, so only then.
        cpu_memory = self.memory and not self.cuda_memory
        self.prof = profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._write,
            record_shapes=True,
            profile_memory=cpu_memory,
            with_stack=cpu_memory,
        )
        # Number the ProfilerStep#N ranges by training step: the schedule and the labels both read step_num.
        self.prof.step_num = first_step
        self.prof.current_action = schedule(first_step)
        self.prof.start()

    def begin_step(self, step: int) -> None:
        """Call at the top of each step: starts the CUDA allocator history at the first recorded step."""
        if self.cuda_memory and step == self.start:
            from mesh.private_api import record_memory_history

            record_memory_history(True)

    def end_step(self, step: int) -> None:
        """Call at the end of each step (after logging and saving): closes the step's ProfilerStep range."""
        self.prof.step()

    def close(self) -> None:
        """Stop (on every exit path); writes the trace if the run ended inside the recorded window."""
        self.prof.stop()
        if self.cuda_memory:
            from mesh.private_api import record_memory_history

            record_memory_history(False)

    def _write(self, prof: profile) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank{self.rank}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.written.append(path)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        (self.out / f"rank{self.rank}.ops.txt").write_text(table + "\n")
        if self.cuda_memory:
            from mesh.private_api import dump_memory_snapshot

            snapshot = self.out / f"rank{self.rank}.memory_snapshot.pickle"
            dump_memory_snapshot(str(snapshot))
            self.written.append(snapshot)
        elif self.memory:
            timeline = self.out / f"rank{self.rank}.memory_timeline.json"
            with warnings.catch_warnings():
                # deprecated in favour of the CUDA allocator history, which a CPU run does not have
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(timeline), device="cpu")
            self.written.append(timeline)


class NoProfiler(Observer):
    """What the loop holds when profiling is off: every call does nothing."""

    written: list[Path] = []

    def begin_step(self, step: int) -> None:
        pass

    def end_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def step_profiler(cfg, rank: int, device: torch.device, first_step: int, steps: int) -> StepProfiler | NoProfiler:
    """A StepProfiler when ``profile.enabled`` and a recorded step lies ahead, else a NoProfiler."""
    if not cfg.profile.enabled or max(cfg.profile.start_step, first_step) > steps:
        return NoProfiler()
    return StepProfiler(cfg, rank, device, first_step, steps)


def for_run(ctx: RunContext) -> StepProfiler | None:
    """On with ``profile.enabled`` while a recorded step lies ahead (``step_profiler``)."""
    profiler = step_profiler(ctx.cfg, ctx.step.plan.rank, ctx.step.device, ctx.start_step + 1, ctx.step.plan.steps)
    return None if isinstance(profiler, NoProfiler) else profiler


# ---- reading the CPU memory timeline ---------------------------------------------------------------------
def summarize_memory_timeline(path: str | Path) -> dict[str, int]:
    """Peak bytes of each category over a CPU memory timeline, and the peak of their sum (``"total"``)."""
    from mesh.private_api import memory_timeline_categories

    times, sizes = json.loads(Path(path).read_text())
    if not times:
        return {}
    names = memory_timeline_categories()
    columns = list(zip(*sizes, strict=True))
    assert len(columns) == len(names), f"{path}: {len(columns)} columns, expected {len(names)} ({names})"
    peaks = {name: max(column) for name, column in zip(names, columns, strict=True) if name}
    peaks["total"] = max(sum(row) for row in sizes)
    return peaks
