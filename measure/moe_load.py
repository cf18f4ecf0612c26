"""Expert load with no balancing, with the aux loss, and with the aux-loss-free bias: a table and a plot.

    python -m measure.moe_load [--steps 40] [--aux-coef 0.01] [--bias-rate 0.005] [--runs none,aux,bias]
                             [--out docs/img/moe_load.svg]
    python -m measure.moe_load --runs bias --bias-rate 0.003,0.01,0.1 --out ''    # a rate scan: one run a rate

Trains configs/debug_moe.toml (8 experts, top-2, 4 MoE layers) on one process, once per balancing scheme,
from the same initial weights and the same data:

- ``none``: ``model.moe_aux_loss_coef 0`` and ``model.moe_bias_update_rate 0``;
- ``aux``:  the Switch-style auxiliary loss only (``--aux-coef``);
- ``bias``: the aux-loss-free expert bias only (``--bias-rate``; it moves each bias by +-rate per step); several
  comma-separated rates give one bias run, one table row and one line of the picture each.

Every logged step's record (``run.log_every 1`` here: every step) carries the global tokens per expert of every
MoE layer (training/step.py reads the load on log steps only); the coefficient of
variation (std / mean) of those counts, averaged over the layers, is ``expert_load_cv`` and the worst
layer's max / mean is ``expert_load_max_over_mean`` (mesh/expert_parallel.load_metrics). The script prints
both at a few steps and draws both, per step, as a hand-written SVG line chart. Run dirs go to a temporary
folder; TensorBoard is off.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from runtime.options import count_option, float_option, list_option, path_option

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "debug_moe.toml"
COLOURS = {"none": "#d62728", "aux": "#1f77b4", "bias": "#2ca02c"}
RATE_COLOURS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#ff7f0e")
TABLE_STEPS = (1, 10, 20, 40)


AUX_COEF, BIAS_RATE = 0.01, 0.005  # the balanced runs' defaults (docs/expert_parallel.md, section 5 quotes them)


def schemes(aux_coef: float, bias_rates: list[float]) -> dict[str, tuple[str, dict]]:
    """name -> (legend label, config overrides): ``bias`` for one rate, ``bias R`` for each of several."""
    out = {
        "none": ("no balancing", {"model.moe_aux_loss_coef": 0.0, "model.moe_bias_update_rate": 0.0}),
        "aux": (
            f"aux loss, coef {aux_coef:g}",
            {"model.moe_aux_loss_coef": aux_coef, "model.moe_bias_update_rate": 0.0},
        ),
    }
    for rate in bias_rates:
        name = "bias" if len(bias_rates) == 1 else f"bias {rate:g}"
        out[name] = (f"bias, rate {rate:g}", {"model.moe_aux_loss_coef": 0.0, "model.moe_bias_update_rate": rate})
    return out


def colours(names: list[str]) -> dict[str, str]:
    """A line colour per run: the scheme's own, or one per bias rate of a scan."""
    rates = [n for n in names if n.startswith("bias ")]
    return {n: COLOURS[n] if n in COLOURS else RATE_COLOURS[rates.index(n) % len(RATE_COLOURS)] for n in names}


def run(overrides: dict, steps: int, run_dir: str) -> list[dict]:
    """One in-process training run (a world of one; train() creates the process group if needed). Every step is
    a log step: the expert load is read on log steps only (training/step.py), and the table and the picture need
    it at every step."""
    from runtime.config import load_config
    from train import train

    base = {"training.steps": steps, "run.dir": run_dir, "run.tensorboard": False, "run.log_every": 1}
    return train(load_config(path=str(CONFIG), overrides={**base, **overrides}))


# ---- the picture -------------------------------------------------------------------------------------------


def nice_ticks(top: float, n: int = 5) -> list[float]:
    """About n round tick values from 0 to at least ``top``."""
    raw = max(top, 1e-9) / n
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= raw)
    ticks = [0.0]
    while ticks[-1] < top * (1 - 1e-9):
        ticks.append(round(ticks[-1] + step, 9))
    return ticks


