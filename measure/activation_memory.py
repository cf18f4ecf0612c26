"""Activation memory of one TransformerBlock per rank, under TP and SP, next to the formula derived from the code.

    .venv/bin/python -m measure.activation_memory        # from the repository root

"Activation memory" here is what autograd keeps from a block's forward for its backward. It is measured,
not estimated: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an op saves, and
``SavedBytes`` (measure/saved_bytes.py) adds up their storages:

- a tensor saved several times, or through views of one storage, counts once (keyed by the storage's
  data_ptr) and with its whole storage, since that is what stays alive;
- a DTensor counts by its local tensor (this rank's bytes);
- parameters and buffers (weights saved for the input gradient, the rotary tables) are model state, not
  activations: their storages are left out.

Layouts: one process, tp=2 without SP, tp=2 and tp=4 with SP, each also with ``parallel.sp_regather``. The block is built as the TP tests build
it (meta ``Transformer`` -> ``apply_tensor_parallel`` -> ``materialize_weights``); its input is this rank's
(b, s/tp, h) sequence shard with SP and the full (b, s, h) without.

The formula (``formula_bytes``, computed by planning/memory_estimate.py) lists what models/llama.py's block saves,
in elements, for batch b, sequence s, model dim h, SwiGLU hidden size H and a query heads, on the SDPA path that CPU takes for fp32 causal
attention (``_scaled_dot_product_flash_attention_for_cpu``, which keeps a logsumexp, not the s x s scores):

    each RMSNorm            x (bsh), rsqrt(mean x^2) (bs, fp32)                             x 2 norms
    wq/wk/wv (shared) input norm output (bsh)                  <- gathered in full under SP
    SDPA                    q after rotary (bsh), k and v after rotary at their own kv heads (2 bsg, with
                            g = n_kv_heads x head_dim: SDPA's enable_gqa, no repeated copies), output (bsh;
                            wo's input is a view of it), logsumexp (abs)
    w1/w3 (shared) input    norm output (bsh)                  <- gathered in full under SP
    SwiGLU                  w1 out (bsH), silu(w1 out) (bsH), w3 out (bsH), product = w2 input (bsH)

    one process:   6 bsh + 2 bsg + 4 bsH + 2 bs + abs
    TP, no SP:     4 bsh + 2 bs + (2 bsh + 2 bsg + 4 bsH + abs) / t          norms and residual replicated
    TP + SP:       2 bsh + (4 bsh + 2 bsg + 4 bsH + 2 bs + abs) / t          only the two gathered inputs replicated
    TP + SP, rg:   (6 bsh + 2 bsg + 4 bsH + 2 bs + abs) / t                  all / t

times 4 bytes in fp32 (the bs terms are fp32 in any dtype: the norms' rsqrt, attention's log-sum-exp). The
norms keep their input and the rsqrt only (models/llama.py: ``_RMSNormFunction``, which recomputes x * rsqrt in
backward); composed of plain ops they kept an fp32 copy of the input and x * rsqrt besides (8 bsh then).

**bf16 against Korthikanti et al.** (``korthikanti_bytes``): the paper counts, per layer in 16 bits, every tensor
a GPT block saves, 34 sbh bytes with flash attention. Its count for *this* block's kernels (RMSNorm, GQA,
fused attention, SwiGLU, no dropout) keeps each norm's input, the inputs of wq/wk/wv and w1/w3, q, k and v,
attention's output, and SwiGLU's four hidden tensors: 2 (6 bsh + 2 bsg + 4 bsH) bytes. The bench measures
one block in bf16 beside it; what remains is fp32 bookkeeping (the rsqrt and the log-sum-exp, 2 bs + abs
elements of 4 bytes). 34 sbh itself is for a GPT block: a 4h GeLU MLP (19 sbh with its dropout mask) where
Llama's SwiGLU keeps four tensors of H = 3.5h (28 sbh at the 8B shape), k and v at full width, and dropout masks. DTensor's ColwiseParallel saves the all-gathered input it multiplied, so with plain SP
2 bsh stays. Megatron-LM's sequence parallelism keeps the *sharded* input of the first column-parallel matmul
and all-gathers it again in backward, so there everything is divided by t (the "all / t" column);
``parallel.sp_regather`` does the same here (mesh/sequence_parallel.GatherSavingShard), at the price of one more
all-gather per sub-layer in backward.
"""

from __future__ import annotations

import argparse

import torch

from measure.saved_bytes import SavedBytes, kept_bytes, storage_ptr
from mesh.ac_policies import POLICIES
from models.llama import ModelArgs

