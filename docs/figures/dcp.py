"""Section 6: which saved chunks a rank reads when a checkpoint is loaded on another layout."""

from __future__ import annotations

from docs.figures.svg import DARK, Svg, colour


def placement_boxes(shape: tuple[int, int], mesh: tuple[int, ...], coord: tuple[int, ...], placements: list[str]):
    """The (row range, column range) boxes of a 2-D tensor that the rank at ``coord`` holds.

    ``placements`` per mesh dim: "R", "S0", "S1", or "SS0/k" (a _StridedShard of dim 0 with split_factor k:
    what FSDP holds of a weight TP already split on dim 0 over k ranks). Shards apply in mesh-dim order to the
    piece the previous dims left; a strided shard cuts each of its k blocks, and the Shard(0) of k that follows it
    (TP's, on a later mesh dim) picks one block. tests/test_figures.py checks this against real DTensors."""
    boxes, strided = [((0, shape[0]), (0, shape[1]))], 0
    for size, c, pl in zip(mesh, coord, placements, strict=True):
        if pl == "R":
            continue
        if pl == "S0" and strided == size:  # the later Shard(0) picks one of the strided shard's blocks
            boxes, strided = [boxes[c]], 0
            continue
        strided = int(pl.split("/")[1]) if pl.startswith("SS0/") else 0
        new = []
        for rows, cols in boxes:
            if pl.startswith("SS0/"):  # k blocks along dim 0, each cut in `size` parts; keep part c of each
                k = int(pl.split("/")[1])
                block = (rows[1] - rows[0]) // k
                step = block // size
                new += [
                    ((rows[0] + b * block + c * step, rows[0] + b * block + (c + 1) * step), cols) for b in range(k)
                ]
            elif pl == "S0":
                step = (rows[1] - rows[0]) // size
                new.append(((rows[0] + c * step, rows[0] + (c + 1) * step), cols))
            else:
                step = (cols[1] - cols[0]) // size
                new.append((rows, (cols[0] + c * step, cols[0] + (c + 1) * step)))
        boxes = new
    return _merge_rows(boxes)


def _merge_rows(boxes):
    boxes = sorted(boxes)
    merged = [boxes[0]]
    for rows, cols in boxes[1:]:
        (r0, r1), c = merged[-1]
        if c == cols and r1 == rows[0]:
            merged[-1] = ((r0, rows[1]), cols)
        else:
            merged.append((rows, cols))
    return merged


# The checkpoint chapter's example: the debug model saved on dp_shard 4, loaded on dp_shard 2 x tp 2.
# tests/test_figures.py reads these placements off meshloom's real TP + FSDP model on a 2 x 2 mesh.
DCP_EXAMPLE = {
    "layers.0.feed_forward.w2.weight": {"shape": (128, 384), "load": ["S0", "S1"]},  # row-parallel
    "layers.0.attention.wq.weight": {"shape": (128, 128), "load": ["SS0/2", "S0"]},  # column-parallel
}
SAVE_MESH, LOAD_MESH = (4,), (2, 2)


def dcp_reads(shape, save_placements, load_placements, save_mesh=SAVE_MESH, load_mesh=LOAD_MESH) -> dict:
    """For each rank of the loading layout: [(saved chunk index, overlap box)] it must read."""
    import itertools

    saved = [
        placement_boxes(shape, save_mesh, c, save_placements)[0] for c in itertools.product(*map(range, save_mesh))
    ]
    reads = {}
    for rank, coord in enumerate(itertools.product(*map(range, load_mesh))):
        mine = placement_boxes(shape, load_mesh, coord, load_placements)
        reads[rank] = [
            (i, ((max(r[0], sr[0]), min(r[1], sr[1])), (max(c[0], sc[0]), min(c[1], sc[1]))))
            for rows_cols in mine
            for i, (sr, sc) in enumerate(saved)
            for r, c in [rows_cols]
            if max(r[0], sr[0]) < min(r[1], sr[1]) and max(c[0], sc[0]) < min(c[1], sc[1])
        ]
    return reads


def dcp_svg() -> str:
    import itertools

    svg = Svg(1100, 480)
    svg.text(
        10,
        22,
        "Resharding on load: saved on dp_shard 4, loaded on dp_shard 2 x tp 2 (rank = 2 dp + tp)",
        size=14,
        weight="bold",
    )
    y0 = 50
    for name, spec in DCP_EXAMPLE.items():
        rows, cols = spec["shape"]
        s, cs = 0.9, 220 / cols  # row scale, column scale
        svg.text(
            10,
            y0 + 12,
            f"{name}  {rows}x{cols}  saved Shard(0) on 4 ranks -> loaded {spec['load']}",
            size=11,
            weight="bold",
        )
        # saved chunks
        for i in range(SAVE_MESH[0]):
            (r0, r1), (c0, c1) = placement_boxes((rows, cols), SAVE_MESH, (i,), ["S0"])[0]
            svg.rect(
                20 + c0 * cs, y0 + 24 + r0 * s, (c1 - c0) * cs, (r1 - r0) * s, colour(i), text=f"__{i}_0.distcp", size=9
            )
        svg.text(20, y0 + 24 + rows * s + 14, "saved chunks (one file per saving rank)", size=10)
        # loading ranks: each new piece, coloured by the saved chunks it reads
        x_load = 270
        reads = dcp_reads((rows, cols), ["S0"], spec["load"])
        for rank, coord in enumerate(itertools.product(*map(range, LOAD_MESH))):
            for i, ((r0, r1), (c0, c1)) in reads[rank]:
                svg.rect(x_load + c0 * cs, y0 + 24 + r0 * s, (c1 - c0) * cs, (r1 - r0) * s, colour(i), stroke=colour(i))
            for (r0, r1), (c0, c1) in placement_boxes((rows, cols), LOAD_MESH, coord, spec["load"]):
                svg.rect(
                    x_load + c0 * cs,
                    y0 + 24 + r0 * s,
                    (c1 - c0) * cs,
                    (r1 - r0) * s,
                    "none",
                    stroke=DARK,
                    text=f"rank {rank}",
                    text_fill="white",
                    size=10,
                )
        svg.text(x_load, y0 + 24 + rows * s + 14, "each new rank's piece, coloured by the chunk it reads", size=10)
        ty = y0 + 40
        for rank, items in reads.items():
            described = ", ".join(
                f"chunk {i} rows {b[0][0]}-{b[0][1] - 1} cols {b[1][0]}-{b[1][1] - 1}" for i, b in items
            )
            svg.text(x_load + 240, ty, f"rank {rank} reads {described}", size=10)
            ty += 16
        y0 += rows * s + 70
    svg.text(
        10,
        465,
        "Each rank reads only the saved chunks its new piece overlaps, and only the overlap; no rank "
        "assembles a full tensor (docs/checkpointing.md).",
        size=11,
    )
    return svg.render()
