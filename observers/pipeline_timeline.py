"""Measure a pipeline schedule: per-rank F / B / I / W / idle time for one step, the bubble, and a picture.

1. ``PipelineTimeline.instrument`` wraps each local ``PipelineStage``'s ``forward_one_chunk`` (F),
   ``backward_one_chunk`` (B for a full backward, I for the input-gradient half in zero-bubble schedules)
   and ``backward_weight_one_chunk`` (W) to record (start, end) times per micro-batch. On CPU these are
   wall-clock readings. On CUDA the Python call returns as soon as the kernels are queued, so each mark is a
   CUDA event recorded on the stream instead; ``end_step`` synchronizes and turns the events into seconds
   after the step's start.
2. ``begin_step`` / ``end_step`` mark the step's window on each rank (after data loading, before the
   gradient clipping). Everything in the window that is not F/B/I/W is idle: waiting for a neighbour's
   activation or gradient (the bubble), the point-to-point sends and receives themselves (torch issues
   them outside the timed chunks), and the last stage's loss computation.
3. ``gather`` collects the events of this rank's pp group on every rank (an object gather on the control
   plane, runtime/process.py: it works on every backend and never queues behind model traffic),
   ``bubble_report`` compares each rank's measured idle fraction with the schedule's textbook prediction,
   and ``timeline_svg`` draws one row per rank with a box per F/B/I/W, labelled by micro-batch.
4. ``write_pipeline_timeline`` (called by train.py after the last step) does step 3 and writes the table
   (``pipeline_bubble.json``) and the picture (``pipeline_timeline.svg``) into run.dir.

Clocks: ``time.time()`` is shared by the processes of one machine; across machines the rows would be only
as aligned as the machines' clocks. On a CPU with fewer cores than ranks, ranks also wait for a core, which
shows up as longer boxes, not as idle time.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mesh.pipeline import SCHEDULE_FAMILIES
from observers.base import Observer, RunContext
from runtime.process import ControlPlane, synchronize

COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#f28e2b"}


@dataclass
class Event:
    rank: int
    stage: int
    kind: str  # F | B | I | W
    microbatch: int
    start: float
    end: float


class PipelineTimeline:
    def __init__(self, pp_rank: int, device: torch.device):
        self.pp_rank, self.device = pp_rank, device
        self.events: list[Event] = []
        self._marks: list[tuple] = []  # (stage, kind, micro-batch, start mark, end mark) of the current step
        self.window = (0.0, 0.0)
        self._begin = None

    def _mark(self):
        """A point in time: a CUDA event queued on the stream, or the wall clock on CPU."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.time()

    def instrument(self, stage) -> None:
        """Record every forward, backward and weight-gradient chunk that ``stage`` runs."""

        def timed(method, kind_of):
            @functools.wraps(method)
            def wrapper(chunk_id, *args, **kwargs):
                start = self._mark()
                result = method(chunk_id, *args, **kwargs)
                self._marks.append((stage.stage_index, kind_of(kwargs), chunk_id, start, self._mark()))
                return result

            return wrapper

        stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = timed(
            stage.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I"
        )
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, lambda kw: "W")

    def begin_step(self) -> None:
        self._marks = []
        synchronize(self.device)
        self._begin = self._mark()
        self.window = (time.time(), 0.0)

    def end_step(self) -> None:
        synchronize(self.device)
        start_wall = self.window[0]
        self.window = (start_wall, time.time())

        def seconds(mark) -> float:
            if self.device.type == "cuda":  # event time since the step began, on the shared wall-clock axis
                return start_wall + self._begin.elapsed_time(mark) / 1000.0
            return mark

        self.events = [
            Event(self.pp_rank, stage, kind, chunk, seconds(start), seconds(end))
            for stage, kind, chunk, start, end in self._marks
        ]

    def gather(self, control: ControlPlane, pp_group_ranks: list[int]) -> tuple[list[Event], list[tuple[float, float]]]:
        """The events and step windows of the ranks in ``pp_group_ranks``, in pp order (a control-plane gather;
        every rank of the world must call it)."""
        everyone = control.all_gather_object(([asdict(e) for e in self.events], self.window))
        peers = [everyone[rank] for rank in pp_group_ranks]
        events = [Event(**e) for evs, _ in peers for e in evs]
        return events, [w for _, w in peers]


def predicted_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> float | None:
    """The textbook idle fraction (equal stages, free communication): GPipe/1F1B (p-1)/(m+p-1); interleaved
    (p-1)/(v*m+p-1); interleaved zero bubble, ZB-V and DualPipeV (p-1)/(3*v*m+p-1).

    ZB-V and DualPipeV reach 0 only in a steady state where the fill at a step's start hides behind the previous
    step. meshloom clips by the global norm over the pp group every step, so every step starts from an empty
    pipeline and keeps that fill: with F = I = W they idle as much as interleaved zero bubble (for m >= 2p)."""
    p, m, v = pp, microbatches, stages_per_rank
    family = SCHEDULE_FAMILIES[schedule]
    if family.placement == "single":
        return (p - 1) / (m + p - 1)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "InterleavedZeroBubble" or family.placement == "v":
        return (p - 1) / (3 * v * m + p - 1)
    return None


def bubble_report(events: list[Event], windows: list[tuple[float, float]]) -> list[dict]:
    """Per rank: seconds of F, B, I, W and idle in the common step window, and the idle fraction."""
    start = min(w[0] for w in windows)
    end = max(w[1] for w in windows)
    rows = []
    for rank in range(len(windows)):
        busy = {k: sum(e.end - e.start for e in events if e.rank == rank and e.kind == k) for k in COLOURS}
        total = end - start
        idle = total - sum(busy.values())
        rows.append(
            {
                "rank": rank,
                **{k: round(v, 4) for k, v in busy.items()},
                "idle": round(idle, 4),
                "idle_fraction": idle / total,
            }
        )
    return rows


