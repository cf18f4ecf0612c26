"""Checkpoint chapter, section 9: the RoPE wavelengths of Llama 3.1's head, unscaled, linear and llama3.

The curves are models/rope.scaled_frequencies itself (the code the model's rotary tables use), for
Llama 3.1's published settings: head_dim 128, theta 500,000, factor 8, low/high frequency factors 1 and 4,
original context 8,192.
"""

from __future__ import annotations

import math

from docs.figures.svg import DARK, GREY, Svg, colour

LLAMA31 = {"head_dim": 128, "theta": 500000.0, "factor": 8.0, "low": 1.0, "high": 4.0, "original": 8192}


def wavelengths() -> dict[str, list[float]]:
    """Wavelength in tokens (2 pi / w_i) of every rotated pair, for each scaling type."""
    from models.rope import RopeScaling, scaled_frequencies

    p = LLAMA31
    kinds = {
        "none": RopeScaling(),
        "linear x8": RopeScaling("linear", p["factor"]),
        "llama3": RopeScaling("llama3", p["factor"], p["low"], p["high"], p["original"]),
    }
    return {
        name: [2 * math.pi / w for w in scaled_frequencies(p["head_dim"], p["theta"], s).tolist()]
        for name, s in kinds.items()
    }


def rope_svg() -> str:
    curves = wavelengths()
    width, height, left, top, plot_w, plot_h = 760, 450, 70, 60, 640, 280
    lo_exp, hi_exp = 0, 8  # 10^0 .. 10^8 tokens
    svg = Svg(width, height)
    svg.text(left, 24, "RoPE wavelength of each rotated pair (Llama 3.1 head: d 128, theta 500,000)", weight="bold")
    svg.text(left, 42, "log scale; a pair turns once per wavelength; scaling stretches the slow pairs", fill=GREY)

    def x_of(i: int) -> float:
        return left + plot_w * i / 63

    def y_of(tokens: float) -> float:
        return top + plot_h * (1 - (math.log10(tokens) - lo_exp) / (hi_exp - lo_exp))

    svg.line(left, top + plot_h, left + plot_w, top + plot_h, stroke=DARK)
    svg.line(left, top, left, top + plot_h, stroke=DARK)
    for e in range(lo_exp, hi_exp + 1, 2):
        svg.text(left - 8, y_of(10**e) + 4, f"1e{e}", anchor="end", size=10)
        svg.line(left - 4, y_of(10**e), left, y_of(10**e), stroke=DARK)
    for i in (0, 16, 32, 48, 63):
        svg.text(x_of(i), top + plot_h + 16, str(i), anchor="middle", size=10)
    svg.text(left + plot_w / 2, top + plot_h + 32, "pair i (frequency w_i = theta^(-2i/d))", anchor="middle", size=11)
    p = LLAMA31
    for tokens, label in (
        (p["original"] / p["high"], "L0 / high_freq_factor = 2,048"),
        (p["original"] / p["low"], "L0 / low_freq_factor = 8,192"),
    ):
        svg.line(left, y_of(tokens), left + plot_w, y_of(tokens), stroke=GREY, width=0.8)
        svg.text(left + 6, y_of(tokens) - 4, label, fill=GREY, size=10)
    # Where two types agree the curves lie on each other: drawn wide to narrow, each stays visible.
    styles = {"none": ("#c8c8c8", 6.0), "linear x8": (colour(1), 3.5), "llama3": (colour(0), 1.5)}
    for k, (name, values) in enumerate(curves.items()):
        stroke, width_px = styles[name]
        for i in range(len(values) - 1):
            svg.line(x_of(i), y_of(values[i]), x_of(i + 1), y_of(values[i + 1]), stroke=stroke, width=width_px)
        svg.line(left + 20 + 190 * k, height - 56, left + 50 + 190 * k, height - 56, stroke=stroke, width=width_px)
        svg.text(left + 56 + 190 * k, height - 52, name, size=11)
    svg.lines(
        left,
        height - 30,
        "llama3 keeps the pairs that turn 4+ times in 8,192 tokens, divides by 8 those turning less than once, blends between",
        plot_w,
        size=10,
        fill=GREY,
    )
    return svg.render()
