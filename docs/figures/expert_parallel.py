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
