"""Plan a layout: the least model parallelism (tp x pp) that fits a dense Llama in GPU memory and in the batch.

    .venv/bin/python -m bench.plan_layout [--gpus 8,64,512] [--gpu-mem-gb 80] [--seq-len 8192]
                                          [--global-batch-tokens 4e6] [--commands] [--model dense-1t]
    .venv/bin/python -m bench.plan_layout --ac     # measure what activation checkpointing keeps (CPU, seconds)
    .venv/bin/python -m bench.plan_layout --model dense-1t --gpus 512 --time   # a time model per layout

Everything but --ac is arithmetic. Per GPU, in bytes, for Ψ parameters, L layers, width h, vocabulary V,
sequence length s, one sequence per micro-batch, and the worst pipeline stage:

1. states      16Ψ/(tp·pp·dp): bf16 params 2 + bf16 grads 2 + fp32 master weights and Adam m, v 12 bytes per
               parameter; TP and PP cut the model, FSDP (ZeRO-3) over dp shards what each of them holds.
2. weights     bf16 copies FSDP gathers for compute. pp = 1: two blocks (the current one, the prefetched
               next) and the root unit (embedding, head), which stays gathered: 2·(2·Ψ_layer + 2Vh)/tp. pp > 1:
               torch's pipeline runtime keeps a stage's units gathered and accumulates its unsharded gradients
               in fp32 until the step's last backward (torch/distributed/pipelining/stage.py:
               backward_maybe_with_nosync; mesh/data_parallel.py: reshard_after_forward_policy): 6Ψ/(tp·pp).
3. activations Korthikanti et al. (2022), bf16, with sequence parallelism (everything / tp) and flash attention
               (their 5·a·s/h term, the s x s scores, is gone): 34·s·h/tp per layer and micro-batch. With full
               activation checkpointing a layer keeps only its input, 2·s·h/tp, and backward rebuilds one layer
               at a time: + 34·s·h/tp. A stage has L/pp layers; under 1F1B the first stage holds min(pp, m)
               micro-batches, the last holds one, plus the logits below.
4. logits      12·s·V/tp on the last stage: bf16 logits, their fp32 copy and log-softmax (training/loss.py:
               token_loss_sum), and fp32 gradients when backward starts; vocab-sharded by loss_parallel.

Batch, in sequences: B = global_batch_tokens / s, a cap set by convergence, split as micro-batch (1 sequence)
x dp x accumulation: every dp rank takes m = floor(B/dp) micro-batches per step, so dp <= B. A pipeline
needs m >= pp (1F1B), and its bubble (pp-1)/(m+pp-1) is under 20% exactly when m > 4(pp-1), i.e.
m >= 4·pp - 3: dp x (4·pp - 3) sequences is then a floor on the global batch. DP and PP consume batch; TP does
not (its ranks share the same tokens).

FSDP traffic per GPU per step (ring, over dp): pp = 1 all-gathers bf16 weights for forward and again for
backward and reduce-scatters fp32 gradients on every micro-batch, 8Ψ/tp·m·(dp-1)/dp; pp > 1 does it once
per step, 6Ψ/(tp·pp)·(dp-1)/dp. Printed for comparison; the choice below looks at memory only.

Choice: tp in {1, 2, 4, 8} (inside an 8-GPU node, dividing heads, kv heads, FFN, vocabulary and s), pp a
divisor of L, dp = GPUs/(tp·pp). Candidates in order of tp·pp, larger tp first on ties; each without AC,
then with full AC; the first that fits memory and batch wins. Not modelled: time (communication, the
bubble's cost, recomputation's +1 forward), fragmentation, NCCL buffers, the CUDA context, optimizer-step
temporaries. GB = 1e9 bytes, as in bench/memory_table.py.
"""

from __future__ import annotations

import argparse
import gc

import torch

from models.llama import PRESETS, ModelArgs

