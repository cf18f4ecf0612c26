"""What ``parallel.grad_sync = step`` costs in memory: the gradients a rank holds between micro-batches.

    .venv/bin/python -m bench.grad_sync_memory        # from the repository root, about a minute

The measurement, and what it counts and why: measure/grad_sync_memory.py. This file prints it.
"""

from __future__ import annotations

from measure.grad_sync_memory import table


def main() -> None:
    rows = table()
    psi = rows[0]["psi"]
    print(f"debug model, Ψ = {psi:,}, fp32: gradient bytes a rank holds after a micro-batch's backward")
    print(f"{'layout':<12} {'microbatch':>11} {'step':>11} {'step / 4Ψ':>10}   (4Ψ = {4 * psi:,}; 4Ψ/dp_shard below)")
    for r in rows:
        print(
            f"{r['layout']:<12} {r['microbatch']:>11,} {r['step']:>11,} {r['step'] / (4 * psi):>10.3f}"
            f"   4Ψ/dp_shard = {4 * psi // r['dp_shard']:,}"
        )


if __name__ == "__main__":
    main()
