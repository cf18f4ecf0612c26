"""Section 7: pipeline schedules, idealized (torch's own action lists, read by bench/schedule_ir.py)."""

from __future__ import annotations

from bench.schedule_ir import SCHEDULE_STAGES, pipeline_ideal
from docs.figures.svg import LIGHT, Svg

PIPELINE_FIGURES = ((2, 4), (4, 8))


def pipeline_svg(schedule: str, pp: int, microbatches: int) -> str:
    from mesh.pipeline_timeline import COLOURS, predicted_bubble

    ideal = pipeline_ideal(schedule, pp, microbatches)
    timed, v = ideal["timed"], ideal["v"]
    span = max(t.end for t in timed)
    width, row_h, left, top = 1000, 34, 70, 40
    svg = Svg(left + width + 20, top + pp * row_h + 66, font_size=11)
    predicted = predicted_bubble(schedule, pp, microbatches, v)
    svg.text(
        left,
        20,
        f"{schedule}: pp={pp}, {v} stage(s)/rank, m={microbatches}, idealized: idle {ideal['idle']:.1%} "
        f"(formula {predicted:.1%})",
        size=12,
    )
    for rank in range(pp):
        y = top + rank * row_h
        svg.text(5, y + row_h / 2 + 4, f"rank {rank}")
        svg.rect(left, y, width, row_h - 6, LIGHT, stroke=LIGHT)
    for t in timed:
        a = t.action
        x, w = left + t.start / span * width, (t.end - t.start) / span * width
        label = f"{a.kind}{a.microbatch}" + (f"s{a.stage}" if v > 1 else "")
        later = v > 1 and a.stage >= pp  # the rank's second stage
        short = f"{a.microbatch}" + ("'" if later else "")
        shown = label if w > 7 * len(label) else short if w > 7 * len(short) else None
        svg.rect(
            x,
            top + t.rank * row_h,
            w,
            row_h - 6,
            COLOURS[a.kind],
            tooltip=f"{label}: {t.start:g}-{t.end:g}",
            text=shown,
            size=10,
        )
    legend_y = top + pp * row_h + 25
    for i, (kind, fill) in enumerate(COLOURS.items()):
        svg.rect(left + i * 110, legend_y - 10, 12, 12, fill)
        svg.text(
            left + i * 110 + 16,
            legend_y,
            f"{kind} " + {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}[kind],
        )
    second = "; n' = micro-batch n on the rank's second stage" if v > 1 else ""
    svg.text(
        left,
        legend_y + 18,
        f"grey: idle, {span:g} time units shown: a forward of one rank's layers takes 1, a "
        f"backward 2 (I = W = 1); sends are free{second}",
    )
    return svg.render()


def pipeline_table(pp: int, microbatches: int) -> str:
    from mesh.pipeline_timeline import predicted_bubble

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
