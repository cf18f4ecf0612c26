"""MoE experts as one grouped matmul against a Python loop over experts: throughput and host syncs.

    python -m bench.moe_grouped_mm                     # CPU, fp32 and bf16 (~30 s on one core)
    python -m bench.moe_grouped_mm --device cuda --dtypes bf16 --tokens 65536 --dim 2048 --hidden 1408

The measurement, and what it counts and why: measure/moe_grouped_mm.py. This file prints it.
"""

from __future__ import annotations

import argparse
import json

import torch

from measure.moe_grouped_mm import DTYPES, measure


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_grouped_mm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--tokens", type=int, default=4096, help="routed rows (tokens x top-k) on this device")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.device == "cpu":
        torch.set_num_threads(1)  # one core, as each training rank here runs
    device = torch.device(args.device)
    rows = [
        measure(device, DTYPES[d], args.tokens, args.experts, args.dim, args.hidden, args.rounds)
        for d in args.dtypes.split(",")
    ]
    shape = {"tokens": args.tokens, "experts": args.experts, "dim": args.dim, "hidden": args.hidden}
    result = {"device": args.device, "shape": shape, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print(
        f"MoE experts (SwiGLU) forward + backward on {args.device}: {args.tokens} rows, {args.experts} experts, "
        f"dim {args.dim}, hidden {args.hidden}; median of {args.rounds} alternating rounds"
    )
    print(f"{'dtype':<9} {'path':<8} {'ms':>9} {'rows/s':>11} {'host syncs':>11}")
    for row in rows:
        for name in ("looped", "grouped"):
            if f"{name}_s" in row:
                print(
                    f"{row['dtype']:<9} {name:<8} {row[f'{name}_s'] * 1e3:9.1f} {row[f'{name}_rows_per_s']:11,.0f} "
                    f"{row[f'{name}_host_syncs']:11d}"
                )
        if row["grouped_mm_runs"]:
            print(
                f"{row['dtype']:<9} grouped is {row['grouped_speedup']:.2f}x the loop's speed; largest difference "
                f"{row['max_rel_diff']:.1e} of the tensor's largest value"
            )
        else:
            print(f"{row['dtype']:<9} torch._grouped_mm does not run here: the loop only")
    return result


if __name__ == "__main__":
    main()
