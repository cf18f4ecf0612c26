"""Why one device is not enough: training-state bytes per parameter, and per rank under ZeRO / FSDP.

    python -m measure.memory_table

Mixed-precision training with Adam keeps, per parameter (Ψ parameters in all):
  2Ψ   bf16 parameters (what forward and backward compute with)
  2Ψ   bf16 gradients
  KΨ   fp32 optimizer state, K = 12: master weights (4) + Adam m (4) + Adam v (4)
That is 16 bytes per parameter before a single activation is stored. Sharding over dp data-parallel ranks:
  ZeRO-1       shards the optimizer state:          2Ψ + 2Ψ + KΨ/dp
  ZeRO-2       also shards the gradients:           2Ψ + (2Ψ + KΨ)/dp
  ZeRO-3/FSDP  also shards the parameters:          (2Ψ + 2Ψ + KΨ)/dp
"""

from __future__ import annotations

import argparse

from models.presets import PRESETS

K = 12  # fp32 master weights + Adam m + Adam v, 4 bytes each
DP_SIZES = (8, 64, 512)
GB = 1e9  # decimal gigabytes, as in the usual "175B x 4 bytes = 700 GB"
MODELS = ("llama3-1b", "llama3-8b", "llama3-70b")  # the presets docs/data_parallel.md section 1 tabulates


def bytes_per_rank(psi: int, n: int = 1) -> dict[str, float]:
    """Bytes one rank holds for Ψ = ``psi`` parameters on ``n`` data-parallel ranks."""
    params, grads, optim = 2 * psi, 2 * psi, K * psi
    return {
        "fp32 weights": 4 * psi,
        "full state": params + grads + optim,
        "ZeRO-1": params + grads + optim / n,
        "ZeRO-2": params + (grads + optim) / n,
        "ZeRO-3/FSDP": (params + grads + optim) / n,
    }


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.memory_table", description=__doc__.splitlines()[0])


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
    build_parser().parse_args()
    main()