# Big enough that the (b, s, h) terms dominate the small ones: 2 x 256 tokens of width 256.
BENCH_ARGS = ModelArgs(dim=256, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=64)
BATCH, SEQ = 2, 256
LAYOUTS = (
    ("one process", 1, False, False),
    ("tp=2, no SP", 2, False, False),
    ("tp=2, SP", 2, True, False),
    ("tp=2, SP+rg", 2, True, True),  # parallel.sp_regather
    ("tp=4, SP", 4, True, False),
    ("tp=4, SP+rg", 4, True, True),
)


def measure_block(
    args: ModelArgs,
    batch: int,
    seq: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    regather: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Bytes autograd saves in one block's forward on this rank (tp > 1: inside a process group of tp ranks)."""
    from mesh.materialize import materialize_weights
    from models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from mesh.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(
            model,
            init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",)),
            sequence_parallel=sequence_parallel,
            regather=regather,
        )
    materialize_weights(model, torch.device("cpu"), seed=0)
    block = model.layers["0"].to(dtype)
    local_seq = seq // tp if sequence_parallel else seq  # with SP the block receives this rank's sequence shard
    # The block's input comes from the previous layer, so it requires grad like any activation.
    x = torch.randn(batch, local_seq, args.dim, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    state = {storage_ptr(t) for t in (*model.parameters(), *model.buffers())}
    with SavedBytes(exclude=state) as saved:
        out = block(x, model.rope_cos, model.rope_sin)
    out.sum().backward()  # the saved tensors really were enough for backward
    return {"bytes": saved.total, "shapes": [shape for shape, _ in saved.storages.values()]}


def measure_on_ranks(args: ModelArgs, batch: int, seq: int, sequence_parallel: bool, regather: bool = False) -> dict:
    """Rank body: ``measure_block`` with tp = the world size."""
    import torch.distributed as dist

    return measure_block(args, batch, seq, dist.get_world_size(), sequence_parallel, regather)


def formula_bytes(
    args: ModelArgs,
    batch: int,
    seq: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: int = 4,
    regather: bool = False,
) -> float:
    """The formula of the module docstring, in bytes: planning/memory_estimate.py's count for one block without
    activation checkpointing (the library the layout planner and the memory checks use). ``regather``
    (``parallel.sp_regather``, with SP): the gathered inputs are saved as their sequence shards."""
    from planning.layout import Layout
    from planning.memory_estimate import layer_activation_bytes

    layout = Layout(
        tp=tp,
        seq_len=seq,
        sequences_per_microbatch=batch,
        mixed_precision="fp32" if dtype_bytes == 4 else "bf16",
        sequence_parallel=sequence_parallel,
        sp_regather=regather,
    )
    return layer_activation_bytes(args, 0, layout, "none")


def korthikanti_bytes(args: ModelArgs, batch: int, seq: int, dtype_bytes: int = 2) -> float:
    """Korthikanti et al.'s per-layer count (every saved tensor once, in the compute dtype) for this block's
    kernels: the norms' inputs, the inputs of wq/wk/wv and w1/w3, q, k, v, attention's output, SwiGLU's four
    hidden tensors (module docstring)."""
    n, h, g = batch * seq, args.dim, args.n_kv_heads * args.head_dim
    return dtype_bytes * (6 * n * h + 2 * n * g + 4 * n * args.hidden_dim)


def table(args: ModelArgs = BENCH_ARGS, batch: int = BATCH, seq: int = SEQ, layouts=LAYOUTS) -> list[dict]:
    from launch.spawn import run_on_ranks

    rows = []
    for name, tp, sp, rg in layouts:
        if tp == 1:
            result = measure_block(args, batch, seq)
        else:
            per_rank = run_on_ranks(measure_on_ranks, tp, args, batch, seq, sp, rg, timeout=300)
            assert all(r["bytes"] == per_rank[0]["bytes"] for r in per_rank), "ranks saved different amounts"
            result = per_rank[0]
        formula = formula_bytes(args, batch, seq, tp, sp, regather=rg)
        rows.append({"layout": name, "tp": tp, "sp": sp, "regather": rg, **result, "formula": formula})
    return rows


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


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_input_walk.py walks every tool's parser)."""
    parser = argparse.ArgumentParser(prog="python -m measure.activation_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--ac", action="store_true", help="the activation-checkpointing policies' table instead")
    return parser


def main(argv: list[str] | None = None) -> None:
    if build_parser().parse_args(argv).ac:
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
    from models.presets import PRESETS

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