def panel(
    series: dict[str, list[float]],
    labels: dict[str, str],
    key_title: str,
    x0: float,
    y0: float,
    width: float,
    height: float,
    y_floor: float = 0.0,
    ceiling: tuple[float, str] | None = None,
) -> list[str]:
    """One line chart: axes, ticks, grid, a polyline per series. ``y_floor`` is the bottom of the y axis;
    ``ceiling`` (value, label) draws a dashed horizontal line."""
    steps = max(len(v) for v in series.values())
    top = max([max(v) for v in series.values()] + ([ceiling[0]] if ceiling else []))
    ticks = [t + y_floor for t in nice_ticks(top - y_floor)]
    y_max = ticks[-1]

    def px(step: int) -> float:
        return x0 + (step - 1) / max(1, steps - 1) * width

    def py(value: float) -> float:
        return y0 + height - (value - y_floor) / (y_max - y_floor) * height

    parts = [f'<text x="{x0}" y="{y0 - 8}" font-size="12">{key_title}</text>']
    for t in ticks:
        y = py(t)
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + width}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
    x_ticks = sorted({1, *range(5, steps + 1, 5)})
    for s in x_ticks:
        x = px(s)
        parts.append(f'<line x1="{x:.1f}" y1="{y0 + height}" x2="{x:.1f}" y2="{y0 + height + 4}" stroke="black"/>')
        parts.append(f'<text x="{x:.1f}" y="{y0 + height + 16}" text-anchor="middle">{s}</text>')
    parts.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + height}" stroke="black"/>')
    parts.append(f'<line x1="{x0}" y1="{y0 + height}" x2="{x0 + width}" y2="{y0 + height}" stroke="black"/>')
    parts.append(f'<text x="{x0 + width / 2}" y="{y0 + height + 32}" text-anchor="middle">optimizer step</text>')
    if ceiling:
        y = py(ceiling[0])
        parts.append(
            f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + width}" y2="{y:.1f}" stroke="black" stroke-dasharray="4 3"/>'
        )
        parts.append(f'<text x="{x0 + width - 4}" y="{y + 14:.1f}" text-anchor="end">{ceiling[1]}</text>')
    for name, values in series.items():
        points = " ".join(f"{px(i + 1):.1f},{py(v):.1f}" for i, v in enumerate(values))
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{colours(list(series))[name]}" stroke-width="2">'
            f"<title>{labels[name]}</title></polyline>"
        )
    return parts


