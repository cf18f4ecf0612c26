"""Section 4: the rank grid of a layout and its process groups (the row-major rule of init_device_mesh)."""

from __future__ import annotations

import math

from docs.figures.svg import Svg, colour

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def layout_groups(sizes: dict[str, int], ep: int = 1) -> dict[str, list[list[int]]]:
    """The process groups of each mesh dim: ranks are laid out row-major over MESH_ORDER (init_device_mesh's rule),
    and a dim's group is the ranks that differ only in that dim. With ep > 1, dp_shard = efsdp x ep (ep inner).
    A missing dim (``cp`` in older layouts) has size 1."""
    import torch

    sizes = {d: sizes.get(d, 1) for d in MESH_ORDER}
    shape = [sizes[d] for d in MESH_ORDER]
    grid = torch.arange(math.prod(shape)).view(shape)
    groups = {}
    for i, dim in enumerate(MESH_ORDER):
        groups[dim] = grid.movedim(i, -1).reshape(-1, shape[i]).tolist()
    groups["dp"] = grid.permute(0, 3, 4, 1, 2).reshape(-1, sizes["dp_replicate"] * sizes["dp_shard"]).tolist()
    if ep > 1:
        split = grid.view(shape[0], shape[1], shape[2] // ep, ep, shape[3], shape[4])
        groups["ep"] = split.movedim(3, -1).reshape(-1, ep).tolist()
        groups["efsdp"] = split.movedim(2, -1).reshape(-1, shape[2] // ep).tolist()
    return groups


def mesh_svg(sizes: dict[str, int], ep: int = 1) -> str:
    sizes = {d: sizes.get(d, 1) for d in MESH_ORDER}
    pp, rep, shard, cp, tp = (sizes[d] for d in MESH_ORDER)
    box, gap = 58, 8
    cols = cp * tp
    panel_w = 120 + cols * (box + gap)
    rows = rep * shard
    groups = layout_groups(sizes, ep)
    listed = [d for d in (*MESH_ORDER, "dp", "ep", "efsdp") if d in groups and len(groups[d][0]) > 1]
    svg = Svg(max(20 + pp * (panel_w + 20), 720), 90 + rows * (box + gap) + 40 + 16 * len(listed) + 20)
    shown_dims = [d for d in MESH_ORDER if d != "cp" or cp > 1]
    layout = " x ".join(f"{d} {sizes[d]}" for d in shown_dims) + (f" (ep {ep} inside dp_shard)" if ep > 1 else "")
    svg.text(10, 22, f"DeviceMesh {layout}: {math.prod(sizes.values())} ranks, row-major", size=14, weight="bold")
    for p in range(pp):
        x0 = 20 + p * (panel_w + 20)
        svg.text(x0, 50, f"pp = {p}" + (" (pipeline stage)" if pp > 1 else ""), size=12, weight="bold")
        for col in range(cols):
            c, t = divmod(col, tp)
            label = f"cp {c} tp {t}" if cp > 1 else f"tp {t}"
            svg.text(x0 + 110 + col * (box + gap) + box / 2, 70, label, anchor="middle", size=11 if cp == 1 else 9)
        for row in range(rows):
            r_i, s_i = divmod(row, shard)
            y = 78 + row * (box + gap)
            name = f"rep {r_i} shard {s_i}" if rep > 1 else f"dp_shard {s_i}"
            svg.text(x0 + 104, y + box / 2 + 4, name, anchor="end", size=10)
            for col in range(cols):
                c, t = divmod(col, tp)
                rank = (((p * rep + r_i) * shard + s_i) * cp + c) * tp + t
                fill = colour(s_i % ep) if ep > 1 else colour(row)
                where = f"dp_shard {s_i}, cp {c}, tp {t}" if cp > 1 else f"dp_shard {s_i}, tp {t}"
                svg.rect(
                    x0 + 110 + col * (box + gap),
                    y,
                    box,
                    box,
                    fill,
                    text=str(rank),
                    size=16,
                    tooltip=f"rank {rank}: pp {p}, dp_replicate {r_i}, {where}",
                )
    y = 90 + rows * (box + gap) + 20
    meaning = {
        "pp": "pipeline neighbours (send/recv)",
        "dp_replicate": "HSDP replicas (gradient all-reduce)",
        "dp_shard": "FSDP shard group (all-gather, reduce-scatter)",
        "tp": "tensor parallel (consecutive ranks)",
        "cp": "context parallel (K/V all-gather or ring)",
        "dp": "all data-parallel ranks (loader, loss)",
        "ep": "expert parallel (all-to-all)",
        "efsdp": "FSDP of expert weights",
    }
    if cp > 1:  # the loss mesh adds cp: cp ranks of one dp rank share its sequences
        meaning["dp"] = "data-parallel ranks (loader; loss adds cp)"
    for d in listed:
        shown = " ".join(str(g) for g in groups[d][:8]) + (" ..." if len(groups[d]) > 8 else "")
        svg.text(20, y, f"{d:<13} {meaning[d]:<46} {shown}".replace(" ", "\u00a0"), size=11)
        y += 16
    note = "colour: ep coordinate" if ep > 1 else "colour: data-parallel row"
    svg.text(20, y + 4, note, size=10)
    return svg.render()
