"""Section 5: expert parallelism's dispatch and combine (the routing of examples/moe_from_scratch.py)."""

from __future__ import annotations

from docs.figures.svg import Svg, colour


def ep_example(ep: int = 2, n_experts: int = 4) -> dict:
    """The routing of examples/moe_from_scratch.py: per source rank, its tokens' experts and the rows per expert."""
    import torch

    from examples.moe_from_scratch import example_routing

    _, _, choice = example_routing(ep, n_experts)
    return {
        "choice": [c.tolist() for c in choice],
        "counts": [torch.bincount(c, minlength=n_experts).tolist() for c in choice],  # [source][expert]
    }


def ep_svg(ep: int = 2, n_experts: int = 4) -> str:
    data = ep_example(ep, n_experts)
    n_local = n_experts // ep
    cell = 24
    svg = Svg(1120, 110 + ep * 120)
    svg.text(
        10,
        22,
        f"Expert parallelism: {n_experts} experts on {ep} ranks (rank r owns experts "
        f"{n_local}r..{n_local}r+{n_local - 1}), top-1 routing of examples/moe_from_scratch.py",
        size=13,
        weight="bold",
    )
    columns = [
        (20, "tokens, sorted by expert"),
        (300, "1. counts exchanged"),
        (520, "2. dispatch: rows arrive by (source, expert)"),
        (820, "3. local experts; 4. combine: back"),
    ]
    for x, title in columns:
        svg.text(x, 50, title, size=11, weight="bold")
    for r in range(ep):
        y0 = 70 + r * 120
        svg.text(10, y0 - 4, f"rank {r}", size=12, weight="bold")
        sorted_experts = sorted(data["choice"][r])
        for i, e in enumerate(sorted_experts):
            svg.rect(20 + i * cell, y0 + 10, cell - 2, cell, colour(e), text=f"e{e}", size=9)
        splits = [sum(data["counts"][r][d * n_local : (d + 1) * n_local]) for d in range(ep)]
        svg.text(20, y0 + 50, "to ranks " + ", ".join(f"{d}: {n}" for d, n in enumerate(splits)) + " rows", size=10)
        svg.text(300, y0 + 26, f"sends {data['counts'][r]}", size=11)
        recv = [[data["counts"][s][e] for e in range(r * n_local, (r + 1) * n_local)] for s in range(ep)]
        svg.text(300, y0 + 44, f"receives {recv}", size=11)
        svg.text(300, y0 + 60, "(per source, per local expert)", size=9)
        x = 520
        for s in range(ep):
            for e_local in range(n_local):
                e = r * n_local + e_local
                for _ in range(data["counts"][s][e]):
                    svg.rect(x, y0 + 10, cell - 4, cell, colour(e), text=f"{s}", size=9, tooltip=f"from rank {s}")
                    x += cell - 2
            x += 8
        x = 820
        for e_local in range(n_local):
            e = r * n_local + e_local
            n_rows = sum(data["counts"][s][e] for s in range(ep))
            svg.rect(x, y0 + 10, 80, cell, colour(e), text=f"expert {e}: {n_rows}", size=9)
            x += 90
        svg.text(820, y0 + 56, "outputs return in arrival order,", size=10)
        svg.text(820, y0 + 70, "then to their source (splits swapped)", size=10)
    y = 90 + ep * 120
    svg.text(
        20,
        y - 20,
        "The numbers in the dispatched rows are their source rank. Forward: 1 count exchange + 2 "
        "all-to-alls (dispatch, combine); backward: 2 all-to-alls (their reverses).",
        size=11,
    )
    svg.text(
        20,
        y - 4,
        "Counted in tests/test_collective_counts.py; the same example runs in examples/moe_from_scratch.py.",
        size=11,
    )
    return svg.render()


# ---- where each expert lives (section "Where each expert lives") ---------------------------------------------

PLACEMENT_SIZES = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
PLACEMENT_LAYOUTS = (  # (title, ep, ep_within_dp_shard)
    ("ep 4 over dp_shard x tp", 4, False),
    ("ep 2 over dp_shard x tp", 2, False),
    ("ep 2 within dp_shard (earlier)", 2, True),
)


def expert_holdings(sizes: dict[str, int], ep: int, n_experts: int, ep_within_dp_shard: bool = False) -> dict:
    """Per rank: (the experts it holds a shard of, the share of each it holds). Rank r of an ep group owns experts
    [r E/ep, (r+1) E/ep) (mesh/expert_parallel.py: Shard(0) over ep), and FSDP splits them over its efsdp group.
    The groups are mesh_grid.layout_groups', the same row-major rule as mesh/dims.py (checked by a test)."""
    from docs.figures.mesh_grid import layout_groups

    groups = layout_groups(sizes, ep, ep_within_dp_shard)
    n_local = n_experts // ep
    held = {}
    for group in groups["ep"]:
        for ep_rank, rank in enumerate(group):
            held[rank] = (list(range(ep_rank * n_local, (ep_rank + 1) * n_local)), 1 / len(groups["efsdp"][0]))
    return dict(sorted(held.items()))


def expert_placement_svg(n_experts: int = 4) -> str:
    """dp_shard 2 x tp 2: which experts each rank holds under each layout of PLACEMENT_LAYOUTS."""
    box, pitch, panel_w = 120, 132, 330
    svg = Svg(40 + len(PLACEMENT_LAYOUTS) * panel_w, 0)
    y0 = svg.lines(
        10,
        22,
        f"Where each expert lives: {n_experts} experts on dp_shard 2 x tp 2 (rank = 2 x dp_shard + tp), one MoE layer",
        svg.width - 20,
        size=13,
        weight="bold",
    )
    for i, (title, ep, within) in enumerate(PLACEMENT_LAYOUTS):
        x0 = 20 + i * panel_w
        held = expert_holdings(PLACEMENT_SIZES, ep, n_experts, within)
        share = sum(len(e) * f for e, f in held.values()) / n_experts
        svg.text(x0, y0 + 14, title, size=12, weight="bold")
        svg.text(x0, y0 + 30, f"all ranks hold {share:g} cop{'y' if share == 1 else 'ies'} of every expert", size=10)
        for t in range(2):
            svg.text(x0 + 60 + t * pitch + box / 2, y0 + 52, f"tp {t}", anchor="middle", size=10)
        for s in range(2):
            svg.text(x0 + 52, y0 + 64 + s * 64 + 30, f"dp_shard {s}", anchor="end", size=10)
            for t in range(2):
                rank = 2 * s + t
                experts, frac = held[rank]
                x, y = x0 + 60 + t * pitch, y0 + 64 + s * 64
                svg.rect(x, y, box, 56, "#f4f4f4", stroke="#777777", tooltip=f"rank {rank}")
                svg.text(x + 4, y + 14, f"rank {rank}", size=10, weight="bold")
                width = (box - 8) / len(experts)
                for j, e in enumerate(experts):
                    label = f"E{e}" if frac == 1 else f"1/{round(1 / frac)} of E{e}"
                    svg.rect(x + 4 + j * width, y + 22, width - 2, 28, colour(e), text=label, size=10)
    note = (
        "ep over dp_shard x tp (mesh/dims.py): each expert has one copy, split over ep and FSDP's efsdp; "
        "gradients, fp32 master weights and Adam moments follow. The earlier layout, ep carved from dp_shard alone, "
        "held every expert whole on both tp ranks. Bytes: python -m measure.ep_placement."
    )
    svg.height = svg.lines(20, y0 + 64 + 2 * 64 + 18, note, svg.width - 40, size=10) + 6
    return svg.render()
