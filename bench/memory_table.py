"""Why one device is not enough: training-state bytes per parameter, and per rank under ZeRO / FSDP.

    python -m bench.memory_table

The measurement, and what it counts and why: measure/memory_table.py. This file prints it.
"""

from __future__ import annotations

from measure.memory_table import DP_SIZES, GB, MODELS, K, bytes_per_rank
from planning.presets import PRESETS


def main() -> None:
    print(f"bytes per parameter, bf16 + Adam: 2 + 2 + {K} = {bytes_per_rank(1)['full state']:.0f}")
    gpt3 = bytes_per_rank(175_000_000_000)
    print(
        f"175B parameters: fp32 weights alone {gpt3['fp32 weights'] / GB:,.0f} GB, "
        f"16 B/param training state {gpt3['full state'] / GB:,.0f} GB\n"
    )

    print(f"{'model':<11} {'Ψ':>8} {'fp32 weights':>13} {'16 B/param':>11}")
    for name, args in ((n, PRESETS[n]) for n in MODELS):
        psi = args.num_params()
        one = bytes_per_rank(psi)
        print(f"{name:<11} {psi / 1e9:>7.2f}B {one['fp32 weights'] / GB:>10.1f} GB {one['full state'] / GB:>8.1f} GB")

    print(
        f"\nGB per rank on dp data-parallel ranks\n{'model':<11} {'dp':>4} {'ZeRO-1':>8} {'ZeRO-2':>8} {'ZeRO-3/FSDP':>12}"
    )
    for name, args in ((n, PRESETS[n]) for n in MODELS):
        for n in DP_SIZES:
            b = bytes_per_rank(args.num_params(), n)
            print(f"{name:<11} {n:>4} {b['ZeRO-1'] / GB:>8.1f} {b['ZeRO-2'] / GB:>8.1f} {b['ZeRO-3/FSDP'] / GB:>12.2f}")


if __name__ == "__main__":
    main()
