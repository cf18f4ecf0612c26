"""Section 4: the rank grid of a layout and its process groups (the row-major rule of init_device_mesh)."""

from __future__ import annotations

import math

from docs.figures.svg import Svg

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def layout_groups(sizes: dict[str, int], ep: int = 1, ep_within_dp_shard: bool = False) -> dict[str, list[list[int]]]:
    """The process groups of each mesh dim: ranks are laid out row-major over MESH_ORDER (init_device_mesh's rule),
    and a dim's group is the ranks that differ only in that dim. With ep > 1, dp_shard x cp x tp = efsdp x ep
    (ep inner: mesh/dims.py), or, ``ep_within_dp_shard``, dp_shard = efsdp x ep (the earlier layout).
    A missing dim (``cp`` in older layouts) has size 1."""
    import torch

    sizes = {d: sizes.get(d, 1) for d in MESH_ORDER}
    shape = [sizes[d] for d in MESH_ORDER]
    grid = torch.arange(math.prod(shape)).view(shape)
    groups = {}
    for i, dim in enumerate(MESH_ORDER):
        groups[dim] = grid.movedim(i, -1).reshape(-1, shape[i]).tolist()
    groups["dp"] = grid.permute(0, 3, 4, 1, 2).reshape(-1, sizes["dp_replicate"] * sizes["dp_shard"]).tolist()
    if ep > 1 and ep_within_dp_shard:
        split = grid.view(shape[0], shape[1], shape[2] // ep, ep, shape[3], shape[4])
        groups["ep"] = split.movedim(3, -1).reshape(-1, ep).tolist()
        groups["efsdp"] = split.movedim(2, -1).reshape(-1, shape[2] // ep).tolist()
    elif ep > 1:
        borrowed = shape[2] * shape[3] * shape[4]  # dp_shard x cp x tp, flattened row-major
        split = grid.reshape(shape[0], shape[1], borrowed // ep, ep)
        groups["ep"] = split.reshape(-1, ep).tolist()
        groups["efsdp"] = split.movedim(2, -1).reshape(-1, borrowed // ep).tolist()
    return groups


# Each dim's groups are drawn as lines of its own colour through its ranks: the vertical dims (ranks in one
# column) to the right of the boxes, the horizontal ones (ranks in one row) below them.
VERTICAL = ("dp_replicate", "dp_shard")
HORIZONTAL = ("cp", "tp")
EXPERT_DIMS = ("ep", "efsdp")  # drawn as a column or a row when their groups are one; else listed only
DIM_COLOUR = {
    "dp_replicate": "#e15759",
    "dp_shard": "#4e79a7",
    "ep": "#b07aa1",
    "efsdp": "#76b7b2",
    "cp": "#59a14f",
    "tp": "#f28e2b",
    "pp": "#9a9a9a",
    "dp": "#333333",
}
MEANING = {
    "pp": "pipeline neighbours (send/recv): same box, next panel",
    "dp_replicate": "HSDP replicas (gradient all-reduce)",
    "dp_shard": "FSDP shard group (all-gather, reduce-scatter)",
    "tp": "tensor parallel (consecutive ranks)",
    "cp": "context parallel (K/V all-gather or ring)",
    "dp": "all data-parallel ranks (loader, loss)",
    "ep": "expert parallel (all-to-all), from dp_shard x cp x tp",
    "efsdp": "FSDP of expert weights",
}


def lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane per span such that spans sharing a lane do not overlap (first fit, in the order given)."""
    ends: list[float] = []  # the last span's end in each lane
    out = []
    for lo, hi in spans:
        lane = next((i for i, end in enumerate(ends) if end < lo), None)
        if lane is None:
            lane = len(ends)
            ends.append(hi)
        ends[lane] = hi
        out.append(lane)
    return out


def mesh_svg(sizes: dict[str, int], ep: int = 1) -> str:
    """The ranks as a grid, one panel per pipeline stage; every group of every dim drawn as a line of the dim's
    colour through its ranks (ep and efsdp beside the others, when their groups are a column or a row)."""
    sizes = {d: sizes.get(d, 1) for d in MESH_ORDER}
    pp, rep, shard, cp, tp = (sizes[d] for d in MESH_ORDER)
    groups = layout_groups(sizes, ep)
    drawn = lambda dims: [d for d in dims if d in groups and len(groups[d][0]) > 1]  # noqa: E731
    cols, rows = cp * tp, rep * shard

    def position(rank: int) -> tuple[int, int, int]:  # (panel, row, column) of a rank in the drawing
        p, rest = divmod(rank, rows * cols)
        return p, rest // cols, rest % cols

    def along(dim: str, axis: int) -> bool:  # every group of ``dim`` in one column (axis 2) or one row (axis 1)
        return all(len({position(m)[axis] for m in g}) == 1 for g in groups[dim])

    experts = drawn(EXPERT_DIMS)
    vertical = drawn(VERTICAL) + [d for d in experts if along(d, 2)]
    horizontal = drawn(HORIZONTAL) + [d for d in experts if d not in vertical and along(d, 1)]

    # Groups of one dim that overlap along their row or column (dp_replicate across shards, cp across tp) get
    # lanes of their own, so that every line is one group.
    lane_of: dict[tuple[str, int], int] = {}
    first_lane, n_lanes = {}, {"v": 0, "h": 0}
    for dim in (*vertical, *horizontal):
        axis = "v" if dim in vertical else "h"
        along = 1 if axis == "v" else 2  # the row index runs down a column, the column index along a row
        spans = [(min(position(m)[along] for m in g), max(position(m)[along] for m in g)) for g in groups[dim]]
        by_line: dict[tuple, list[int]] = {}
        for i, g in enumerate(groups[dim]):
            fixed = position(g[0])[0], position(g[0])[3 - along]
            by_line.setdefault(fixed, []).append(i)
        used = 1
        for members in by_line.values():
            for i, lane in zip(members, lanes([spans[i] for i in members]), strict=True):
                lane_of[(dim, i)] = lane
                used = max(used, lane + 1)
        first_lane[dim] = n_lanes[axis]
        n_lanes[axis] += used
    box, lane = 46, 7
    col_pitch = box + 12 + lane * n_lanes["v"]
    row_pitch = box + 12 + lane * n_lanes["h"]
    label_w = 110
    panel_w = label_w + cols * col_pitch
    listed = [d for d in (*MESH_ORDER, "dp", "ep", "efsdp") if d in groups and len(groups[d][0]) > 1]
    width = max(20 + pp * (panel_w + 20), 760)
    svg = Svg(width, 0)
    shown_dims = [d for d in MESH_ORDER if d != "cp" or cp > 1]
    layout = " x ".join(f"{d} {sizes[d]}" for d in shown_dims) + (
        f" (ep {ep} from dp_shard x cp x tp)" if ep > 1 else ""
    )
    y0 = svg.lines(
        10, 22, f"DeviceMesh {layout}: {math.prod(sizes.values())} ranks, row-major", width - 20, size=14, weight="bold"
    )
    grid_top = y0 + 36
    centre = {}
    for p in range(pp):
        x0 = 20 + p * (panel_w + 20)
        svg.text(x0, y0 + 6, f"pp = {p}" + (" (pipeline stage)" if pp > 1 else ""), size=12, weight="bold")
        for col in range(cols):
            c, t = divmod(col, tp)
            label = f"cp {c} tp {t}" if cp > 1 else f"tp {t}"
            svg.text(x0 + label_w + col * col_pitch + box / 2, grid_top - 8, label, anchor="middle", size=10)
        for row in range(rows):
            r_i, s_i = divmod(row, shard)
            y = grid_top + row * row_pitch
            name = f"rep {r_i} shard {s_i}" if rep > 1 else f"dp_shard {s_i}"
            svg.text(x0 + label_w - 6, y + box / 2 + 4, name, anchor="end", size=10)
            for col in range(cols):
                c, t = divmod(col, tp)
                rank = (((p * rep + r_i) * shard + s_i) * cp + c) * tp + t
                x = x0 + label_w + col * col_pitch
                centre[rank] = (x, y)
                where = f"dp_shard {s_i}, cp {c}, tp {t}" if cp > 1 else f"dp_shard {s_i}, tp {t}"
                svg.rect(
                    x,
                    y,
                    box,
                    box,
                    "#f4f4f4",
                    stroke="#777777",
                    text=str(rank),
                    text_fill="#222222",
                    size=15,
                    tooltip=f"rank {rank}: pp {p}, dp_replicate {r_i}, {where}",
                )
    for dim in vertical:
        for i, members in enumerate(groups[dim]):
            xs = {centre[m][0] for m in members}
            assert len(xs) == 1, f"{dim} group {members} is not one column"
            lx = xs.pop() + box + 6 + (first_lane[dim] + lane_of[(dim, i)]) * lane
            ys = [centre[m][1] + box / 2 for m in members]
            svg.line(lx, min(ys), lx, max(ys), stroke=DIM_COLOUR[dim], width=3)
            for y in ys:
                svg.line(lx - 4, y, lx + 0.5, y, stroke=DIM_COLOUR[dim], width=3)
    for dim in horizontal:
        for i, members in enumerate(groups[dim]):
            ys = {centre[m][1] for m in members}
            assert len(ys) == 1, f"{dim} group {members} is not one row"
            ly = ys.pop() + box + 6 + (first_lane[dim] + lane_of[(dim, i)]) * lane
            xs = [centre[m][0] + box / 2 for m in members]
            svg.line(min(xs), ly, max(xs), ly, stroke=DIM_COLOUR[dim], width=3)
            for x in xs:
                svg.line(x, ly - 4, x, ly + 0.5, stroke=DIM_COLOUR[dim], width=3)
    y = grid_top + rows * row_pitch + 22
    if cp > 1:  # the loss mesh adds cp: cp ranks of one dp rank share its sequences
        MEANING_HERE = {**MEANING, "dp": "data-parallel ranks (loader; loss adds cp)"}
    else:
        MEANING_HERE = MEANING
    for d in listed:
        shown = " ".join(str(g) for g in groups[d][:8]) + (" ..." if len(groups[d]) > 8 else "")
        if d in vertical or d in horizontal:
            svg.line(20, y - 4, 44, y - 4, stroke=DIM_COLOUR[d], width=3)
        svg.text(52, y, f"{d:<13} {MEANING_HERE[d]:<56} {shown}".replace(" ", "\u00a0"), size=11)
        y += 17
    note = "lines: the groups of each dim, drawn through their ranks" + (
        "; ep takes the innermost ranks of dp_shard x cp x tp (tp first)" if ep > 1 else ""
    )
    svg.height = svg.lines(20, y + 4, note, width - 40, size=10) + 4
    return svg.render()
