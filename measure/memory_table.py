"""Why one device is not enough: training-state bytes per parameter, and per rank under ZeRO / FSDP.

    python -m bench.memory_table

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