GPUS_PER_NODE = 8
TP_DEGREES = (1, 2, 4, 8)
ACT_BYTES_PER_SH = 34  # Korthikanti et al., per layer without the attention-score term
AC_BYTES_PER_SH = 2  # full checkpointing: the layer's bf16 input
LOGIT_BYTES = 12  # per (token, vocabulary entry) around the loss, see the docstring
GB = 1e9
_V = dict(n_kv_heads=8, vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)
MODELS: dict[str, ModelArgs] = {
    "llama3-8b": PRESETS["llama3-8b"],
    "dense-10b": ModelArgs(dim=5120, n_layers=32, n_heads=40, ffn_dim=14336, **_V),
    "llama3-70b": PRESETS["llama3-70b"],
    "dense-100b": ModelArgs(dim=10240, n_layers=72, n_heads=80, ffn_dim=36864, **_V),
    "dense-1t": ModelArgs(dim=25600, n_layers=128, n_heads=160, ffn_dim=90112, **_V),
}


def states_bytes(psi: int, tp: int, pp: int, dp: int) -> float:
    """Term 1: bf16 params + grads, fp32 master weights + Adam m, v, split by TP and PP, FSDP over dp."""
    return 16 * psi / (tp * pp * dp)


def candidates(args: ModelArgs, gpus: int, seq_len: int):
    """(tp, pp, dp) in the order the planner tries them: tp·pp ascending, larger tp first."""
    sizes = (args.n_heads, args.n_kv_heads, args.hidden_dim, args.vocab_size, seq_len)
    tps = [t for t in TP_DEGREES if t <= min(GPUS_PER_NODE, gpus) and not any(x % t for x in sizes)]
    pps = [p for p in range(1, args.n_layers + 1) if args.n_layers % p == 0]
    found = [(t, p, gpus // (t * p)) for t in tps for p in pps if gpus % (t * p) == 0]
    return sorted(found, key=lambda c: (c[0] * c[1], -c[0]))


def estimate(args: ModelArgs, tp: int, pp: int, dp: int, ac: bool, seq_len: int, batch: int) -> dict:
    """Per-GPU bytes of the worst stage for one layout, and its batch arithmetic (terms 1-4 of the docstring)."""
    psi, h, s, vocab, layers = args.num_params(), args.dim, seq_len, args.vocab_size, args.n_layers
    m = batch // dp  # micro-batches of one sequence per dp rank per step (accumulation, or the pipeline's m)
    layer_params = (psi - 2 * vocab * h - h) / layers
    weights = (6 * psi / pp if pp > 1 else 2 * (2 * layer_params + 2 * vocab * h)) / tp
    fsdp = (6 * psi / (tp * pp) if pp > 1 else 8 * psi / tp * m) * (dp - 1) / dp
    per_layer = (AC_BYTES_PER_SH if ac else ACT_BYTES_PER_SH) * s * h / tp
    rebuild = ACT_BYTES_PER_SH * s * h / tp if ac else 0.0
    logits = LOGIT_BYTES * s * vocab / tp
    first = min(pp, max(m, 1)) * (layers // pp) * per_layer + rebuild + (logits if pp == 1 else 0.0)
    last = (layers // pp) * per_layer + rebuild + logits
    acts = max(first, last)
    states = states_bytes(psi, tp, pp, dp)
    return {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "ac": ac,
        "m": m,
        "global_batch": m * dp,
        "bubble": (pp - 1) / (m + pp - 1) if m else 1.0,
        "batch_ok": m >= 1 and (pp == 1 or m >= pp),
        "fsdp": fsdp,
        "states": states,
        "weights": weights,
        "acts": acts,
        "total": states + weights + acts,
    }


def layouts(args: ModelArgs, gpus: int, seq_len: int, batch: int):
    """Every candidate's estimate in the planner's order: tp·pp ascending, larger tp first, no AC before AC."""
    for tp, pp, dp in candidates(args, gpus, seq_len):
        yield from (estimate(args, tp, pp, dp, ac, seq_len, batch) for ac in (False, True))


def fitting(args: ModelArgs, gpus: int, mem_gb: float, seq_len: int, batch: int):
    return (e for e in layouts(args, gpus, seq_len, batch) if e["batch_ok"] and e["total"] <= mem_gb * GB)


def plan(args: ModelArgs, gpus: int, mem_gb: float, seq_len: int, batch: int) -> dict | None:
    """The first layout that fits in memory and in the batch; None if none does."""
    return next(fitting(args, gpus, mem_gb, seq_len, batch), None)


def why_not(args: ModelArgs, gpus: int, mem_gb: float, seq_len: int, batch: int) -> str:
    if (states := states_bytes(args.num_params(), 1, 1, gpus)) > mem_gb * GB:
        return f"no: 16Ψ/{gpus} = {states / GB:.0f} GB of states alone"
    fits = [e for e in layouts(args, gpus, seq_len, batch) if e["total"] <= mem_gb * GB]
    if fits:
        need = min(e["dp"] * e["pp"] for e in fits)
        return f"no: batch too small; the layouts that fit in memory need >= {need:,} sequences (dp x pp)"
    return "no: activations and gathered weights do not fit, even with tp=8 and full AC"


def command(args: ModelArgs, e: dict, gpus: int, seq_len: int) -> str:
    """The meshloom command line for a planned layout: one torchrun agent per node of 8 GPUs."""
    nodes, rdzv = max(1, gpus // GPUS_PER_NODE), " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500"
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {min(GPUS_PER_NODE, gpus)}" + (rdzv if nodes > 1 else "")
    return " ".join([launch, "train.py", *(f"--{k} {v}" for k, v in overrides(args, e, seq_len))])


def overrides(args: ModelArgs, e: dict, seq_len: int) -> list[tuple[str, str]]:
    """The dotted config overrides of ``command`` (the test feeds them to train.check_config)."""
    pipeline = [("parallel.pp_schedule", "1F1B"), ("parallel.pp_microbatches", e["m"])] if e["pp"] > 1 else []
    pairs = [
        ("model.dim", args.dim),
        ("model.n_layers", args.n_layers),
        ("model.n_heads", args.n_heads),
        ("model.n_kv_heads", args.n_kv_heads),
        ("model.ffn_dim", args.hidden_dim),
        ("model.vocab_size", args.vocab_size),
        ("model.rope_theta", int(args.rope_theta)),
        ("model.max_seq_len", max(seq_len, args.max_seq_len)),
        ("parallel.tp", e["tp"]),
        ("parallel.pp", e["pp"]),
        ("parallel.dp_shard", -1),
        *pipeline,
        ("training.seq_len", seq_len),
        ("training.global_batch", e["global_batch"]),
        ("training.micro_batch", 1 if e["pp"] == 1 else 0),
        ("training.mixed_precision", "bf16"),
        ("training.activation_checkpoint", "full" if e["ac"] else "none"),
    ]
    return [(k, str(v)) for k, v in pairs]


HEADER = (
    f"{'model':<11} {'Ψ':>7} {'GPUs':>5} {'tp':>3} {'pp':>3} {'dp':>5} {'AC':>4} {'batch':>5} {'m':>4} {'bubble':>7}"
    f" {'states':>7} {'weights':>8} {'activ.':>7} {'total GB':>9} {'FSDP GB/step':>13}"
)


def bubble_above_20_percent(e: dict) -> bool:
    """(pp-1)/(m+pp-1) >= 0.2 exactly when m <= 4(pp-1)."""
    return e["pp"] > 1 and e["m"] <= 4 * (e["pp"] - 1)


def row(lead: str, e: dict) -> str:
    low = "*" if bubble_above_20_percent(e) else " "
    return (
        f"{lead} {e['tp']:>3} {e['pp']:>3} {e['dp']:>5} {'full' if e['ac'] else 'none':>4} {e['global_batch']:>5} "
        f"{e['m']:>4} {e['bubble']:>6.1%}{low}{e['states'] / GB:>7.1f} {e['weights'] / GB:>8.1f} "
        f"{e['acts'] / GB:>7.1f} {e['total'] / GB:>9.1f} {e['fsdp'] / GB:>13,.1f}"
    )


def main_plan(gpu_counts, mem_gb: float, seq_len: int, tokens: float, only: str | None, show_commands: bool) -> None:
    batch = int(tokens // seq_len)
    print(f"global batch {tokens:,.0f} tokens / seq_len {seq_len:,} = B = {batch:,} sequences per step (a cap)")
    print("  B >= micro-batch (1 sequence) x dp x accumulation; every dp rank runs m = floor(B/dp) micro-batches")
    print(f"  pipeline bubble (pp-1)/(m+pp-1) < 20% needs m > 4(pp-1): dp x (4·pp-3) <= {batch:,}")
    print(f"GPU memory {mem_gb:g} GB; bf16 + fp32 master weights + Adam, FSDP (ZeRO-3) over dp; 1F1B for pp > 1")
    print("all arithmetic (see the docstring); batch = sequences used per step\n" + HEADER)
    commands = []
    for name, args in MODELS.items():
        if only and name != only:
            continue
        for gpus in gpu_counts:
            lead = f"{name:<11} {args.num_params() / 1e9:>6.1f}B {gpus:>5}"
            if only:  # every layout that fits memory and batch, in the planner's order
                print("\n".join(row(lead, e) for e in fitting(args, gpus, mem_gb, seq_len, batch)))
                continue
            e = plan(args, gpus, mem_gb, seq_len, batch)
            if e is None:
                print(f"{lead}   {why_not(args, gpus, mem_gb, seq_len, batch)}")
                continue
            print(row(lead, e))
            commands.append(f"# {name} on {gpus} GPUs\n{command(args, e, gpus, seq_len)}")
    print("* m <= 4(pp-1): the bubble is 20% or more; a larger global batch (or fewer dp ranks) would shrink it")
    if show_commands:
        print("\n" + "\n".join(commands))


def kept_bytes(args: ModelArgs, batch: int, seq: int, mode: str) -> int:
    """Bytes one block keeps alive from its forward for its backward (fp32, CPU), under AC ``mode``.

    A dispatch mode records a weak reference to the storage of every op output; after forward, the storages
    still alive are what autograd (or the checkpoint) holds. Parameters, buffers and the block's output are
    left out; the block's input is counted (every mode keeps it). This sees what ``saved_tensors_hooks`` cannot:
    selective checkpointing stores the outputs it saves in its own cache, not through autograd's hooks.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from mesh.activation_checkpoint import apply_activation_checkpointing
    from mesh.materialize import materialize_weights
    from models.llama import Transformer

    class Outputs(TorchDispatchMode):  # remembers (weak ref, bytes) of every op output's storage
        refs: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for st in (t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                self.refs.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
            return out

    with torch.device("meta"):
        model = Transformer(args)
    apply_activation_checkpointing(model, mode)
    materialize_weights(model, torch.device("cpu"), seed=0)
    x = torch.randn(batch, seq, args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with Outputs() as rec:
        out = model.layers["0"](x, model.rope_cos, model.rope_sin)
    gc.collect()
    skip = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), out)}
    kept = sum(n for key, (ref, n) in rec.refs.items() if not ref.expired() and key not in skip)
    out.sum().backward()  # what was kept really was enough for backward
    return kept + x.untyped_storage().nbytes()


def main_ac() -> None:
    from bench.activation_memory import BATCH, BENCH_ARGS, SEQ

    a = BENCH_ARGS
    bsh = 4 * BATCH * SEQ * a.dim
    print(
        f"one TransformerBlock, fp32, CPU: b={BATCH} s={SEQ} h={a.dim} H={a.hidden_dim} heads={a.n_heads}; "
        f"4·bsh = {bsh:,} bytes"
    )
    print(f"{'training.activation_checkpoint':<31} {'bytes kept':>11} {'/ 4·bsh':>8} {'/ none':>7}")
    none = None
    for mode in ("none", "selective", "full"):
        kept = kept_bytes(a, BATCH, SEQ, mode)
        none = none or kept
        print(f"{mode:<31} {kept:>11,} {kept / bsh:>8.2f} {kept / none:>7.3f}")


# Time model (arithmetic, docs/combining.md section 7): vendor peak, link bandwidths per GPU and direction.
PEAK_FLOPS = 989e12  # H100 dense bf16
IB_BYTES_S, NVLINK_BYTES_S = 50e9, 450e9  # 400 Gb/s InfiniBand; NVLink 900 GB/s bidirectional


def time_estimate(args: ModelArgs, e: dict, seq_len: int) -> dict:
    """Seconds per step for one layout, each term alone (nothing overlapped): compute at peak (8Ψ FLOP per token
    with full AC, 6Ψ without; attention ignored), FSDP traffic over InfiniBand (tp = 8 fills a node, so dp
    crosses nodes), TP traffic over NVLink (4 collectives per layer and micro-batch forward, 4 backward, 4 more
    in the recomputed forward with AC, each (tp-1)/tp·s·h·2 bytes), PP send/recv over InfiniBand (one s·h·2
    activation each way per micro-batch), and the step stretched by the bubble: compute / (1 - bubble)."""
    psi, h, layers = args.num_params(), args.dim, args.n_layers
    tokens = e["global_batch"] * seq_len
    compute = (8 if e["ac"] else 6) * psi * tokens / (e["tp"] * e["pp"] * e["dp"]) / PEAK_FLOPS
    per_collective = (e["tp"] - 1) / e["tp"] * seq_len * h * 2
    tp_bytes = (12 if e["ac"] else 8) * per_collective * (layers // e["pp"]) * e["m"] if e["tp"] > 1 else 0.0
    pp_bytes = 2 * seq_len * h * 2 * e["m"] if e["pp"] > 1 else 0.0
    return {
        "compute": compute,
        "fsdp_bytes": e["fsdp"],
        "fsdp": e["fsdp"] / IB_BYTES_S,
        "tp_bytes": tp_bytes,
        "tp": tp_bytes / NVLINK_BYTES_S,
        "pp_bytes": pp_bytes,
        "pp": pp_bytes / IB_BYTES_S,
        "with_bubble": compute / (1 - e["bubble"]),
    }


def main_time(name: str, gpus: int, mem_gb: float, seq_len: int, tokens: float) -> None:
    args, batch = MODELS[name], int(tokens // seq_len)
    print(
        f"{name} on {gpus} GPUs, every layout that fits; seconds per step, each term alone (docstring of time_estimate)"
    )
    print(
        f"{'tp x pp x dp':<14} {'m':>4} {'compute':>8} {'FSDP over IB':>19} {'TP over NVLink':>19} "
        f"{'PP over IB':>17} {'bubble':>15}"
    )
    for e in fitting(args, gpus, mem_gb, seq_len, batch):
        t = time_estimate(args, e, seq_len)
        pp = f"{t['pp_bytes'] / GB:,.0f} GB {t['pp']:5.1f} s" if e["pp"] > 1 else "-"
        tp = f"{t['tp_bytes'] / 1e12:,.1f} TB {t['tp']:5.1f} s" if e["tp"] > 1 else "-"
        bubble = f"{e['bubble']:.1%} -> {t['with_bubble']:.0f} s" if e["pp"] > 1 else "0"
        print(
            f"{e['tp']} x {e['pp']} x {e['dp']:<7} {e['m']:>4} {t['compute']:>7.0f}s "
            f"{t['fsdp_bytes'] / GB:>9,.1f} GB {t['fsdp']:>5.2f} s {tp:>19} {pp:>17} {bubble:>15}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", default="8,64,512,4096", help="comma-separated GPU counts")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch-tokens", type=float, default=4e6)
    p.add_argument("--model", choices=list(MODELS), help="list every layout that fits, not just the chosen one")
    p.add_argument("--commands", action="store_true", help="print the meshloom command line of each plan")
    p.add_argument("--ac", action="store_true", help="measure one block's kept bytes under each AC mode")
    p.add_argument("--time", action="store_true", help="with --model and one --gpus: seconds per step of each layout")
    a = p.parse_args()
    if a.ac:
        main_ac()
    elif a.time:
        if "," in a.gpus or not a.model:
            p.error("--time needs --model NAME and a single --gpus count")
        main_time(a.model, int(a.gpus), a.gpu_mem_gb, a.seq_len, a.global_batch_tokens)
    else:
        counts = [int(g) for g in a.gpus.split(",")]
        main_plan(counts, a.gpu_mem_gb, a.seq_len, a.global_batch_tokens, a.model, a.commands)


if __name__ == "__main__":
    main()
