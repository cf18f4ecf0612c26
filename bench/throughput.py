"""Tokens per second of meshloom against a plain PyTorch loop, and of each layout against one process.

    python -m bench.throughput                          # the default set, about 8 minutes on 2 CPU cores
    python -m bench.throughput --layouts plain,one --rounds 4      # just the 1-process overhead
    python -m bench.throughput --compile                # adds compiled runs per layout (compile's speedup)
    python -m bench.throughput --moe                    # adds MoE runs (configs/debug_moe.toml shape)
    python -m bench.throughput --gpu-1b                 # on a GPU: a Llama-3.2-1B-shaped model in bf16

The measurement, and what it counts and why: measure/throughput.py. This file prints it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from launch.spawn import RankFailure
from measure.throughput import (
    BASELINE,
    DEFAULT,
    LAYOUTS,
    MOE,
    MOE_SHAPE,
    SHAPE,
    gpu_1b,
    median_after,
    run_layout,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(DEFAULT), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each runs every layout once)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--compile", action="store_true", help="also run each layout with training.compile=true")
    parser.add_argument("--moe", action="store_true", help="also run moe-one and moe-tp2")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak TFLOP/s of one device: prints MFU")
    parser.add_argument("--seq-len", type=int, default=SHAPE["training.seq_len"])
    parser.add_argument("--set", action="append", default=[], help="extra override for every run, key=value")
    parser.add_argument("--gpu-1b", action="store_true", help="a Llama-3.2-1B-shaped model in bf16 on one GPU")
    parser.add_argument("--smoke", action="store_true", help="with --gpu-1b: 1 layer, short sequences, any device")
    parser.add_argument("--no-compile", action="store_true", help="with --gpu-1b: leave out the compiled run")
    args = parser.parse_args(argv)
    if args.gpu_1b:
        return gpu_1b(args.rounds, args.warmup, args.peak_tflops, args.smoke, args.no_compile, args.set)
    names = [n for n in args.layouts.split(",") if n]
    if args.moe:
        names += [n for n in ("moe-one", "moe-tp2") if n not in names]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    runs = [(n, {}) for n in names]
    if args.compile:
        runs += [(n + "+compile", {"training.compile": True}) for n in names if n != "plain"]
    extra = dict(kv.split("=", 1) for kv in args.set)
    shape = {**SHAPE, "training.seq_len": args.seq_len, "model.max_seq_len": args.seq_len}
    if "plain" in names and "one" not in names:
        runs.insert(names.index("plain") + 1, ("one", {}))
    results: dict[str, list[dict]] = {name: [] for name, _ in runs}
    started = time.monotonic()
    refused: dict[str, str] = {}
    for round_ in range(args.rounds):
        # Odd rounds run the layouts in reverse (A B C, C B A, ...): a drift in the machine's speed over the
        # invocation then hits every layout about equally.
        for name, more in runs if round_ % 2 == 0 else runs[::-1]:
            if name in refused or (name == "one" and "plain" in results):  # "one" runs paired with "plain"
                continue
            layout = name.split("+")[0]
            t0 = time.monotonic()
            try:
                result = run_layout(layout, shape, args.steps, {**more, **extra}, timeout=900)
                if name == "plain":
                    results["plain"].append(result.pop("plain"))
                    results.setdefault("one", []).append(result)
                else:
                    results[name].append(result)
            except RankFailure as exc:  # a layout meshloom refuses (ConfigError before any collective)
                if "ConfigError" not in str(exc):
                    raise
                refused[name] = str(exc).split("ConfigError: ")[-1].strip().splitlines()[-1]
            print(f"  round {round_ + 1}: {name:<18} {time.monotonic() - t0:5.0f} s", flush=True)
    runs = [(name, more) for name, more in runs if name not in refused]
    print_table(results, runs, shape, args)
    for name, message in refused.items():
        print(f"{name}: refused by meshloom: {message}")
    print(f"total {time.monotonic() - started:.0f} s")


def layout_rate(rounds: list[dict], tokens: int, warmup: int) -> tuple[float, float | None, list[float]]:
    """(median full-loop tokens/s over rounds, median window tokens/s or None, per-round full tokens/s)."""
    per_round = [tokens / median_after(r["full_s"], warmup) for r in rounds]
    windows = [median_after(r["window_tokens_per_s"], warmup) for r in rounds if r["window_tokens_per_s"]]
    return statistics.median(per_round), (statistics.median(windows) if windows else None), per_round


def print_table(results: dict, runs: list, shape: dict, args) -> None:
    from models.flops import flops_per_token
    from runtime.config import load_config, model_args

    tokens = shape["training.global_batch"] * shape["training.seq_len"]
    rates = {name: layout_rate(results[name], tokens, args.warmup) for name, _ in runs}
    print(
        f"\nmodel dim {shape['model.dim']}, {shape['model.n_layers']} layers, seq {shape['training.seq_len']}, "
        f"{shape['training.global_batch']} sequences/step; {args.rounds} rounds x {args.steps} steps, median over "
        f"steps > {args.warmup}; full = step start to next step start, window = metrics.jsonl's window_tokens_per_s; "
        "CPU s = CPU time of rank 0's process per step"
    )
    header = f"{'layout':<18} {'ranks':>5} {'tok/s full':>10} {'window':>8} {'vs':>10} {'ratio':>6}  per round"
    header += f"      {'CPU s':>6} {'TFLOP/s/dev':>11}" + ("   MFU" if args.peak_tflops else "")
    print(header)
    for name, _ in runs:
        layout = name.split("+")[0]
        ranks, config, _ = LAYOUTS[layout]
        full, window, per_round = rates[name]
        base = BASELINE.get(layout, "one-ac") if layout != "plain" else ""
        if name.endswith("+compile"):
            base = layout  # compile's speedup: the same layout, eager
        ratio, per = "", ""
        if base in rates and base != name:
            ratio = f"{full / rates[base][0]:6.3f}"
            per = " ".join(f"{a / b:.3f}" for a, b in zip(per_round, rates[base][2], strict=False))
        cfg = load_config(path=config, overrides={**(MOE_SHAPE if config == MOE else shape)})
        tflops = flops_per_token(model_args(cfg), shape["training.seq_len"]) * full / ranks / 1e12
        shown = f"{window:8,.0f}" if window else f"{'':>8}"
        cpu = statistics.median(median_after(r["cpu_s"], args.warmup) for r in results[name])
        line = f"{name:<18} {ranks:>5} {full:10,.0f} {shown} {base if ratio else '':>10} {ratio:>6}  {per:<14}"
        line += f" {cpu:6.2f} {tflops:11.4f}" + (f" {tflops / args.peak_tflops:6.1%}" if args.peak_tflops else "")
        print(line)
    if "plain" in results and "one" in results:
        diffs = [
            max(abs(a - b) / abs(b) for a, b in zip(m["loss"], p["loss"], strict=True))
            for m, p in zip(results["one"], results["plain"], strict=True)
        ]
        # Paired: meshloom's step k against the plain step k that ran right after it, in the same process.
        for clock_name, key in (("wall-clock", "full_s"), ("CPU", "cpu_s")):
            ratios = [
                [a / b for a, b in zip(m[key][args.warmup :], p[key][args.warmup :], strict=False)]
                for m, p in zip(results["one"], results["plain"], strict=True)
            ]
            overall = statistics.median(r for per in ratios for r in per) - 1
            print(
                f"meshloom's 1-process overhead against the plain loop, {clock_name} time per step, median over "
                f"{sum(map(len, ratios))} step pairs: {overall:+.1%} (per round: "
                f"{', '.join(f'{statistics.median(per) - 1:+.1%}' for per in ratios)})"
            )
        print(f"same losses in both loops: max relative difference {max(diffs):.1e}")


if __name__ == "__main__":
    main()