def timeline_svg(events: list[Event], windows: list[tuple[float, float]], title: str) -> str:
    """An SVG picture: one row per pp rank, a box per F/B/I/W labelled by micro-batch (and stage)."""
    start = min(w[0] for w in windows)
    span = max(w[1] for w in windows) - start
    width, row_h, left, top = 1000, 34, 70, 40
    n_ranks = len(windows)
    multi_stage = len({(e.rank, e.stage) for e in events}) > n_ranks
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{top + n_ranks * row_h + 50}" '
        'font-family="monospace" font-size="11">',
        f'<text x="{left}" y="20" font-size="13">{title}</text>',
    ]
    for rank in range(n_ranks):
        y = top + rank * row_h
        parts.append(f'<text x="5" y="{y + row_h / 2 + 4}">rank {rank}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{width}" height="{row_h - 6}" fill="#eeeeee"/>')
    for e in events:
        x = left + (e.start - start) / span * width
        w = max(1.0, (e.end - e.start) / span * width)
        y = top + e.rank * row_h
        label = f"{e.kind}{e.microbatch}" + (f"s{e.stage}" if multi_stage else "")
        parts.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" fill="{COLOURS[e.kind]}" '
            f'stroke="white" stroke-width="0.5"><title>{label}: {1000 * (e.end - e.start):.1f} ms</title></rect>'
        )
        if w > 7 * len(label):
            parts.append(f'<text x="{x + 2:.1f}" y="{y + row_h / 2 + 1}" fill="white">{label}</text>')
    legend_y = top + n_ranks * row_h + 25
    for i, (kind, colour) in enumerate(COLOURS.items()):
        parts.append(f'<rect x="{left + i * 110}" y="{legend_y - 10}" width="12" height="12" fill="{colour}"/>')
        name = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}[kind]
        parts.append(f'<text x="{left + i * 110 + 16}" y="{legend_y}">{kind} {name}</text>')
    parts.append(f'<text x="{left + 460}" y="{legend_y}">grey: idle   ({span * 1000:.0f} ms shown)</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_pipeline_timeline(
    run_dir: str, plan, timeline: PipelineTimeline, pp_ranks: list[int], control: ControlPlane, is_logger: bool
) -> None:
    """The last step's timeline gathered from the pp group on every rank; the logger prints the bubble table and writes
    ``pipeline_bubble.json`` and ``pipeline_timeline.svg``."""
    events, windows = timeline.gather(control, pp_ranks)
    if not is_logger:
        return
    schedule, n_local, microbatches = plan.layout.pp_schedule, plan.layout.stages_per_rank, plan.layout.pp_microbatches
    rows = bubble_report(events, windows)
    predicted = predicted_bubble(schedule, plan.dims.pp, microbatches, n_local)
    measured = sum(r["idle_fraction"] for r in rows) / len(rows)
    title = f"{schedule}: pp={plan.dims.pp}, {n_local} stage(s)/rank, m={microbatches}"
    out = Path(run_dir)
    (out / "pipeline_timeline.svg").write_text(timeline_svg(events, windows, title))
    summary = {
        "schedule": schedule,
        "pp": plan.dims.pp,
        "stages_per_rank": n_local,
        "microbatches": microbatches,
        "measured_idle_fraction": measured,
        "predicted_idle_fraction": predicted,
        "ranks": rows,
    }
    (out / "pipeline_bubble.json").write_text(json.dumps(summary, indent=1))
    print(f"pipeline timeline ({title}) -> {out / 'pipeline_timeline.svg'}")
    for r in rows:
        busy = " ".join(f"{k} {r[k] * 1000:7.1f} ms" for k in ("F", "B", "I", "W"))
        print(f"  pp rank {r['rank']}: {busy}  idle {r['idle'] * 1000:7.1f} ms ({r['idle_fraction']:.1%})")
    shown = "n/a" if predicted is None else f"{predicted:.1%}"
    print(f"  bubble: measured {measured:.1%} (mean over ranks) vs predicted {shown}", flush=True)


def for_run(ctx: RunContext) -> PipelineTimelineObserver | None:
    """On with ``run.pp_timeline`` on a pipelined run."""
    if not (ctx.cfg.run.pp_timeline and ctx.step.stages):
        return None
    return PipelineTimelineObserver(
        ctx.step.stages, ctx.step.plan, ctx.step.meshes.pp, ctx.control, ctx.cfg.run.dir, ctx.step.device
    )


class PipelineTimelineObserver(Observer):
    """``run.pp_timeline``: times every pipeline action of each step (its window opens after data loading, so
    it holds only the pipeline's work); after the last step, the last step's timeline is written to run.dir."""

    def __init__(self, stages, plan, pp_mesh, control: ControlPlane, run_dir: str, device: torch.device):
        self.timeline = PipelineTimeline(plan.pp_rank, device)
        for stage in stages:
            self.timeline.instrument(stage)
        self.plan, self.pp_mesh, self.control, self.run_dir = plan, pp_mesh, control, run_dir

    def before_forward_backward(self) -> None:
        self.timeline.begin_step()

    def after_forward_backward(self) -> None:
        self.timeline.end_step()

    def finish(self) -> None:
        import torch.distributed as dist

        pp_ranks = dist.get_process_group_ranks(self.pp_mesh.get_group())
        is_logger = dist.get_rank() == 0
        write_pipeline_timeline(self.run_dir, self.plan, self.timeline, pp_ranks, self.control, is_logger)
