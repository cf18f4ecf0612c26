"""What each rank really holds under FSDP2, next to the ZeRO-3 formula (4Ψ + 4Ψ + 8Ψ) / dp for fp32 training.

    .venv/bin/python -m bench.fsdp_memory        # from the repository root

The measurement, and what it counts and why: measure/fsdp_memory.py. This file prints it.
"""

from __future__ import annotations

from measure.fsdp_memory import table


def main() -> None:
    rows = table()
    psi = rows[0]["psi"]
    print(
        f"debug model: Ψ = {psi:,} parameters; fp32 training, FSDP2 over dp ranks (dp_shard = dp); bytes on the largest rank"
    )
    print(
        f"{'dp':>2} {'params':>10} {'grads':>10} {'Adam m+v':>10} {'total':>11} {'(4+4+8)Ψ/dp':>12} {'ratio':>7} {'steps':>6}"
    )
    for r in rows:
        print(
            f"{r['n']:>2} {r['params']:>10,} {r['grads']:>10,} {r['optim']:>10,} {r['total']:>11,} "
            f"{r['formula']:>12,.0f} {r['ratio']:>7.4f} {r['step_counters']:>6}"
        )
    print("steps: AdamW's fp32 step counters (4 bytes per parameter tensor, not sharded), not in the total.")


if __name__ == "__main__":
    main()
