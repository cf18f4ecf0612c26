"""Section 2: what each ZeRO stage keeps on a data-parallel rank (bytes from measure/memory_table.py)."""

from __future__ import annotations

from docs.figures.svg import LIGHT, Svg, colour


def zero_svg(n: int = 4) -> str:
    """What each of n data-parallel ranks holds, per parameter: bf16 weights 2, grads 2, fp32 optimizer 12."""
    from measure.memory_table import bytes_per_rank

    per_param = bytes_per_rank(1, n)
    rows = [
        ("DDP", "full state", (1, 1, 1)),
        ("ZeRO-1", "ZeRO-1", (1, 1, n)),
        ("ZeRO-2", "ZeRO-2", (1, n, n)),
        ("ZeRO-3 / FSDP", "ZeRO-3/FSDP", (n, n, n)),
    ]
    parts = [("params 2", 2, colour(0)), ("grads 2", 2, colour(1)), ("Adam m, v + fp32 weights 12", 12, colour(2))]
    unit, left, top = 26, 130, 50
    svg = Svg(left + 16 * unit + 90, top + len(rows) * (n * 18 + 34) + 50)
    svg.text(10, 22, f"What each of dp = {n} data-parallel ranks holds, in bytes per parameter", size=14, weight="bold")
    y = top
    for label, key, divisors in rows:
        svg.text(10, y + 14, label, size=13, weight="bold")
        svg.text(left + 16 * unit + 10, y + 14, f"{per_param[key]:g} B", size=12, weight="bold")
        for r in range(n):
            x = left
            for (name, size, fill), div in zip(parts, divisors, strict=True):
                width = size * unit
                svg.rect(x, y + 22 + r * 18, width, 14, LIGHT, stroke="#cccccc")
                held = width / div
                svg.rect(
                    x + (r * held if div > 1 else 0),
                    y + 22 + r * 18,
                    held,
                    14,
                    fill,
                    tooltip=f"rank {r}: {name} / {div}",
                )
                x += width
            svg.text(left - 8, y + 33 + r * 18, f"rank {r}", anchor="end", size=10)
        y += n * 18 + 34
    for i, (name, _, fill) in enumerate(parts):
        svg.rect(10 + i * 120, y, 12, 12, fill)
        svg.text(10 + i * 120 + 16, y + 10, name.split(" ")[0] if i < 2 else "optimizer", size=10)
    svg.text(370, y + 10, "grey: held by another rank", size=10)
    svg.text(
        10,
        y + 30,
        "bf16 params 2 + bf16 grads 2 + fp32 master, Adam m and v 4 + 4 + 4 = 16 (measure/memory_table.py)",
        size=10,
    )
    return svg.render()
