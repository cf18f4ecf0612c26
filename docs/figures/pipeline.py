"""Section 7: pipeline schedules, idealized (torch's own action lists, read by measure/schedule_ir.py)."""

from __future__ import annotations

from docs.figures.svg import CHAR_WIDTH, LIGHT, Svg
from measure.schedule_ir import SCHEDULE_STAGES, pipeline_ideal

PIPELINE_FIGURES = ((2, 4), (4, 8))
LABEL_SIZE = 12


def darker(hex_colour: str, by: float = 0.4) -> str:
    """The colour mixed with black: the rank's second stage in a looped or V-shaped schedule."""
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c * (1 - by)):02x}" for c in (r, g, b))


def pipeline_svg(schedule: str, pp: int, microbatches: int) -> str:
    """One row per rank, a box per F/B/I/W of torch's action list run with unit times, every box labelled."""
    from observers.pipeline_timeline import COLOURS, SCHEDULE_FAMILIES, predicted_bubble

    ideal = pipeline_ideal(schedule, pp, microbatches)
    timed, v = ideal["timed"], ideal["v"]
    span = max(t.end for t in timed)
    left, top, row_h = 70, 58, 40
    # The shortest box is one stage's forward, 1/v of a time unit: about 26 pixels for it, 1,000 to 1,200 in all.
    width = max(1000, min(1200, span * v * 26))
    svg = Svg(left + width + 20, 0, font_size=12)
    predicted = predicted_bubble(schedule, pp, microbatches, v)
    steady = " from an empty pipeline; 0 in steady state" if SCHEDULE_FAMILIES[schedule].placement == "v" else ""
    y = svg.lines(
        left,
        22,
        f"{schedule}: pp={pp}, {v} stage(s)/rank, m={microbatches}, idealized: idle {ideal['idle']:.1%} "
        f"(formula {predicted:.1%}{steady})",
        width,
        size=13,
        weight="bold",
    )
    top = max(top, y + 10)
    for rank in range(pp):
        ry = top + rank * row_h
        svg.text(5, ry + row_h / 2 + 1, f"rank {rank}")
        svg.rect(left, ry, width, row_h - 8, LIGHT, stroke=LIGHT)
    for t in timed:
        a = t.action
        x, w = left + t.start / span * width, (t.end - t.start) / span * width
        # One stage per rank: the whole label (F3). Two: the micro-batch number, the rank's second stage darker.
        second = v > 1 and a.stage >= pp
        label = f"{a.kind}{a.microbatch}" if v == 1 else str(a.microbatch)
        fits = w > CHAR_WIDTH * LABEL_SIZE * len(label) + 4
        box_y, box_h = top + t.rank * row_h, row_h - 8
        svg.rect(
            x,
            box_y,
            w,
            box_h,
            COLOURS[a.kind],
            tooltip=f"{a.kind}{a.microbatch}s{a.stage}: {t.start:g}-{t.end:g}",
            text=label if fits else None,
            size=LABEL_SIZE,
        )
        if second:  # a dark band along the bottom of the box
            svg.rect(x + 0.5, box_y + box_h - 6, max(0.5, w - 1), 5, darker(COLOURS[a.kind]), stroke="none")
    legend_y = top + pp * row_h + 22
    for i, (kind, fill) in enumerate(COLOURS.items()):
        svg.rect(left + i * 130, legend_y - 10, 12, 12, fill)
        svg.text(
            left + i * 130 + 16,
            legend_y,
            f"{kind} " + {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}[kind],
        )
    stages = (
        " Each box is labelled by its micro-batch; a dark band along its bottom marks the rank's second stage"
        f" (stage r + {pp} looped, 2·{pp} - 1 - r V-shaped)."
        if v > 1
        else ""
    )
    y = svg.lines(
        left,
        legend_y + 22,
        f"Grey: idle. {span:g} time units shown: a forward of one rank's layers takes 1, a backward 2 (I = W = 1); "
        f"sends are free.{stages}",
        width,
    )
    svg.height = y
    return svg.render()


def pipeline_table(pp: int, microbatches: int) -> str:
    from observers.pipeline_timeline import predicted_bubble

    lines = [
        f"pp={pp}, m={microbatches}: torch's action lists run with F = I = W = 1, B = 2 (per rank's worth of "
        "layers), sends free",
        f"{'schedule':<22} {'v':>2} {'formula':>8} {'idealized':>10}  activations in flight per rank (chunks)",
    ]
    for schedule, v in SCHEDULE_STAGES.items():
        if schedule == "DualPipeV" and microbatches < 2 * pp:
            continue
        ideal = pipeline_ideal(schedule, pp, microbatches)
        lines.append(
            f"{schedule:<22} {v:>2} {predicted_bubble(schedule, pp, microbatches, v):>8.1%} "
            f"{ideal['idle']:>10.1%}  {ideal['in_flight']}"
        )
    return "\n".join(lines)
