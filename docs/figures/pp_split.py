"""docs/pipeline_parallel.md section 2: peak memory per pipeline rank under three layer splits.

The bytes are planning/memory_estimate.py's (``rank_memory``) and the splits planning/pipeline_split.py's: equal layer
counts, ``pp_split params`` and ``pp_split memory``, for a Llama-3-8B-shaped model on pp 4 under 1F1B.
"""

from __future__ import annotations

from docs.figures.svg import DARK, Svg, colour

# Llama-3-8B's shape; pp 4 x FSDP 8, bf16, 1F1B with 8 micro-batches of one 8,192-token sequence, no AC
SHAPE = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_dim": 14336}
LAYOUT = {
    "pp": 4,
    "dp_shard": 8,
    "seq_len": 8192,
    "pp_schedule": "1F1B",
    "pp_microbatches": 8,
    "activation_checkpoint": "none",
    "mixed_precision": "bf16",
}


def pp_split_rows() -> list[tuple[str, list[int], list]]:
    """(split name, layers per stage, each rank's RankMemory) for uniform, params and memory."""
    from mesh.pipeline import stage_ids_of_rank
    from models.llama import ModelArgs
    from planning.layout import Layout
    from planning.memory_estimate import rank_memory
    from planning.pipeline_split import memory_split, split_layers, stages_of

    args, layout = ModelArgs(**SHAPE), Layout(**LAYOUT)
    splits = {
        "equal layers": [args.n_layers // 4] * 4,
        "pp_split params": [len(s) for s in split_layers(args, 4, "params", layout.seq_len)],
        "pp_split memory": memory_split(args, layout, 4, "1F1B"),
    }
    rows = []
    for name, sizes in splits.items():
        stages = stages_of(sizes)
        rows.append(
            (name, sizes, [rank_memory(args, layout, stages, r, stage_ids_of_rank(r, 4, 1, "1F1B")) for r in range(4)])
        )
    return rows


def pp_split_svg() -> str:
    rows = pp_split_rows()
    gib = 2**30
    top_bytes = max(m.total for _, _, ranks in rows for m in ranks)
    scale = 300 / top_bytes  # pixels per byte across the widest bar
    left, bar, gap, top = 150, 16, 6, 54
    svg = Svg(left + 300 + 230, top + len(rows) * (4 * (bar + gap) + 36) + 60)
    svg.text(
        10, 22, "Peak memory per pipeline rank: 8B-shaped model, pp 4 x FSDP 8, 1F1B, m = 8", size=14, weight="bold"
    )
    svg.text(10, 40, "bf16, no activation checkpointing; planning/memory_estimate.py: rank_memory", size=11)
    parts = [("states + gathered", 0), ("activations", 1), ("logits", 3)]
    y = top
    for name, sizes, ranks in rows:
        peaks = [m.total for m in ranks]
        svg.text(10, y + 14, name, size=12, weight="bold")
        svg.text(10, y + 30, "layers " + ",".join(map(str, sizes)), size=11)
        svg.text(10, y + 46, f"max/min {max(peaks) / min(peaks):.2f}", size=11)
        for r, m in enumerate(ranks):
            x, ry = left, y + 4 + r * (bar + gap)
            for (label, c), value in zip(parts, (m.states + m.gathered, m.activations, m.logits), strict=True):
                svg.rect(x, ry, value * scale, bar, colour(c), tooltip=f"rank {r}: {label} {value / gib:.1f} GiB")
                x += value * scale
            svg.text(left - 6, ry + 12, f"rank {r}", anchor="end", size=10)
            svg.text(x + 6, ry + 12, f"{m.total / gib:.1f} GiB", size=10, fill=DARK)
        y += 4 * (bar + gap) + 36
    for i, (label, c) in enumerate(parts):
        svg.rect(10 + i * 170, y, 12, 12, colour(c))
        svg.text(10 + i * 170 + 16, y + 10, label, size=10)
    svg.text(
        10, y + 32, "1F1B: rank r holds up to pp - r micro-batches of activations, the last rank the logits", size=10
    )
    return svg.render()
