"""Chapter 9: who holds the tied embedding under pipeline parallelism, and where the gradient sum runs.

The facts come from the code: the stages of each pp rank from mesh/pipeline.py (``stage_ids_of_rank``) and
the embedding groups from mesh/tied_embeddings.py (``embedding_group_ranks``) on the world mesh's rank
layout (pp outermost, row-major like ``init_device_mesh``); tests/test_tied_embeddings.py compares those
groups with the ones meshloom builds on a real mesh.
"""

from __future__ import annotations

from docs.figures.svg import DARK, GREY, LIGHT, Svg, colour

# The example: pp 4 x dp_shard 2 with 1F1B (8 ranks), and pp 2 with a V schedule.
TIED_EXAMPLE = {"pp": 4, "dp_shard": 2, "schedule": "1F1B"}
TIED_V_EXAMPLE = {"pp": 2, "schedule": "ZBVZeroBubble"}


def tied_groups(pp: int, dp_shard: int) -> list[list[int]]:
    """The embedding groups (global ranks) of a pp x dp_shard world, as mesh/tied_embeddings.py forms them."""
    import torch

    from mesh.tied_embeddings import embedding_group_ranks

    return embedding_group_ranks(torch.arange(pp * dp_shard).reshape(pp, 1, dp_shard, 1, 1))


def _stages(pp: int, schedule: str) -> list[list[int]]:
    from mesh.pipeline import stage_ids_of_rank, stages_per_rank

    n_local = stages_per_rank(schedule, 0)
    return [stage_ids_of_rank(r, pp, n_local, schedule) for r in range(pp)]


def tied_embeddings_svg() -> str:
    pp, dp, schedule = TIED_EXAMPLE["pp"], TIED_EXAMPLE["dp_shard"], TIED_EXAMPLE["schedule"]
    stages = _stages(pp, schedule)
    n_stages = pp * len(stages[0])
    groups = tied_groups(pp, dp)
    svg = Svg(1000, 560)
    svg.text(10, 22, "Tied embeddings under pipeline parallelism: two copies, one gradient", size=14, weight="bold")
    svg.text(10, 44, f"pp {pp} x dp_shard {dp}, {schedule} (rank = {dp} x pp rank + dp rank)", size=12, weight="bold")
    x0, y0, w, h, gap = 20, 60, 200, 62, 40
    for p in range(pp):
        svg.text(x0 + p * (w + gap) + w / 2, y0 + 12, f"pp rank {p}: stage {stages[p][0]}", anchor="middle", size=11)
        for d in range(dp):
            rank = p * dp + d
            y = y0 + 22 + d * (h + 30)
            first, last = 0 in stages[p], n_stages - 1 in stages[p]
            fill = colour(0) if first else colour(1) if last else GREY
            label = "tok_embeddings.weight" if first else "output.weight (copy)" if last else "layers only"
            svg.rect(x0 + p * (w + gap), y, w, h, fill, text=f"rank {rank}", size=12)
            svg.text(x0 + p * (w + gap) + w / 2, y + h - 8, label, anchor="middle", fill="white", size=10)
    for d, (a, b) in enumerate(groups):
        y = y0 + 22 + d * (h + 30) + h + 12
        xa, xb = x0 + w / 2, x0 + (pp - 1) * (w + gap) + w / 2
        svg.line(xa, y, xb, y, stroke=DARK, width=1.5, arrow=True)
        svg.line(xb, y, xa, y, stroke=DARK, width=1.5, arrow=True)
        svg.rect((xa + xb) / 2 - 190, y - 9, 380, 16, "white", stroke="white")
        svg.text(
            (xa + xb) / 2, y + 4, f"embedding group [{a}, {b}]: all-reduce of the gradient pieces", "middle", size=10
        )

    vp, vschedule = TIED_V_EXAMPLE["pp"], TIED_V_EXAMPLE["schedule"]
    vstages = _stages(vp, vschedule)
    vlast = 2 * vp - 1
    yv = 300
    svg.text(
        10, yv, f"pp {vp}, {vschedule}: the V puts the first and the last stage on pp rank 0", size=12, weight="bold"
    )
    for r in range(vp):
        x, y = 20 + r * 480, yv + 14
        svg.rect(x, y, 450, 96, LIGHT, stroke=GREY)
        svg.text(x + 8, y + 16, f"pp rank {r}: stages {vstages[r]}", size=11)
        for k, s in enumerate(vstages[r]):
            is_end = s in (0, vlast)
            fill = colour(0) if s == 0 else colour(1) if s == vlast else GREY
            text = "stage 0: tok_embeddings.weight" if s == 0 else f"stage {s}: output.weight (copy)"
            svg.rect(x + 8 + k * 222, y + 26, 210, 36, fill, text=text if is_end else f"stage {s}: layers", size=10)
        if 0 in vstages[r]:
            svg.text(x + 8, y + 84, "both copies here: the gradients are added locally, no group", size=10)

    order = [
        "1. backward of every micro-batch (FSDP reduce-scatter, TP partial sums)",
        "2. sum the two copies' gradients: embedding group all-reduce, or a local add (V)",
        "3. gradient norm: the head copy is not counted; clip every gradient by the same factor",
        "4. AdamW on both copies: equal weights + equal gradients -> equal weights after the step",
        "checkpoint: one entry, model.tok_embeddings.weight (the last stage's copy saves and loads under it)",
    ]
    y = yv + 140
    svg.text(10, y, "Every step, in train.py's order (mesh/tied_embeddings.py)", size=12, weight="bold")
    for line in order:
        y += 20
        svg.text(20, y, line, size=11)
    return svg.render()
