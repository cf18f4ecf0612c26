"""Ring attention through fused kernels, measured: peak memory per rank against the local sequence, and time.

    python -m bench.ring_attention                  # CPU: 2 gloo ranks, local lengths 512 .. 4096 (~1 min)
    python -m bench.ring_attention --device cuda --dtype bf16 --cp 1 --lengths 16384     # one GPU

The measurement, and what it counts and why: measure/ring_attention.py. This file prints it.
"""

from __future__ import annotations

import argparse
import json

from measure.ring_attention import BATCH, DTYPES, HEAD_DIM, HEADS, KV_HEADS, measure


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.ring_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="ranks in the ring (CPU: spawned gloo ranks)")
    parser.add_argument(
        "--lengths", default="512,1024,2048,4096", help="local tokens per rank (s_cp = s/cp), comma-separated"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    result = measure(lengths, args.device, args.dtype, args.cp, args.repeats)
    rows = result["rows"]
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print(
        f"ring attention forward + backward on each of {args.cp} rank(s), {args.device} {args.dtype}: batch {BATCH}, "
        f"{HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}; peak bytes alive during the call, busiest rank"
    )
    print(
        f"{'s_cp':>8} {'ring bytes':>13} {'bytes/s_cp':>11} {'x prev':>7} {'SDPA bytes':>13} {'ring/SDPA':>9} "
        f"{'s_cp² fp32 scores':>18} {'ring s':>8} {'SDPA s':>8}"
    )
    for row in rows:
        prev = f"{row['ring_vs_prev']:7.2f}" if row["ring_vs_prev"] else f"{'':>7}"
        print(
            f"{row['s_cp']:>8} {row['ring_bytes']:>13,} {row['ring_bytes_per_token']:>11,.0f} {prev} "
            f"{row['sdpa_bytes']:>13,} {row['ring_vs_sdpa']:>9.2f} {row['score_bytes']:>18,} "
            f"{row['ring_s']:>8.3f} {row['sdpa_s']:>8.3f}"
        )
    first, last = rows[0], rows[-1]
    growth = last["s_cp"] / first["s_cp"]
    print(
        f"s_cp grew {growth:.0f}x: ring bytes {last['ring_bytes'] / first['ring_bytes']:.2f}x (linear: {growth:.0f}x), "
        f"one score tensor {last['score_bytes'] / first['score_bytes']:.0f}x"
    )
    return result


if __name__ == "__main__":
    main()
