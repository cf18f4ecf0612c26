"""Section 8: context parallelism: which rank computes which part of the causal mask."""

from __future__ import annotations

from docs.figures.svg import DARK, LIGHT, Svg, colour


def ring_cells(seq: int, cp: int) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """(rank, ring step) -> the (query position, key position) pairs that rank computes at that step, read from
    mesh/context_parallel.py: each rank's positions, and ``visible`` (which local query rows meet which keys
    of the block it holds; a causal block keeps only key <= query)."""
    from mesh.context_parallel import load_balanced_positions, visible

    n = seq // cp
    cells = {}
    for rank in range(cp):
        mine = load_balanced_positions(seq, rank, cp).tolist()
        for step in range(cp):
            src = (rank - step) % cp
            theirs = load_balanced_positions(seq, src, cp).tolist()
            rows, keys, causal = visible(src, rank, n)
            cells[rank, step] = {(q, k) for q in mine[rows] for k in theirs[keys] if not causal or k <= q}
    return cells


def cp_mask_svg(cp: int = 4, seq: int = 32) -> str:
    """The causal mask of one sequence, coloured by the rank that computes each (query, key) pair: a plain split
    into cp pieces next to meshloom's balanced one, whose blocks carry the ring step that computes them."""
    from mesh.context_parallel import load_balanced_positions

    cell, chunk = 12, seq // (2 * cp)
    side = seq * cell
    svg = Svg(2 * side + 200, side + 215)
    svg.text(
        10,
        22,
        f"Context parallelism, cp = {cp}: who computes which part of the causal mask "
        f"(s = {seq}, {2 * cp} chunks of {chunk})",
        size=14,
        weight="bold",
    )
    ring = ring_cells(seq, cp)
    plain_owner = {q: q // (seq // cp) for q in range(seq)}
    balanced_owner = {q: r for r in range(cp) for q in load_balanced_positions(seq, r, cp).tolist()}
    step_of = {pair: step for (_, step), pairs in ring.items() for pair in pairs}
    panels = (
        ("plain split: rank r holds tokens r·s/cp ..", plain_owner, 20),
        ("balanced: rank r holds chunks r and 2cp-1-r", balanced_owner, side + 160),
    )
    for title, owner, x0 in panels:
        y0 = 70
        svg.text(x0, y0 - 22, title, size=12, weight="bold")
        svg.text(x0 + side / 2, y0 - 6, "key position →", anchor="middle", size=10)
        svg.text(x0 - 4, y0 + side + 14, "query ↓", size=10)
        svg.rect(x0, y0, side, side, LIGHT, stroke=LIGHT)  # masked: key after query
        for q in range(seq):  # query q sees keys 0 .. q: one run of its rank's colour
            svg.rect(
                x0,
                y0 + q * cell,
                (q + 1) * cell,
                cell,
                colour(owner[q]),
                stroke=colour(owner[q]),
                tooltip=f"query {q} (rank {owner[q]}) sees keys 0-{q}",
            )
        for i in range(1, seq):  # the cell grid
            svg.line(x0 + i * cell, y0, x0 + i * cell, y0 + side, stroke="white", width=0.6)
            svg.line(x0, y0 + i * cell, x0 + side, y0 + i * cell, stroke="white", width=0.6)
        for c in range(1, 2 * cp):  # chunk boundaries
            svg.line(x0 + c * chunk * cell, y0, x0 + c * chunk * cell, y0 + side, stroke=DARK, width=0.5)
            svg.line(x0, y0 + c * chunk * cell, x0 + side, y0 + c * chunk * cell, stroke=DARK, width=0.5)
        if owner is balanced_owner:  # the ring step of each chunk block
            for qc in range(2 * cp):
                for kc in range(qc + 1):
                    q, k = qc * chunk + chunk - 1, kc * chunk
                    x = x0 + (kc + (0.35 if kc == qc else 0.5)) * chunk * cell  # diagonal blocks: left of the edge
                    svg.text(
                        x,
                        y0 + (qc + 0.7) * chunk * cell,
                        f"t{step_of[q, k]}",
                        anchor="middle",
                        fill="white",
                        size=11,
                        weight="bold",
                    )
        work = [sum(q + 1 for q in range(seq) if owner[q] == r) for r in range(cp)]
        svg.text(
            x0, y0 + side + 32, "pairs per rank: " + ", ".join(f"rank {r} {w}" for r, w in enumerate(work)), size=11
        )
    notes = [
        "Colour: the rank that owns the query row and computes the pair. Grey: masked (key after query).",
        "t0, t1, ...: the ring step at which that rank computes the block (it then holds the K/V of rank r - t);",
        "the all-gather algorithm computes them all at once after gathering. Steps and cells: mesh/context_parallel.py.",
    ]
    for i, line in enumerate(notes):
        svg.text(20, side + 130 + i * 16, line, size=11)
    for r in range(cp):  # legend
        svg.rect(20 + r * 62, side + 184, 56, 16, colour(r), text=f"rank {r}", size=10)
    return svg.render()