def load_svg(records: dict[str, list[dict]], labels: dict[str, str], title: str, n_experts: int, top_k: int) -> str:
    """Two panels side by side: mean-over-layers CV of the expert load, and the worst layer's max/mean.

    max/mean cannot exceed n_experts / top_k: an expert gets at most every token once, and the mean is
    tokens * top_k / n_experts. The right panel marks that ceiling.
    """
    left, top, width, height, gap = 60, 50, 430, 260, 90
    total_w = left + 2 * width + gap + 20
    total_h = top + height + 80
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
        'font-family="monospace" font-size="11">',
        f'<rect width="{total_w}" height="{total_h}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="13">{title}</text>',
    ]
    cv = {name: [r["expert_load_cv"] for r in recs] for name, recs in records.items()}
    ratio = {name: [r["expert_load_max_over_mean"] for r in recs] for name, recs in records.items()}
    parts += panel(
        cv, labels, "coefficient of variation of tokens per expert (mean over layers)", left, top, width, height
    )
    parts += panel(
        ratio,
        labels,
        "max / mean tokens per expert (worst layer)",
        left + width + gap,
        top,
        width,
        height,
        y_floor=1.0,
        ceiling=(n_experts / top_k, f"ceiling E/k = {n_experts / top_k:g}"),
    )
    legend_y = top + height + 62
    for i, name in enumerate(records):
        x = left + i * 260
        parts.append(
            f'<line x1="{x}" y1="{legend_y - 4}" x2="{x + 24}" y2="{legend_y - 4}" '
            f'stroke="{colours(list(records))[name]}" stroke-width="3"/>'
        )
        parts.append(f'<text x="{x + 30}" y="{legend_y}">{labels[name]}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---- main --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.moe_load", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=count_option(), default=40)
    parser.add_argument("--aux-coef", type=float_option(ge=0), default=AUX_COEF)
    parser.add_argument(
        "--bias-rate",
        type=list_option(item=float_option(ge=0)),
        default=f"{BIAS_RATE:g}",
        help="the bias run's rate, or comma-separated rates: one bias run each",
    )
    parser.add_argument(
        "--runs",
        type=list_option(choices=("none", "aux", "bias")),
        default="none,aux,bias",
        help="which of none, aux, bias to run",
    )
    parser.add_argument(
        "--out",
        type=path_option(required=False),
        default=str(ROOT / "docs" / "img" / "moe_load.svg"),
        help="'' for no picture",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.bias_rate.split(",")]
    if len(set(rates)) < len(rates):
        parser.error(f"--bias-rate {args.bias_rate} names a rate twice; give each rate once")
    table = schemes(args.aux_coef, rates)
    runs = [n for n in args.runs.split(",") if n]
    unknown = set(runs) - {"none", "aux", "bias"}
    if unknown:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from none, aux, bias")
    names = list(dict.fromkeys(n for r in runs for n in table if n == r or (r == "bias" and n.startswith("bias"))))
    if args.out:  # the picture is written after minutes of training: its path is checked first
        from runtime.config import ConfigError
        from runtime.options import check_out_folder

        if Path(args.out).is_dir():
            parser.error(
                f"--out {args.out} is a folder; pass the picture's file path, e.g. {Path(args.out) / 'moe_load.svg'}"
            )
        try:
            check_out_folder(Path(args.out).parent, "--out's folder")
        except ConfigError as err:
            parser.error(str(err))

    records, labels = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            label, overrides = table[name]
            start = time.perf_counter()
            records[name] = run(overrides, args.steps, str(Path(tmp) / name))
            labels[name] = label
            print(f"# {label}: {args.steps} steps in {time.perf_counter() - start:.0f} s", flush=True)

    steps = [s for s in TABLE_STEPS if s <= args.steps]
    tail = min(10, args.steps)  # one step's CV is noisy: also the mean over the last `tail` steps
    print(f"\nexpert load, configs/debug_moe.toml on one process, {args.steps} steps")
    print(
        "CV = std/mean of tokens per expert, mean over the MoE layers; max/mean = worst layer; "
        f"'CV, last {tail}' = mean CV of the last {tail} steps"
    )
    print(
        f"{'run':<22}"
        + "".join(f"{'CV@' + str(s):>9}" for s in steps)
        + "".join(f"{'max/mean@' + str(s):>13}" for s in steps)
        + f"{'CV, last ' + str(tail):>12}"
        + f"{'final loss':>12}"
    )
    for name, recs in records.items():
        print(
            f"{labels[name]:<22}"
            + "".join(f"{recs[s - 1]['expert_load_cv']:>9.3f}" for s in steps)
            + "".join(f"{recs[s - 1]['expert_load_max_over_mean']:>13.3f}" for s in steps)
            + f"{sum(r['expert_load_cv'] for r in recs[-tail:]) / tail:>12.3f}"
            + f"{recs[-1]['loss']:>12.4f}"
        )
    print("\nlast step: tokens per expert, layer 0; aux loss (logged sum over layers); dropped assignments")
    for name, recs in records.items():
        last = recs[-1]
        print(
            f"{labels[name]:<22} {last['expert_load']['0']}  aux {last['aux_loss']:.5f}  dropped {last['dropped_assignments']}"
        )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        from runtime.config import load_config

        model = load_config(path=str(CONFIG)).model
        n_layers = len(next(iter(records.values()))[0]["expert_load"])
        title = (
            f"Expert load per step: configs/debug_moe.toml ({model.n_experts} experts, top-{model.top_k}, "
            f"{n_layers} MoE layers), one process"
        )
        out.write_text(load_svg(records, labels, title, model.n_experts, model.top_k))
        print(f"\npicture -> {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
