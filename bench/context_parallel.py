"""Context parallelism, measured: activation memory per rank against cp, and the bytes each algorithm sends.

    .venv/bin/python -m bench.context_parallel        # from the repository root (10-45 s on 2 cores)

The measurement, and what it counts and why: measure/context_parallel.py. This file prints it.
"""

from __future__ import annotations

from measure.context_parallel import (
    BATCH,
    BENCH_ARGS,
    SEQ,
    comm_table,
    memory_table,
)


def main() -> None:
    args, b, s = BENCH_ARGS, BATCH, SEQ
    print(
        f"one TransformerBlock, fp32: b={b} s={s} h={args.dim} H={args.hidden_dim} heads={args.n_heads} "
        f"kv_heads={args.n_kv_heads}"
    )
    print("1. activation bytes autograd saves per rank (largest rank; parameters and buffers excluded)")
    print(
        f"{'cp':>3} {'algorithm':<10} {'measured':>12} {'/ cp=1':>7} {'formula':>12} {'meas/form':>10} {'ranks differ by':>16}"
    )
    rows = memory_table()
    one = rows[0]["bytes"][0]
    for r in rows:
        worst = max(r["bytes"])
        formula = r["formula"][r["bytes"].index(worst)]
        print(
            f"{r['cp']:>3} {r['algorithm']:<10} {worst:>12,} {worst / one:>7.3f} {formula:>12,} {worst / formula:>10.4f} "
            f"{max(r['bytes']) - min(r['bytes']):>16,}"
        )
    print("2. bytes sent per layer and rank, forward + backward (fp32)")
    print(f"{'cp':>3} {'algorithm':<10} {'ops issued':<52} {'measured':>11} {'formula':>11}")
    for r in comm_table():
        ops = ", ".join(f"{n} x {op}" for op, n in r["ops"].items())
        print(f"{r['cp']:>3} {r['algorithm']:<10} {ops:<52} {r['bytes']:>11,} {r['formula']:>11,}")
    print("formulas: bench/context_parallel.py's docstring and docs/context_parallel.md, section 6")


if __name__ == "__main__":
    main()
