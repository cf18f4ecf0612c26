"""Plan a cluster run before renting it: memory, step time and throughput of each layout, for dense and MoE models.

    python -m cluster.plan_layout --model llama3-70b --gpu h100 --gpus 512              # search: fastest that fit
    python -m cluster.plan_layout --model llama3-405b --gpu h100 --gpus 8192 --global-batch-tokens 16777216 \\
        --layout tp=8,cp=1,pp=16,dp=64,ep=1,schedule=Interleaved1F1B --json    # one given layout
    python -m cluster.plan_layout --model-shape dim=4096,n_layers=32,n_heads=32,n_kv_heads=8,vocab_size=32000,\\
        ffn_dim=14336,n_experts=8,top_k=2,moe_ffn_dim=14336 --gpu h800 --gpus 64          # any shape, MoE too
    python -m cluster.plan_layout --validate [--markdown]   # the planner beside published runs, error per row

Arithmetic only, in three modules (``python -m cluster.plan_layout`` runs the same command, and its ``--ac``
measures what activation checkpointing keeps):

1. **Memory** per rank, planning/memory_estimate.py (the library the dry run and the pre-allocation check use too):
   states, gathered weights, activations per layer (grouped-query attention's K/V at their own width; with and
   without SP; no s x s scores), micro-batches in flight per schedule, logits. A layout fits when its fullest
   rank's total is at most the GPU's memory, less ``HEADROOM`` for what the estimate leaves out.
2. **Time** per step, cluster/step_time.py: matmuls at one efficiency per GPU, memory-bound kernels at the
   memory bandwidth, exposed TP/CP/EP/PP/DP communication from message sizes and link bandwidths, the bubble
   per schedule, recomputation under activation checkpointing; uneven pipeline stages (the layers split by
   FLOPs, planning/pipeline_split.py: split_layers) are timed by the slowest.
3. **The check against published runs**, cluster/published_runs.py: Megatron-LM's Table 1 (Narayanan et al.
   2021, which sets the one derived number), torchtitan's H100 benchmark and Llama 3's Table 4 (neither tunes
   anything), predicted beside published, with each row's error (``--validate``).

For one set of degrees (``--layout``, and each candidate of the search) the planner chooses the schedule, the
stages per rank, the sequences per micro-batch and the activation checkpointing, and says why; search mode walks
the degrees too. Both are cluster/search.py. ``--layout`` may fix any of schedule, v, mb, ac. dp is the
data-parallel degree dp_replicate x dp_shard, as everywhere. Each data-parallel rank runs m = B / dp
micro-batches, B = global batch tokens / seq_len (rounded down to a multiple of dp: the batch a layout can use).
Layouts that fit are ranked by tokens per second per GPU; the best one's meshloom command closes the output.
``--json`` prints one object per layout: memory_gb, fits, step_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu,
why, and the breakdown in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys

from cluster.published_runs import (
    derive_mamf_share,
    llama3_markdown,
    llama3_rows,
    markdown_table,
    torchtitan_markdown,
    torchtitan_rows,
    validation_rows,
)
from cluster.search import AC_MODES, GPUS_PER_NODE, HEADROOM, choose, search, with_split
from cluster.step_time import matmul_efficiency, planner_gpu
from mesh.pipeline import SCHEDULE_FAMILIES
from models.flops import flops_per_token
from models.llama import ModelArgs
from models.moe import MoEArgs
from models.presets import PRESETS
from planning.gpus import PLANNER_GPUS
from planning.layout import Layout, degrees
from runtime.config import parse_float, parse_int
from runtime.options import count_option, float_option, text_option

_V = dict(n_kv_heads=8, vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)
MODELS: dict[str, ModelArgs] = {
    **PRESETS,
    "dense-10b": ModelArgs(dim=5120, n_layers=32, n_heads=40, ffn_dim=14336, **_V),
    "dense-100b": ModelArgs(dim=10240, n_layers=72, n_heads=80, ffn_dim=36864, **_V),
    "dense-1t": ModelArgs(dim=25600, n_layers=128, n_heads=160, ffn_dim=90112, **_V),
}
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "rope_theta", "max_seq_len")
MOE_KEYS = ("n_experts", "top_k", "moe_ffn_dim", "moe_every", "moe_shared_experts")


def key_values(text: str, option: str, keys: tuple[str, ...], words: tuple[str, ...] = ()) -> dict:
    """``key=value,...`` of ``option``: each key one of ``keys``; a value a whole number >= 1 in ASCII digits
    (``rope_theta``: a positive number; ``moe_shared_experts``: >= 0), or text for the ``words`` keys. A
    ValueError naming the option, the item and the fix otherwise."""
    fields: dict = {}
    for item in text.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} {text!r}: {item!r} is not key=value; write e.g. {option} {keys[0]}=2,...")
        if key not in keys:
            raise ValueError(f"{option}: unknown key {key!r}; use {', '.join(keys)}")
        if key in words:
            fields[key] = value
            continue
        number = parse_float(value) if key == "rope_theta" else parse_int(value)
        low = 0 if key == "moe_shared_experts" else 1
        if number is None or not (low <= number <= 2**31 - 1) or number != number:
            kind = "a positive number" if key == "rope_theta" else f"a whole number from {low} to 2,147,483,647"
            raise ValueError(f"{option} {key}={value!r}: give {kind} in ASCII digits")
        fields[key] = number
    return fields


def model_from_shape(text: str) -> ModelArgs:
    """``dim=...,n_layers=...,...`` (ModelArgs' fields; MoE with n_experts, top_k, moe_ffn_dim, moe_every,
    moe_shared_experts, as the config's model.* keys name them)."""
    fields = key_values(text, "--model-shape", SHAPE_KEYS + MOE_KEYS)
    args = ModelArgs(**{k: v for k, v in fields.items() if k in SHAPE_KEYS})
    if int(fields.get("n_experts", 0)):
        top_k = int(fields.get("top_k", 2))
        args.moe = MoEArgs(
            n_experts=int(fields["n_experts"]),
            top_k=top_k,
            hidden_dim=int(fields.get("moe_ffn_dim", 0)) or max(1, args.hidden_dim // top_k),
            n_shared_experts=int(fields.get("moe_shared_experts", 0)),
        )
        args.moe_every = int(fields.get("moe_every", 1))
    problem = shape_problem(args, fields)
    if problem:
        raise ValueError(problem)
    return args


def shape_problem(args: ModelArgs, given: dict) -> str | None:
    """The first rule of the shape itself that no layout can meet (train.py refuses the same model whatever its
    layout: planning/layout_rules.py, runtime/config.py), naming the --model-shape key, its value and the fix;
    None when the shape is one a layout can run. A key the text leaves out shows its default."""

    def shown(key: str, value) -> str:
        return f"{key}={value}" + ("" if key in given else " (the default)")

    dim, heads, kv = args.dim, args.n_heads, args.n_kv_heads
    if dim % heads:
        return (
            f"--model-shape {shown('dim', dim)} is not divisible by {shown('n_heads', heads)}; give a dim that is a "
            f"multiple of n_heads (e.g. dim={2 * heads * max(1, round(dim / (2 * heads)))}) or an n_heads that divides dim"
        )
    if (dim // heads) % 2:
        return (
            f"--model-shape dim / n_heads = {dim}/{heads} = {dim // heads} must be even (rotary embeddings rotate "
            f"pairs); give a dim that is a multiple of 2 x n_heads = {2 * heads}"
        )
    if heads % kv:
        return (
            f"--model-shape {shown('n_heads', heads)} is not divisible by {shown('n_kv_heads', kv)}; each key/value "
            "head serves a whole number of query heads: give an n_kv_heads that divides n_heads"
        )
    if args.moe is not None and args.moe.top_k > args.moe.n_experts:
        return (
            f"--model-shape {shown('top_k', args.moe.top_k)} must be at most n_experts={args.moe.n_experts}; "
            "give a top_k from 1 to n_experts"
        )
    return None


LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "dp_shard", "dp_replicate", "ep", "schedule", "v", "mb", "ac", "cp_attention")
CHOICES = ("schedule", "v", "mb", "ac")  # what the planner chooses for a layout unless --layout fixes it


def parse_layout(text: str, args: ModelArgs, seq_len: int) -> tuple[Layout, frozenset[str]]:
    """``tp=..,cp=..,pp=..,dp=..,ep=..`` plus optional dp_replicate, dp_shard, schedule, v (stages per rank), mb
    (sequences per micro-batch), ac and cp_attention: the layout, and which of ``CHOICES`` the text fixes (the
    planner searches the others, ``choose``). ``dp`` is the data-parallel degree dp_replicate x dp_shard
    (mesh/dims.py: ParallelDims.dp); give dp or dp_shard. Uneven pipeline stages are split by FLOPs."""
    fields = key_values(text, "--layout", LAYOUT_KEYS, words=("schedule", "ac", "cp_attention"))
    ints = {k: v for k, v in fields.items() if k not in ("schedule", "ac", "cp_attention")}
    schedule, ac = fields.get("schedule", "1F1B"), fields.get("ac", "full")
    cp_attention = fields.get("cp_attention", "allgather")
    for key, value, allowed in (
        ("schedule", schedule, tuple(SCHEDULE_FAMILIES)),
        ("ac", ac, AC_MODES),
        ("cp_attention", cp_attention, ("allgather", "ring")),
    ):
        if value not in allowed:
            raise ValueError(f"--layout {key}={value} is unknown; choose one of {', '.join(allowed)}")
    if any(value < 1 for value in ints.values()):
        raise ValueError(f"--layout: every degree must be >= 1, got {ints}")
    replicate = ints.get("dp_replicate", 1)
    shard = ints.get("dp_shard", ints.get("dp", replicate) // replicate)
    if "dp" in ints and ints["dp"] != replicate * shard:
        raise ValueError(
            f"--layout dp={ints['dp']} is the data-parallel degree dp_replicate x dp_shard = {replicate} x "
            f"{ints.get('dp_shard', ints['dp'] / replicate):g}; give dp a multiple of dp_replicate, or dp_shard alone"
        )
    pp = ints.get("pp", 1)
    v = ints.get("v", SCHEDULE_FAMILIES[schedule].natural_stages_per_rank)
    layout = Layout(
        dims=degrees(
            tp=ints.get("tp", 1),
            cp=ints.get("cp", 1),
            pp=pp,
            dp_shard=shard,
            dp_replicate=replicate,
            ep=ints.get("ep", 1),
        ),
        pp_schedule=schedule if pp > 1 else "1F1B",
        stages_per_rank=v if pp > 1 else 1,
        sequences_per_microbatch=ints.get("mb", 1),
        activation_checkpoint=ac,
        cp_attention=cp_attention,
    )
    fixed = frozenset(k for k in CHOICES if k in fields) | (frozenset({"schedule", "v"}) if pp == 1 else frozenset())
    return with_split(args, layout, seq_len), fixed


# ---- the meshloom command ------------------------------------------------------------------------------------


def overrides(args: ModelArgs, e: dict) -> list[tuple[str, str]]:
    """The dotted config overrides of a planned layout ``e`` (tests feed them to train.check_config)."""
    moe = []
    if args.moe is not None:
        m = args.moe
        moe = [
            ("model.n_experts", m.n_experts),
            ("model.top_k", m.top_k),
            ("model.moe_ffn_dim", m.hidden_dim),
            ("model.moe_every", args.moe_every),
            ("model.moe_shared_experts", m.n_shared_experts),
        ]
    pipeline = []
    if e["pp"] > 1:
        pipeline = [
            ("parallel.pp_schedule", e["schedule"]),
            ("parallel.pp_stages_per_rank", e["stages_per_rank"]),
            ("parallel.pp_microbatches", e["microbatches"]),
            ("parallel.pp_split", "flops"),
        ]
    pairs = [
        ("model.dim", args.dim),
        ("model.n_layers", args.n_layers),
        ("model.n_heads", args.n_heads),
        ("model.n_kv_heads", args.n_kv_heads),
        ("model.ffn_dim", args.hidden_dim),
        ("model.vocab_size", args.vocab_size),
        ("model.rope_theta", int(args.rope_theta)),
        ("model.max_seq_len", max(e["seq_len"], args.max_seq_len)),
        *moe,
        ("parallel.tp", e["tp"]),
        ("parallel.cp", e["cp"]),
        ("parallel.pp", e["pp"]),
        ("parallel.ep", e["ep"]),
        *([("parallel.dp_replicate", e["dp_replicate"])] if e["dp_replicate"] > 1 else []),
        ("parallel.dp_shard", -1),  # the rest of the world: e["dp_shard"]
        *pipeline,
        ("training.seq_len", e["seq_len"]),
        ("training.global_batch", e["global_batch"]),
        ("training.micro_batch", 0 if e["pp"] > 1 else e["sequences_per_microbatch"]),
        ("training.mixed_precision", "bf16"),
        ("training.activation_checkpoint", e["activation_checkpoint"]),
    ]
    return [(k, str(v)) for k, v in pairs]


def command(args: ModelArgs, e: dict) -> str:
    """The meshloom command line for a planned layout: one torchrun agent per node of 8 GPUs."""
    gpus = e["gpus"]
    nodes, rdzv = max(1, gpus // GPUS_PER_NODE), " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500"
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {min(GPUS_PER_NODE, gpus)}" + (rdzv if nodes > 1 else "")
    return " ".join([launch, "train.py", *(f"--{k} {v}" for k, v in overrides(args, e))])


# ---- printing ------------------------------------------------------------------------------------------------

HEADER = (
    f"{'tp':>2} {'cp':>2} {'pp':>3} {'dp':>5} {'ep':>2} {'schedule':<21} {'AC':<9} {'batch':>5} {'m':>4} {'mem GB':>6} "
    f"{'step s':>8} {'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>5}  compute mem-bd recomp     TP     CP     EP"
    f"     PP     DP bubble"
)


def row(e: dict) -> str:
    if "step_s" not in e:
        return f"{e['tp']:>2} {e['cp']:>2} {e['pp']:>3} {e['dp']:>5} {e['ep']:>2}  {e.get('why', '')}"
    b = e["breakdown_s"]
    schedule = f"{e['schedule']} v={e['stages_per_rank']}" if e["schedule"] else "-"
    schedule += f" mb={e['sequences_per_microbatch']}" if e["sequences_per_microbatch"] > 1 else ""
    parts = " ".join(
        f"{b[k]:>6.2f}" for k in ("compute", "memory_bound", "recompute", "tp", "cp", "ep", "pp", "dp", "bubble")
    )
    return (
        f"{e['tp']:>2} {e['cp']:>2} {e['pp']:>3} {e['dp']:>5} {e['ep']:>2} {schedule:<21} "
        f"{e['activation_checkpoint']:<9} {e['global_batch']:>5} {e['microbatches']:>4} {e['memory_gb']:>6.1f} {e['step_s']:>8.2f} "
        f"{e['tokens_per_s_per_gpu']:>9,.0f} {e['tflops_per_gpu']:>7.0f} {e['mfu']:>5.1%} {parts}"
    )


def gpu_markdown() -> str:
    """The planner's GPUs and the figures it uses (planning/gpus.py: GPUS), as docs/combining.md shows them."""
    lines = [
        "| --gpu | bf16 peak TFLOP/s | MAMF | matmul efficiency | HBM GB | HBM TB/s | NVLink GB/s | network GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in PLANNER_GPUS:
        g = planner_gpu(key)
        lines.append(
            f"| {key} | {g.bf16_tflops:g} | {g.mamf_tflops:g} | {matmul_efficiency(g):.3f} | {g.hbm_gb:g} "
            f"| {g.hbm_tb_s:g} | {g.nvlink_gb_s:g} | {g.network_gb_s:g} |"
        )
    return "\n".join(lines) + "\n"


def describe(args: ModelArgs, name: str, gpu_name: str, seq_len: int, tokens: float) -> str:
    gpu = planner_gpu(gpu_name)
    kind = f", MoE {args.moe.n_experts} experts top-{args.moe.top_k}" if args.moe else ""
    return (
        f"{name}: {args.num_params() / 1e9:,.1f}B parameters{kind}, {flops_per_token(args, seq_len) / 1e9:,.1f} "
        f"GFLOP per token at seq_len {seq_len:,}; batch {int(tokens // seq_len):,} sequences ({tokens:,.0f} tokens)\n"
        f"{gpu_name}: {gpu.bf16_tflops:g} TFLOP/s bf16 peak, matmuls at {matmul_efficiency(gpu):.3f} of it; "
        f"{gpu.hbm_gb:g} GB at {gpu.hbm_tb_s:g} TB/s; NVLink {gpu.nvlink_gb_s:g} GB/s, network {gpu.network_gb_s:g} "
        f"GB/s per GPU and direction; a layout fits under {HEADROOM:.0%} of the memory\n"
        "seconds per step: compute (matmuls), mem-bd (memory-bound kernels), recomp (recomputed forward), exposed "
        "TP/CP/EP/PP/DP communication, bubble"
    )


def main_plan(
    args: ModelArgs, name: str, gpu_name: str, gpus: int, seq_len: int, tokens: float, top: int, as_json: bool
):
    found = search(args, gpu_name, gpus, seq_len, tokens)
    fitting = [e for e in found if e["fits"]]
    if as_json:
        print(json.dumps(found[: max(top, 1)] if fitting else found[:top], indent=1))
        return
    print(describe(args, name, gpu_name, seq_len, tokens))
    print(f"{len(found)} layouts of {gpus:,} GPUs tried, {len(fitting)} fit; the fastest {min(top, len(fitting))}:")
    print(HEADER)
    print("\n".join(row(e) for e in fitting[:top]))
    if not fitting:
        print("none fits; the smallest:\n" + "\n".join(row(e) for e in found[:3]))
        return
    best = fitting[0]
    print(f"\nbest: {best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {best['step_s']:.2f} s per step")
    print(f"why this schedule and AC: {best['why']}")
    print(command(args, best))


def meshloom_refusal(args: ModelArgs, e: dict) -> str | None:
    """meshloom's own verdict on a planned layout (runtime/config.py's value checks, planning/plan.py's layout
    rules, no processes started): None if it accepts the command, else its message."""
    from planning.plan import LayoutPlan
    from runtime.config import ConfigError, check_values, load_config

    try:
        cfg = load_config(overrides=overrides(args, e))
        check_values(cfg)
        LayoutPlan.resolve(cfg, e["gpus"])
    except ConfigError as err:
        return str(err)
    return None


def main_layout(
    args: ModelArgs,
    name: str,
    gpu_name: str,
    layout: Layout,
    fixed: frozenset[str],
    seq_len: int,
    tokens: float,
    as_json: bool,
):
    """One layout: the planner chooses what ``fixed`` leaves open (schedule, v, mb, ac) and says why."""
    e, tried = choose(args, layout, fixed, gpu_name, seq_len, tokens)
    # a pipeline with fewer micro-batches than stages is estimated, not refused (its note says what it needs)
    refusal = meshloom_refusal(args, e) if "step_s" in e and "note" not in e else None
    if refusal:  # exit 2, meshloom's status for bad input
        print(f"meshloom would refuse this layout: {refusal}", file=sys.stderr)
        raise SystemExit(2)
    if as_json:
        print(json.dumps(e, indent=1))
        return
    print(describe(args, name, gpu_name, seq_len, tokens))
    given = ", ".join(sorted(fixed - ({"schedule", "v"} if layout.pp == 1 else set()))) or "nothing"
    print(
        f"layout {layout.describe()} on {layout.gpus:,} GPUs"
        + (f", stages {stages_text(e['stage_layers'])}" if e["stage_layers"] else "")
        + f"; given {given}, chosen the rest"
    )
    print(HEADER)
    print(row(e))
    mem = e["memory_breakdown_gb"]
    print(
        f"memory of pipeline rank {e['memory_rank']}: states {mem['states']:.1f} + gathered {mem['gathered']:.1f} "
        f"+ activations {mem['activations']:.1f} + logits {mem['logits']:.1f} = {e['memory_gb']:.1f} GB "
        f"({'fits' if e['fits'] else 'does not fit'})"
    )
    if tried:
        print(f"why: {e['why']}")
    if "note" in e:
        print(f"note: {e['note']}")
    if "step_s" in e:
        print(command(args, e))


def stages_text(sizes: list[int]) -> str:
    """A stage split as printed: every stage's layer count, or for many stages their range."""
    return str(sizes) if len(sizes) <= 16 else f"{len(sizes)} of {min(sizes)}-{max(sizes)} layers"


def main_validate(markdown: bool) -> None:
    rows = validation_rows()
    if markdown:
        print(markdown_table(rows) + "\n" + torchtitan_markdown() + "\n" + llama3_markdown(), end="")
        return
    print("Megatron-LM, Narayanan et al. 2021, Table 1 (A100 80GB, GPT, seq 2048, full recomputation)")
    print(
        f"{'params':>8} {'tp':>2} {'pp':>3} {'v':>2} {'GPUs':>5} {'batch':>5} {'m':>4} {'published':>9} {'predicted':>9} {'error':>7}"
    )
    for r in rows:
        run = r["run"]
        print(
            f"{run.name:>8} {run.tp:>2} {run.pp:>3} {run.layout.stages_per_rank:>2} {run.gpus:>5} {run.batch:>5} "
            f"{r['microbatches']:>4} {run.published_tflops:>9.0f} {r['predicted']:>9.1f} {r['error']:>+7.1%}"
        )
    print(f"MAMF share derived from the 1T row: {derive_mamf_share():.4f}")
    print("\ntorchtitan, Llama 3.1 8B on H100s at 500 W (bf16, FSDP, selective AC): a check outside the goal")
    for r in torchtitan_rows():
        print(
            f"{r['run'].name:<30} published {r['run'].published_tokens_per_s:>6,} predicted {r['predicted']:>6,.0f} {r['error']:>+7.1%}"
        )
    print(
        "\nLlama 3 405B, Llama Team 2024 (arXiv 2407.21783), Table 4 (H100 80GB, bf16): the planner chooses schedule, "
        "v, micro-batches and AC for each published layout"
    )
    for r in llama3_rows():
        run, e = r["run"], r["planned"]
        print(
            f"{run.gpus:>6,} GPUs tp {run.tp} cp {run.cp:>2} pp {run.pp} dp {run.dp:>3} seq {run.seq_len:>7,}: published "
            f"{run.published_tflops:.0f} predicted {r['predicted']:.0f} TFLOP/s {r['error']:>+7.1%}  ({e['why']})"
        )


def build_parser() -> argparse.ArgumentParser:
    """The command's options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    p = argparse.ArgumentParser(prog="python -m cluster.plan_layout", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-70b", choices=list(MODELS), help="a preset or a shape of this module")
    p.add_argument(
        "--model-shape",
        type=text_option(nonempty=True),
        help="any shape: dim=..,n_layers=..,n_heads=..,n_kv_heads=..,vocab_size=.. (MoE too)",
    )
    p.add_argument("--gpu", default="h100", choices=list(PLANNER_GPUS))
    p.add_argument(
        "--gpus",
        type=count_option(),
        help="GPUs to search over (with --layout: checked against the layout)",
    )
    p.add_argument("--seq-len", type=count_option(), default=8192)
    p.add_argument(
        "--global-batch-tokens",
        type=float_option(ge=1),
        default=4e6,
        help="tokens per step, a cap set by convergence",
    )
    p.add_argument(
        "--layout",
        type=text_option(nonempty=True),
        help="one layout: tp=..,cp=..,pp=..,dp=..,ep=..[,dp_replicate=..,schedule=..,v=..,mb=..,ac=..]; dp = "
        "dp_replicate x dp_shard; the planner chooses schedule, v, mb and ac unless given",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per layout")
    p.add_argument("--top", type=count_option(), default=10, help="search: how many layouts to print")
    p.add_argument("--validate", action="store_true", help="the time model beside Megatron-LM's Table 1")
    p.add_argument("--markdown", action="store_true", help="with --validate: the table of docs/combining.md")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)
    if a.validate:
        main_validate(a.markdown)
        return
    try:
        args = model_from_shape(a.model_shape) if a.model_shape else MODELS[a.model]
        name = "--model-shape" if a.model_shape else a.model
        if a.layout:
            layout, fixed = parse_layout(a.layout, args, a.seq_len)
            if a.gpus and a.gpus != layout.gpus:
                p.error(f"--layout {a.layout} uses {layout.gpus} GPUs, not --gpus {a.gpus}")
            main_layout(args, name, a.gpu, layout, fixed, a.seq_len, a.global_batch_tokens, a.json)
            return
    except ValueError as err:
        p.error(str(err))
    if not a.gpus:
        p.error("give --gpus N to search, or --layout to evaluate one layout")
    main_plan(args, name, a.gpu, a.gpus, a.seq_len, a.global_batch_tokens, a.top, a.json)


if __name__ == "__main__":
    main()
