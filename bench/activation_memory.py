"""Activation memory of one TransformerBlock per rank, under TP and SP, next to the formula derived from the code.

    .venv/bin/python -m bench.activation_memory        # from the repository root: TP and SP layouts
    .venv/bin/python -m bench.activation_memory --ac   # one process, each training.activation_checkpoint mode

The measurements, and what they count and why: measure/activation_memory.py (what autograd saves, by layout)
and measure/saved_bytes.py: ``kept_bytes`` (what a block keeps alive under activation checkpointing, where
selective checkpointing keeps outputs in its own cache, out of autograd's hooks). This file prints them.
"""

from __future__ import annotations

import sys

import torch

from measure.activation_memory import (
    BATCH,
    BENCH_ARGS,
    SEQ,
    formula_bytes,
    korthikanti_bytes,
    measure_block,
    table,
)
from measure.saved_bytes import kept_bytes
from mesh.ac_policies import POLICIES


def main_ac() -> None:
    """``--ac``: the bytes one block keeps from forward for backward under each activation checkpointing mode."""
    a = BENCH_ARGS
    bsh = 4 * BATCH * SEQ * a.dim
    print(
        f"one TransformerBlock, fp32, CPU: b={BATCH} s={SEQ} h={a.dim} H={a.hidden_dim} heads={a.n_heads}; "
        f"4·bsh = {bsh:,} bytes"
    )
    print(f"{'training.activation_checkpoint':<31} {'bytes kept':>11} {'/ 4·bsh':>8} {'/ none':>7}")
    none = None
    for mode in POLICIES:  # mesh/ac_policies.py: none, full, selective (per-op), selective_keep_mm
        kept = kept_bytes(a, BATCH, SEQ, mode)
        none = none or kept
        print(f"{mode:<31} {kept:>11,} {kept / bsh:>8.2f} {kept / none:>7.3f}")


def main() -> None:
    if "--ac" in sys.argv[1:]:
        main_ac()
        return
    args = BENCH_ARGS
    b, s, h, hidden, a = BATCH, SEQ, args.dim, args.hidden_dim, args.n_heads
    rows = table()
    one = rows[0]["bytes"]
    g = args.n_kv_heads * args.head_dim
    print(
        f"one TransformerBlock forward, fp32: b={b} s={s} h={h} g={g} H={hidden} heads={a} "
        f"kv_heads={args.n_kv_heads}; bsh = {b * s * h:,} elements = {4 * b * s * h:,} bytes"
    )
    print("bytes autograd saves per rank (parameters and buffers excluded)")
    print(f"{'layout':<13} {'measured':>11} {'/ 1 proc':>9} {'formula':>11} {'meas/form':>10} {'all / t':>8}")
    for r in rows:
        print(
            f"{r['layout']:<13} {r['bytes']:>11,} {r['bytes'] / one:>9.4f} {r['formula']:>11,.0f} "
            f"{r['bytes'] / r['formula']:>10.4f} {1 / r['tp']:>8.4f}"
        )
    bf16 = measure_block(args, b, s, dtype=torch.bfloat16)["bytes"]
    paper = korthikanti_bytes(args, b, s)
    print(
        f"one process, bf16: measured {bf16:,}, formula {formula_bytes(args, b, s, dtype_bytes=2):,.0f}, "
        f"Korthikanti's count for these kernels 2(6bsh + 2bsg + 4bsH) = {paper:,.0f}: {bf16 / paper:.4f}"
    )
    from planning.presets import PRESETS

    llama8b = PRESETS["llama3-8b"]
    print(
        f"Llama-3-8B shape, s=8192, bf16, per layer: formula {formula_bytes(llama8b, 1, 8192, dtype_bytes=2) / 1e9:.3f} GB, "
        f"Korthikanti for these kernels {korthikanti_bytes(llama8b, 1, 8192) / 1e9:.3f} GB, "
        f"the paper's 34sbh for a GPT block {34 * 8192 * 4096 / 1e9:.3f} GB"
    )
    print("formula, in elements (x 4 bytes):")
    print("  one process  6bsh + 2bsg + 4bsH + 2bs + abs")
    print("  TP, no SP    4bsh + 2bs + (2bsh + 2bsg + 4bsH + abs)/t")
    print("  TP + SP      2bsh + (4bsh + 2bsg + 4bsH + 2bs + abs)/t")
    print("  TP + SP, rg  (6bsh + 2bsg + 4bsH + 2bs + abs)/t   (parallel.sp_regather: the gathered inputs as shards)")
    print(
        "'all / t': Megatron-LM's SP (and SP+rg), which keeps the sharded, not the gathered, input of the first matmuls"
    )
    for r in rows:
        counts: dict[tuple, int] = {}
        for shape in r["shapes"]:
            counts[shape] = counts.get(shape, 0) + 1
        listing = ", ".join(f"{n} x {tuple(shape)}" if n > 1 else str(tuple(shape)) for shape, n in counts.items())
        print(f"saved on rank 0, {r['layout']}: {listing}")


if __name__ == "__main__":
    main()
