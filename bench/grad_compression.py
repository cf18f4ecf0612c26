"""Gradient compression measured: bytes per step and the loss gap to exact reduction.

    .venv/bin/python -m bench.grad_compression               # 300 steps x 4 variants, a few minutes
    .venv/bin/python -m bench.grad_compression --steps 100   # quicker
    .venv/bin/python -m bench.grad_compression --links       # the bandwidth arithmetic only (no training)

The measurement, and what it counts and why: measure/grad_compression.py. This file prints it.
"""

from __future__ import annotations

import argparse

from measure.grad_compression import (
    VARIANTS,
    link_table,
    print_table,
    run_variants,
    summarize,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--links", action="store_true", help="print the bandwidth arithmetic only")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, among: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    if args.links:
        link_table()
        return
    names = ["exact", *(n.strip() for n in args.variants.split(",") if n.strip() != "exact")]  # exact: the baseline
    print_table(summarize(run_variants(args.steps, {n: VARIANTS[n] for n in names})), args.steps)


if __name__ == "__main__":
    main()
