"""The planner's search: for one set of degrees, the schedule, stages per rank, micro-batch size and activation
checkpointing that run fastest within the memory; over all degrees, the layouts that fit, fastest first.

1. ``evaluate`` prices one fully specified layout: memory per rank (planning/memory_estimate.py), time per step
   (cluster/step_time.py), throughput, and whether it fits (its fullest rank under ``HEADROOM`` of the GPU).
2. ``choose`` completes one set of degrees (``choices``): every pipeline schedule torch ships that meshloom runs
   (mesh/pipeline.py: SCHEDULE_FAMILIES) with 1, 2 (V-shaped) or 2 and 4 (looped) stages per rank, 1, 2 or 4
   sequences per micro-batch, and no, selective or full activation checkpointing; it keeps the fastest variant
   that fits and says why (its time and memory beside the runner-up and the fastest that did not fit). A
   pipeline with fewer micro-batches than stages is estimated, with a note (``short_pipeline``: 1F1B and
   DualPipeV as torch ships them refuse it; Llama 3 ran a modified schedule).
3. ``search`` walks the degrees (``candidates``): tp in {1, 2, 4, 8} (inside a node), cp in {1, 2, 4, 8}, every
   pp up to the layer count that divides the GPUs, every ep dividing the experts; dp_shard takes the rest. The
   run's own degree rules (planning/layout_rules.py: ``degree_errors``) drop what a launch would refuse, so the
   planner proposes exactly the layouts the run accepts. Each gets its chosen schedule and checkpointing (one
   sequence per micro-batch: the time model gains nothing from more), and the layouts that fit are ranked by
   tokens per second per GPU.

The command around it (parsing, printing, the meshloom command line) is cluster/plan_layout.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cluster.step_time import MESHLOOM, LlamaWorkload, matmul_efficiency, planner_gpu, stage_ids, step_time
from mesh.pipeline import SCHEDULE_FAMILIES
from models.flops import flops_per_token
from planning.layout import Layout, degrees
from planning.layout_rules import degree_errors, pipeline_errors
from planning.memory_estimate import rank_memory

if TYPE_CHECKING:
    from models.llama import ModelArgs

GPUS_PER_NODE = 8
GB = 1e9
HEADROOM = 0.9  # of a GPU's memory the estimate may fill: the CUDA context, NCCL buffers and fragmentation
TP_DEGREES = CP_DEGREES = (1, 2, 4, 8)
AC_MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4)  # sequences per micro-batch that --layout weighs
SEARCH_MICRO_BATCHES = (1,)  # ... and the search over degrees (the time model gains nothing from more per micro-batch)


def with_split(args: ModelArgs, layout: Layout, seq_len: int) -> Layout:
    """The layout with its stages' layers: meshloom's FLOPs-balanced split (any pp up to the layer count)."""
    if layout.pp == 1:
        return layout
    return replace(layout, stage_layers=flops_split(args, layout.n_stages, seq_len))


_SPLITS: dict[tuple, tuple[tuple[int, ...], ...]] = {}


def flops_split(args: ModelArgs, n_stages: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """mesh/pipeline.py's ``pp_split flops`` (what the printed command asks for), remembered per shape."""
    from planning.pipeline_split import split_layers

    key = (repr(args), n_stages, seq_len)
    if key not in _SPLITS:
        _SPLITS[key] = tuple(tuple(s) for s in split_layers(args, n_stages, "flops", seq_len))
    return _SPLITS[key]


# ---- one layout ------------------------------------------------------------------------------------------------


def evaluate(args: ModelArgs, layout: Layout, gpu_name: str, seq_len: int, tokens: float) -> dict:
    """Memory and time of one layout, as the ``--json`` object (see the module docstring)."""
    gpu = planner_gpu(gpu_name)
    m = int(tokens // seq_len) // (layout.dp * layout.sequences_per_microbatch)
    batch = m * layout.dp * layout.sequences_per_microbatch
    workload = LlamaWorkload(args, seq_len)
    mem_layout = replace(layout, seq_len=seq_len, pp_microbatches=m)
    stages = [list(s) for s in layout.stage_layers] if layout.stage_layers else [list(range(args.n_layers))]
    ranks = [rank_memory(args, mem_layout, stages, r, stage_ids(layout, r)) for r in range(layout.pp)]
    worst = max(range(layout.pp), key=lambda r: ranks[r].total)
    out = {
        "gpu": gpu_name,
        "gpus": layout.gpus,
        **{k: getattr(layout, k) for k in ("tp", "cp", "pp")},
        "dp": layout.dp,  # dp_replicate x dp_shard, as ParallelDims.dp
        **{k: getattr(layout, k) for k in ("dp_shard", "dp_replicate", "ep")},
        "schedule": layout.pp_schedule if layout.pp > 1 else None,
        "stages_per_rank": layout.stages_per_rank,
        "stage_layers": [len(s) for s in stages] if layout.pp > 1 else None,
        "sequences_per_microbatch": layout.sequences_per_microbatch,
        "activation_checkpoint": layout.activation_checkpoint,
        "seq_len": seq_len,
        "global_batch": batch,
        "microbatches": m,
        "memory_gb": ranks[worst].total / GB,
        "memory_rank": worst,
        "memory_breakdown_gb": {k: v / GB for k, v in vars(ranks[worst]).items()},
        "fits": m >= 1 and ranks[worst].total <= HEADROOM * gpu.hbm_gb * GB,
    }
    if m < 1:
        return {**out, "fits": False, "why": f"the batch ({int(tokens // seq_len)} sequences) is smaller than dp"}
    if layout.pp > 1 and short_pipeline(layout, m):
        out["note"] = (
            f"m={m} micro-batches < {layout.n_stages if layout.pp_schedule == 'DualPipeV' else layout.pp} stages: "
            f"{layout.pp_schedule} as torch ships it needs at least one per stage; estimated as if a modified "
            "schedule ran them (Llama 3's), which meshloom does not have"
        )
    t = step_time(workload, layout, MESHLOOM, gpu, batch)
    tokens_per_s = batch * seq_len / t.step / layout.gpus
    tflops = flops_per_token(args, seq_len) * tokens_per_s / 1e12
    return {
        **out,
        "step_s": t.step,
        "tokens_per_s_per_gpu": tokens_per_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / gpu.bf16_tflops,
        "matmul_efficiency": matmul_efficiency(gpu),
        "breakdown_s": {
            "compute": t.matmul,
            "memory_bound": t.memory_bound,
            "recompute": t.recompute,
            "tp": t.tp,
            "cp": t.cp,
            "ep": t.ep,
            "pp": t.pp,
            "dp": t.dp,
            "bubble": t.bubble,
            "optimizer": t.optimizer,
        },
    }


def short_pipeline(layout: Layout, m: int) -> bool:
    """Fewer micro-batches than the schedule needs stages (planning/layout_rules.py: pipeline_errors' rules for
    1F1B and DualPipeV): a schedule torch does not ship would have to run them."""
    schedule = layout.pp_schedule
    return (schedule == "1F1B" and m < layout.pp) or (schedule == "DualPipeV" and m < layout.n_stages)


# ---- the choices for one layout: schedule, stages per rank, micro-batch size, activation checkpointing ----------


def choices(args: ModelArgs, layout: Layout, fixed: frozenset[str], seq_len: int, tokens: float, mbs=MICRO_BATCHES):
    """The variants of ``layout`` the planner weighs: every schedule torch ships that meshloom runs
    (mesh/pipeline.py: SCHEDULE_FAMILIES) with its stages per rank (1; 2 for the V-shaped; 2 or 4 for the looped
    ones), sequences per micro-batch ``mbs``, and the three checkpointing modes, except what ``fixed`` names.
    Variants meshloom's pipeline rules refuse are left out, except for having fewer micro-batches than stages
    (estimated, with a note: ``evaluate``)."""
    batch = int(tokens // seq_len)
    schedules = [layout.pp_schedule] if "schedule" in fixed or layout.pp == 1 else list(SCHEDULE_FAMILIES)
    for schedule in schedules:
        family = SCHEDULE_FAMILIES[schedule]
        if "v" in fixed or layout.pp == 1:
            vs = [layout.stages_per_rank]
        else:
            vs = {"single": [1], "v": [2], "looped": [2, 4]}[family.placement]
        for v in vs:
            if layout.pp * v > args.n_layers:
                continue
            for mb in [layout.sequences_per_microbatch] if "mb" in fixed else mbs:
                m = batch // (layout.dp * mb)
                if m < 1:
                    continue
                if layout.pp > 1:
                    errors = pipeline_errors(layout.pp, schedule, v, m, None, "flops", args.n_layers)
                    short = short_pipeline(replace(layout, pp_schedule=schedule, stages_per_rank=v), m)
                    if len(errors) > int(short):
                        continue
                base = with_split(
                    args, replace(layout, pp_schedule=schedule, stages_per_rank=v, sequences_per_microbatch=mb), seq_len
                )
                for ac in [layout.activation_checkpoint] if "ac" in fixed else AC_MODES:
                    yield replace(base, activation_checkpoint=ac)


def choose(
    args: ModelArgs,
    layout: Layout,
    fixed: frozenset[str],
    gpu_name: str,
    seq_len: int,
    tokens: float,
    mbs=MICRO_BATCHES,
):
    """(the chosen variant, every variant evaluated): the fastest that fits, else the one with the least memory.
    The chosen one carries ``why``: its time and memory beside the runner-up and the fastest that did not fit."""
    tried = [evaluate(args, v, gpu_name, seq_len, tokens) for v in choices(args, layout, fixed, seq_len, tokens, mbs)]
    if not tried:  # nothing meshloom accepts: the layout as given, for its message
        return evaluate(args, layout, gpu_name, seq_len, tokens), []
    timed = [e for e in tried if "step_s" in e]
    fits = sorted((e for e in timed if e["fits"]), key=lambda e: e["step_s"])
    if not fits:
        best = min(tried, key=lambda e: e["memory_gb"])
        return {**best, "why": f"none of {len(tried)} variants fits; the least memory"}, tried
    best = fits[0]
    reasons = [f"fastest of {len(fits)} variants that fit ({len(tried)} tried): {variant(best)}"]
    if len(fits) > 1:
        runner = fits[1]
        reasons.append(f"next {variant(runner)} +{runner['step_s'] / best['step_s'] - 1:.1%}")
    faster = [e for e in timed if not e["fits"] and e["step_s"] < best["step_s"]]
    if faster:
        quick = min(faster, key=lambda e: e["step_s"])
        reasons.append(f"faster but does not fit: {variant(quick)}")
    return {**best, "why": "; ".join(reasons)}, tried


def variant(e: dict) -> str:
    """One variant in a few words: schedule and v, micro-batches, AC, step and memory."""
    pipe = f"{e['schedule']} v={e['stages_per_rank']}, " if e["pp"] > 1 else ""
    return (
        f"{pipe}mb={e['sequences_per_microbatch']} (m={e['microbatches']}), ac={e['activation_checkpoint']}: "
        f"{e['step_s']:.2f} s, {e['memory_gb']:.1f} GB"
    )


# ---- the search --------------------------------------------------------------------------------------------


def candidates(args: ModelArgs, gpus: int, seq_len: int, batch: int):
    """Every set of degrees the search tries that the run accepts (module docstring, step 3); ``choose`` picks each
    one's schedule and the rest."""
    experts = args.moe.n_experts if args.moe else 1
    for tp in [t for t in TP_DEGREES if t <= min(GPUS_PER_NODE, gpus)]:  # TP stays inside a node
        for cp in CP_DEGREES:
            for pp in range(1, args.n_layers + 1):
                if gpus % (tp * cp * pp):
                    continue
                dp_shard = gpus // (tp * cp * pp)  # no HSDP in the search: dp = dp_shard
                if batch // dp_shard < 1:
                    continue
                for ep in [e for e in range(1, experts + 1) if experts % e == 0]:
                    layout = Layout(dims=degrees(tp=tp, cp=cp, pp=pp, dp_shard=dp_shard, ep=ep), seq_len=seq_len)
                    if not degree_errors(layout, args):  # the run's own rules (planning/layout_rules.py)
                        yield layout


def search(args: ModelArgs, gpu_name: str, gpus: int, seq_len: int, tokens: float) -> list[dict]:
    """Every set of degrees with its chosen schedule, micro-batches and checkpointing; those that fit first,
    fastest first, then the rest by memory."""
    batch = int(tokens // seq_len)
    found = [
        choose(args, layout, frozenset(), gpu_name, seq_len, tokens, SEARCH_MICRO_BATCHES)[0]
        for layout in candidates(args, gpus, seq_len, batch)
    ]
    fits = sorted((e for e in found if e["fits"]), key=lambda e: -e["tokens_per_s_per_gpu"])
    return fits + sorted((e for e in found if not e["fits"]), key=lambda e: e["memory_gb"])
