"""Every rule a parallel layout must satisfy, in one place: ``layout_errors`` returns all the broken ones.

``LayoutPlan.resolve`` (planning/plan.py) calls ``layout_errors`` on every rank before any process group exists,
and raises one ConfigError listing each broken rule with its field, its value and the fix, so a misfit never
reaches a collective. Single fields were already checked against their ranges where they are declared
(runtime/config.py: ``check_values``); the rules here tie the layout to the world, the model and the batch:

1. **World.** The degrees multiply to the number of processes (``dp_shard = -1`` takes what is left).
2. **Tensor parallelism.** tp divides the heads, the key/value heads, the FFN and the vocabulary; sequence
   parallelism and MoE under TP need seq_len to split over tp; ``sp_regather`` needs SP.
3. **Context parallelism.** Two balanced chunks per cp rank; what cp cannot combine with.
4. **Pipeline.** The schedule's family against the stages per rank, the layer split, the micro-batches.
5. **Experts.** top_k within n_experts; ep divides the experts and the dp_shard x cp x tp ranks it borrows.
6. **Compile.** The layouts torch 2.13 cannot compile.
7. **Batch.** global batch = micro-batch x dp x accumulation, split evenly (``batch_split``, worked out once).
8. **Savers.** Gradient sync once per step, compression and CPU offload against the layout.
9. **Sequence.** seq_len within the rotary tables.

One more rule needs the resolved plan and the machine: ``check_memory`` (train.check_config calls it right
after ``LayoutPlan.resolve``, every rank, before anything is allocated) compares the per-rank memory
estimate (planning/memory_estimate.py) of the busiest pipeline rank with the memory one rank may use, and
refuses a layout that exceeds it by a clear margin, naming the model's size, a layout and a size that would
fit; ``run.memory_check = false`` turns it off.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mesh.pipeline import SCHEDULE_FAMILIES, SCHEDULES, schedules_of, stage_ids_of_rank
from mesh.private_api import splits_compiled_backward
from planning.memory_estimate import RankMemory, even_stage_layers, rank_memory
from runtime.config import ConfigError
from runtime.schema import PipelineSchedule

if TYPE_CHECKING:
    from mesh.dims import ParallelDims
    from models.llama import ModelArgs
    from planning.layout import Layout

# The one table of schedule families is mesh/pipeline.py's; the config lists the names a user may type.
assert set(SCHEDULES) == set(typing.get_args(PipelineSchedule)), "runtime/config.py and SCHEDULE_FAMILIES disagree"


@dataclass(frozen=True)
class BatchSplit:
    """global_batch = micro x dp x accumulation, in sequences; the fields are None where the split fails."""

    global_batch: int  # training.global_batch
    requested_micro: int  # training.micro_batch (0: the whole local batch)
    local: int | None  # sequences per step on one data-parallel rank (None: dp does not divide global_batch)
    micro: int | None  # sequences per forward call of the training loop (None: it does not divide ``local``)

    @property
    def accumulation(self) -> int | None:
        return None if self.local is None or self.micro is None else self.local // self.micro


def batch_split(global_batch: int, dp: int, micro_batch: int) -> BatchSplit:
    """The per-rank batch and micro-batch (``micro_batch = 0``: all of the local batch at once)."""
    if global_batch % dp:
        return BatchSplit(global_batch, micro_batch, None, None)
    local = global_batch // dp
    if micro_batch < 0 or (micro_batch and local % micro_batch):
        return BatchSplit(global_batch, micro_batch, local, None)
    return BatchSplit(global_batch, micro_batch, local, micro_batch or local)


def layout_errors(
    layout: Layout, model: ModelArgs, batch: BatchSplit, requested_dp_shard: int | None = None
) -> list[str]:
    """Every rule the layout breaks (steps 1-9 of the module docstring), as messages naming field, value, fix.
    ``requested_dp_shard``: parallel.dp_shard as written (-1: the rest of the world), when it differs."""
    dims = layout.dims
    errors = degree_errors(layout, model, requested_dp_shard)
    if dims.pp > 1:
        # The per-rank batch is unknown while the batch split is broken (reported below); check the rest.
        errors += pipeline_errors(
            dims.pp,
            layout.pp_schedule,
            layout.stages_per_rank,
            layout.pp_microbatches,
            batch.micro,
            layout.pp_split,
            model.n_layers,
        )
    errors += compile_errors(layout)
    errors += aux_form_errors(layout, model, batch)
    errors += batch_errors(dims, batch)
    errors += saver_errors(layout, batch)
    if layout.seq_len > model.max_seq_len:
        errors.append(
            f"training.seq_len={layout.seq_len} exceeds model.max_seq_len={model.max_seq_len}; raise "
            "model.max_seq_len or shorten training.seq_len."
        )
    return errors


def aux_form_errors(layout: Layout, model: ModelArgs, batch: BatchSplit) -> list[str]:
    """transformers' aux loss is one product of sums over the whole forward (models/moe.py): whole only when one
    forward on one rank sees the global batch."""
    moe, dims = model.moe, layout.dims
    if moe is None or moe.aux_loss_coef <= 0 or moe.aux_loss_form != "transformers":
        return []
    if dims.world_size == 1 and batch.accumulation in (None, 1):
        return []
    return [
        f"model.moe_aux_loss_form='transformers' (model.moe_aux_loss_coef={moe.aux_loss_coef}) on {dims.world_size} "
        f"ranks with {batch.accumulation} micro-batches per step: transformers' auxiliary loss multiplies two sums "
        "over the whole batch and every layer, which one forward sees only on one rank without accumulation; set "
        "--model.moe_aux_loss_form sequence (meshloom's per-sequence loss, which every layout computes), or train "
        "on one rank with training.micro_batch 0."
    ]


def degree_errors(layout: Layout, model: ModelArgs, requested_dp_shard: int | None = None) -> list[str]:
    """Rules 1, 2, 3 and 5: the degrees against the world, the model and the sequence, whatever the schedule, the
    batch and the savers (the cluster planner's search filters its candidates with these: cluster/search.py)."""
    dims = layout.dims
    errors = world_errors(dims, dims.dp_shard if requested_dp_shard is None else requested_dp_shard)
    errors += tensor_parallel_errors(layout, model)
    errors += context_parallel_errors(layout, model)
    return errors + expert_errors(dims, model)


def world_errors(dims: ParallelDims, requested_dp_shard: int) -> list[str]:
    """Rule 1: the degrees multiply to WORLD_SIZE."""
    if requested_dp_shard == -1:
        others = dims.dp_replicate * dims.cp * dims.tp * dims.pp
        if dims.world_size % others:
            return [
                f"parallel.dp_shard=-1 cannot fill the world: WORLD_SIZE={dims.world_size} is not divisible by "
                f"dp_replicate*cp*tp*pp={others}; choose degrees whose product divides {dims.world_size}."
            ]
    product = dims.pp * dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp
    if product == dims.world_size:
        return []
    cp, cp_value = ("*cp", f"*{dims.cp}") if dims.cp > 1 else ("", "")
    return [
        f"pp*dp_replicate*dp_shard{cp}*tp = {dims.pp}*{dims.dp_replicate}*{dims.dp_shard}{cp_value}*{dims.tp} = "
        f"{product} but WORLD_SIZE={dims.world_size}; make the product equal the number of processes "
        f"(or set parallel.dp_shard=-1 to take the rest)."
    ]


def tensor_parallel_errors(layout: Layout, model: ModelArgs) -> list[str]:
    """Rule 2: the model splits evenly over the tp ranks, and so does every sequence where TP splits it."""
    errors: list[str] = []
    dims, t, p = layout.dims, layout, layout
    if model.dim % model.n_heads:
        errors.append(f"model.dim={model.dim} is not divisible by model.n_heads={model.n_heads}; pick a multiple.")
    if model.n_heads % model.n_kv_heads:
        errors.append(
            f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads={model.n_kv_heads}; "
            "each key/value head must serve a whole number of query heads."
        )
    for field, value in (
        ("model.n_heads", model.n_heads),
        ("model.n_kv_heads", model.n_kv_heads),
        ("the FFN hidden size (model.ffn_dim)", model.hidden_dim),
        ("model.vocab_size", model.vocab_size),
    ):
        if value % dims.tp:
            errors.append(f"parallel.tp={dims.tp} does not divide {field}={value}; choose a tp that divides it.")
    if dims.tp > 1 and p.sequence_parallel and dims.cp == 1 and t.seq_len % dims.tp:
        errors.append(
            f"training.seq_len={t.seq_len} is not divisible by parallel.tp={dims.tp}, which sequence "
            "parallelism needs; change seq_len or set parallel.sequence_parallel=false."
        )
    elif (
        dims.tp > 1
        and model.moe is not None
        and (t.seq_len // dims.cp) % dims.tp
        # with cp, a seq_len that breaks 2*cp, or SP's own per-cp-rank rule, is reported once, below
        and not (dims.cp > 1 and (t.seq_len % (2 * dims.cp) or p.sequence_parallel))
    ):
        errors.append(
            f"training.seq_len={t.seq_len}"
            + (f" (per cp rank: {t.seq_len // dims.cp})" if dims.cp > 1 else "")
            + " is not divisible by "
            f"parallel.tp={dims.tp}: under TP each tp rank runs the MoE layers on its own chunk of every sequence "
            "(mesh/moe_token_split.TokenSplitMoE); change seq_len."
        )
    if p.sp_regather and layout.activation_checkpoint != "none":
        errors.append(
            f"parallel.sp_regather=true with training.activation_checkpoint={layout.activation_checkpoint}: a "
            "checkpointed block keeps no gathered input to begin with (full) or keeps it by its policy (selective), "
            "so there is nothing to re-gather; set training.activation_checkpoint=none or parallel.sp_regather=false."
        )
    if p.sp_regather and (dims.tp == 1 or not p.sequence_parallel):
        errors.append(
            f"parallel.sp_regather=true re-gathers sequence-parallel inputs, but parallel.tp={dims.tp} and "
            f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}: there is nothing to re-gather; set "
            "parallel.tp > 1 with parallel.sequence_parallel=true, or parallel.sp_regather=false."
        )
    return errors


def context_parallel_errors(layout: Layout, model: ModelArgs) -> list[str]:
    """The rules of context parallelism (mesh/context_parallel.py), as messages naming the field and the fix."""
    dims, t = layout.dims, layout
    if dims.cp == 1:
        return []
    errors: list[str] = []
    aux = model.moe.aux_loss_coef if model.moe else 0.0
    capacity = model.moe.capacity_factor if model.moe else 0.0
    if t.seq_len % (2 * dims.cp):
        errors.append(
            f"training.seq_len={t.seq_len} is not divisible by 2*parallel.cp={2 * dims.cp}: each cp rank holds two "
            f"equal chunks of every sequence (chunks r and 2cp-1-r, for the causal load balance); use a multiple "
            f"of {2 * dims.cp} or another parallel.cp."
        )
    elif dims.tp > 1 and layout.sequence_parallel and (t.seq_len // dims.cp) % dims.tp:
        errors.append(
            f"training.seq_len={t.seq_len} / parallel.cp={dims.cp} = {t.seq_len // dims.cp} tokens per cp rank, "
            f"not divisible by parallel.tp={dims.tp}, which sequence parallelism needs; make seq_len a multiple of "
            f"cp*tp={dims.cp * dims.tp} (and of 2*cp) or set parallel.sequence_parallel=false."
        )
    if aux > 0:
        errors.append(
            f"model.moe_aux_loss_coef={aux} with parallel.cp={dims.cp}: the auxiliary loss is computed "
            "per whole sequence, and a cp rank holds only part of each; set model.moe_aux_loss_coef=0 (the "
            "aux-loss-free bias, model.moe_bias_update_rate, works with cp) or parallel.cp=1."
        )
    if capacity > 0:
        errors.append(
            f"model.moe_capacity_factor={capacity} with parallel.cp={dims.cp}: expert capacity is counted "
            "per whole sequence, and a cp rank holds only part of each; set model.moe_capacity_factor=0 "
            "(dropless) or parallel.cp=1."
        )
    return errors


def pipeline_errors(
    pp: int,
    schedule: str,
    n_local: int,
    microbatches: int,
    local_batch: int | None,
    split: str,
    n_layers: int,
) -> list[str]:
    """Every rule a pipeline layout must satisfy, as messages naming the field and the fix."""
    if schedule not in SCHEDULES:
        return [f"parallel.pp_schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}."]
    errors = []
    family = SCHEDULE_FAMILIES[schedule]
    if family.placement == "v" and n_local != 2:
        errors.append(
            f"parallel.pp_stages_per_rank={n_local} but {schedule} is V-shaped and needs exactly 2 stages per "
            "rank; set parallel.pp_stages_per_rank=2 (or 0 to derive it)."
        )
    if family.placement == "single" and n_local != 1:
        errors.append(
            f"parallel.pp_stages_per_rank={n_local} but {schedule} runs one stage per rank; use a looped schedule "
            f"({', '.join(schedules_of('looped'))}) for several, or set it to 1."
        )
    n_stages = pp * n_local
    if n_stages > n_layers:
        errors.append(
            f"parallel.pp={pp} x {n_local} stages per rank = {n_stages} stages, more than model.n_layers={n_layers}; "
            "lower parallel.pp or parallel.pp_stages_per_rank, or add layers."
        )
    if split not in ("params", "flops", "memory"):
        try:
            sizes = [int(x) for x in split.split(",")]
        except ValueError:
            sizes = []
        if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes, default=0) < 1:
            errors.append(
                f"parallel.pp_split={split!r} must be 'params', 'flops', 'memory' or {n_stages} positive layer counts "
                f"summing to model.n_layers={n_layers}, e.g. "
                f"{','.join([str(n_layers // n_stages)] * (n_stages - 1) + [str(n_layers - n_layers // n_stages * (n_stages - 1))])}."
            )
    if microbatches < 1 or (local_batch is not None and local_batch % microbatches):
        errors.append(
            f"parallel.pp_microbatches={microbatches} must divide the per-rank batch {local_batch} (training.micro_batch, "
            "or global_batch / dp); choose a divisor."
        )
    if schedule == "1F1B" and microbatches < pp:
        errors.append(f"parallel.pp_microbatches={microbatches} < pp={pp}: 1F1B needs at least one per stage.")
    if schedule == "DualPipeV" and microbatches < n_stages:
        errors.append(
            f"parallel.pp_microbatches={microbatches} < {n_stages} stages: DualPipeV needs at least one per stage."
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            errors.append(
                f"parallel.pp_microbatches={microbatches} is not a multiple of max(1, m // pp) = {rounds}, which "
                f"{schedule} needs; a multiple of pp={pp} always works."
            )
    return errors


def expert_errors(dims: ParallelDims, model: ModelArgs) -> list[str]:
    """Rule 5: top_k within the experts; ep divides the experts and the dp_shard x cp x tp ranks it borrows
    (mesh/dims.build_mesh unflattens those into efsdp x ep)."""
    errors: list[str] = []
    n_experts = model.moe.n_experts if model.moe else 0
    if model.moe and not 1 <= model.moe.top_k <= n_experts:
        errors.append(f"model.top_k={model.moe.top_k} must be between 1 and model.n_experts={n_experts}.")
    if dims.ep > 1:
        if n_experts == 0:
            errors.append(f"parallel.ep={dims.ep} needs an MoE model; set model.n_experts or parallel.ep=1.")
        elif n_experts % dims.ep:
            errors.append(
                f"parallel.ep={dims.ep} does not divide model.n_experts={n_experts}; each ep rank must own "
                "the same number of experts: choose an ep that divides n_experts."
            )
        borrowed = dims.dp_shard * dims.cp * dims.tp
        if borrowed % dims.ep:
            errors.append(
                f"parallel.ep={dims.ep} must divide parallel.dp_shard*cp*tp={dims.dp_shard}*{dims.cp}*{dims.tp}"
                f"={borrowed}: expert-parallel ranks are borrowed from the data-parallel shard, context-parallel "
                "and tensor-parallel ranks; choose an ep that divides it."
            )
    return errors


def compile_errors(layout: Layout) -> list[str]:
    """Layouts that ``training.compile`` cannot run on the installed torch, refused before the first step (measured
    on CPU; docs/profiling.md, Appendix A.5). FSDP, TP, EP, CP and every pipeline schedule compile on 2.13-2.15
    (mesh/parallelize.py, step 4); torch 2.11 cannot split a compiled backward for the zero-bubble schedules."""
    if not layout.compile:
        return []
    schedule = layout.pp_schedule
    if layout.dims.pp > 1 and SCHEDULE_FAMILIES[schedule].zero_bubble and not splits_compiled_backward():
        return [
            f"training.compile=true with parallel.pp_schedule={schedule}: this torch's pipelining computes a "
            "zero-bubble weight-gradient pass from output 0 of each autograd node only, which a compiled block's "
            "backward refuses (torch 2.13 reads every output); upgrade torch to 2.13 or later, pick a schedule "
            "without a split backward (1F1B, Interleaved1F1B), or set training.compile=false."
        ]
    return []


def batch_errors(dims: ParallelDims, batch: BatchSplit) -> list[str]:
    """Rule 7: the global batch splits evenly into dp ranks and then into micro-batches."""
    if batch.local is None:
        return [
            f"training.global_batch={batch.global_batch} is not divisible by the data-parallel degree "
            f"dp_replicate*dp_shard={dims.dp}; use a multiple of {dims.dp}."
        ]
    if batch.micro is None:
        return [
            f"training.micro_batch={batch.requested_micro} does not divide the per-rank batch {batch.local} "
            f"(global_batch {batch.global_batch} / dp {dims.dp}); use a divisor of {batch.local} or 0 for all of it."
        ]
    return []


def saver_errors(layout: Layout, batch: BatchSplit) -> list[str]:
    """Every gradient-sync, compression and offload setting that cannot work on this layout (the batch: how many
    forward/backward calls a step accumulates, None when it does not split)."""
    dims, p, t, accumulation = layout.dims, layout, layout, batch.accumulation
    errors: list[str] = []
    accumulates = accumulation is not None and accumulation > 1
    if p.grad_sync == "step" and dims.pp > 1 and accumulates:
        errors.append(
            f"parallel.grad_sync=step with parallel.pp={dims.pp} and {accumulation} accumulated micro-batches "
            f"(training.micro_batch={batch.requested_micro}): the pipeline schedule reduces gradients at the end of each "
            "of its steps and cannot defer that; set training.micro_batch=0 and raise parallel.pp_microbatches "
            "instead (the schedule accumulates its micro-batches without reducing), or grad_sync=microbatch."
        )
    if p.grad_compression != "none" and dims.dp == 1:
        errors.append(
            f"parallel.grad_compression={p.grad_compression} compresses the data-parallel gradient reduction, "
            "but this layout has none (dp_replicate*dp_shard=1); set it to none or add data-parallel ranks."
        )
    if p.grad_compression == "powersgd":
        if dims.dp_replicate != dims.world_size:
            errors.append(
                f"parallel.grad_compression=powersgd needs a pure data-parallel layout (every rank a whole "
                f"replica: dp_replicate = world size), not {dims.describe()}: PowerSGD factors each whole gradient "
                "matrix, which a sharded layout never holds; set parallel.dp_replicate to the world size and "
                "parallel.dp_shard=1, or use grad_compression=bf16 on this layout."
            )
        if accumulates and p.grad_sync != "step":
            errors.append(
                f"parallel.grad_compression=powersgd with {accumulation} accumulated micro-batches needs "
                "parallel.grad_sync=step: each reduction must compress one step's whole local gradient (reducing "
                "every micro-batch would compress, and sum, already-reduced gradients again)."
            )
        if t.mixed_precision != "fp32":
            errors.append(
                f"parallel.grad_compression=powersgd with training.mixed_precision={t.mixed_precision}: meshloom's "
                "bf16 lives in FSDP's MixedPrecisionPolicy, which PowerSGD's replicated (DDP) model does not use; "
                "set training.mixed_precision=fp32, or use grad_compression=bf16."
            )
        if p.fsdp_cpu_offload:
            errors.append(
                "parallel.fsdp_cpu_offload=true with parallel.grad_compression=powersgd: offloading is FSDP's, and "
                "PowerSGD runs on a replicated (DDP) model without FSDP; turn one of them off."
            )
    if p.grad_compression == "onebit_adam" and dims.dp > 1:
        errors += onebit_adam_errors(layout)
    return errors


def onebit_adam_errors(layout: Layout) -> list[str]:
    """1-bit Adam (savers/onebit_adam.py) compresses the momentum of whole, replicated parameters: each rank must
    hold every parameter and its whole Adam state (one reason per broken field)."""
    dims = layout.dims
    why = "parallel.grad_compression=onebit_adam compresses the momentum of whole replicated parameters"
    errors = []
    if dims.dp_shard > 1:
        errors.append(
            f"{why}, but parallel.dp_shard={dims.dp_shard} shards the parameters and Adam states with FSDP "
            "(no rank holds a whole momentum to compress); set parallel.dp_replicate to the data-parallel degree "
            "and parallel.dp_shard=1, or use grad_compression=bf16 with sharding."
        )
    for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp)):
        if degree > 1:
            errors.append(
                f"{why}, but parallel.{name}={degree} splits the model across ranks, which 1-bit Adam's plain "
                f"replicated model does not support; set parallel.{name}=1 (a pure data-parallel layout)."
            )
    if layout.mixed_precision != "fp32":
        errors.append(
            f"parallel.grad_compression=onebit_adam with training.mixed_precision={layout.mixed_precision}: meshloom's "
            "bf16 lives in FSDP's MixedPrecisionPolicy, which 1-bit Adam's replicated model does not use; set "
            "training.mixed_precision=fp32."
        )
    if layout.fsdp_cpu_offload:
        errors.append(
            "parallel.fsdp_cpu_offload=true with parallel.grad_compression=onebit_adam: offloading is FSDP's, and "
            "1-bit Adam runs on a replicated model without FSDP; turn one of them off."
        )
    return errors


# ---- memory: the estimate against the machine ---------------------------------------------------------------
# Refuse only when the estimate exceeds what one rank may use by this factor. The estimate leaves out the
# CUDA context, kernels' workspaces, communication buffers and the allocator's fragmentation (so a run needs
# somewhat more), but it also counts peaks that a particular run may not reach together: a layout this close
# to the limit is left to try, while one that cannot fit (a model 10x or 1000x too large) stops in seconds.
MEMORY_MARGIN = 1.5
GIB = 2**30


def peak_rank_memory(args: ModelArgs, layout: Layout, stage_layers, pp_schedule: str | None) -> RankMemory:
    """The estimate of the pipeline rank that holds the most (every rank computes the same number, so every
    rank reaches the same verdict without a collective)."""
    n_stages, pp = len(stage_layers), layout.pp
    if pp == 1:
        return rank_memory(args, layout, stage_layers, 0, (0,))
    n_local = n_stages // pp
    ranks = [
        rank_memory(args, layout, stage_layers, r, stage_ids_of_rank(r, pp, n_local, pp_schedule)) for r in range(pp)
    ]
    return max(ranks, key=lambda memory: memory.total)


def check_memory(plan, budget: tuple[int, str] | None) -> None:
    """Raise a ConfigError when the busiest rank's estimate exceeds ``budget`` (bytes, and whose) by ``MEMORY_MARGIN``,
    naming what would fit: an FSDP degree, full activation checkpointing, the most layers."""
    if budget is None:
        return  # the machine does not say how much memory it has
    limit, where = budget
    layout = plan.layout
    args, stages = plan.model, [list(layers) for layers in plan.stage_layers]
    peak = peak_rank_memory(args, layout, stages, layout.pp_schedule)
    if peak.total <= MEMORY_MARGIN * limit:
        return

    def fits(model_args: ModelArgs, with_layout: Layout, stage_layers) -> bool:
        return peak_rank_memory(model_args, with_layout, stage_layers, layout.pp_schedule).total <= limit

    def even(n_layers: int) -> list[list[int]]:
        return even_stage_layers(n_layers, len(stages))

    d, m, options = plan.dims, plan.model_config, []

    def sharded(n: int, checkpoint: str = layout.activation_checkpoint) -> Layout:
        """This layout with FSDP over n shards: the states split n ways, and each rank's share of the global
        batch shrinks with the data-parallel degree (down to one sequence)."""
        sequences = max(1, layout.sequences_per_microbatch * d.dp_shard // n)
        return dataclasses.replace(
            layout, dp_shard=n, fsdp=True, sequences_per_microbatch=sequences, activation_checkpoint=checkpoint
        )

    for checkpoint in dict.fromkeys([layout.activation_checkpoint, "full"]):  # this AC mode first, then full
        more = next(
            (n for n in (d.dp_shard * 2**k for k in range(1, 21)) if fits(args, sharded(n, checkpoint), stages)), None
        )
        if more is not None:
            with_ac = " with training.activation_checkpoint=full" if checkpoint != layout.activation_checkpoint else ""
            processes = d.world_size // d.dp_shard * more
            options.append(f"parallel.dp_shard={more}{with_ac} ({processes} processes, each with this much memory)")
            break
    if layout.activation_checkpoint != "full" and fits(
        args, dataclasses.replace(layout, activation_checkpoint="full"), stages
    ):
        options.append("training.activation_checkpoint=full")
    layers = largest(len(stages), m.n_layers - 1, lambda n: fits(replace_model(args, n_layers=n), layout, even(n)))
    if layers is not None:
        options.append(f"model.n_layers={layers} on this layout")
    else:  # not even one layer per stage: a narrower model (dim a multiple of 2 x n_heads: even head_dim)
        step = 2 * m.n_heads
        width = largest(1, m.dim // step - 1, lambda k: fits(replace_model(args, dim=k * step), layout, stages))
        if width is not None:
            options.append(f"model.dim={width * step} with these {m.n_layers} layers, on this layout")
    size = f"model.dim={m.dim}, model.n_layers={m.n_layers}, model.vocab_size={m.vocab_size}"
    size += f", model.n_experts={m.n_experts}" if m.n_experts else ""
    raise ConfigError(
        f"the model does not fit in memory: {size} ({args.num_params():,} parameters) needs about "
        f"{peak.total / GIB:,.1f} GiB on its busiest rank (states {peak.states / GIB:,.1f}, gathered weights "
        f"{peak.gathered / GIB:,.1f}, activations {peak.activations / GIB:,.1f}, logits {peak.logits / GIB:,.1f}; "
        f"planning/memory_estimate.py), more than {MEMORY_MARGIN:g}x the {limit / GIB:,.1f} GiB {where}. Would fit: "
        + ("; ".join(options) if options else "no FSDP degree and no depth of this width: lower model.dim")
        + ". Or set --run.memory_check false to try anyway."
    )


def largest(lo: int, hi: int, fits) -> int | None:
    """The largest n in [lo, hi] with ``fits(n)``, for a ``fits`` that holds up to some n and not beyond it
    (memory grows with the model's size): a binary search, about log2(hi - lo) estimates."""
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    return found


def replace_model(args: ModelArgs, **sizes) -> ModelArgs:
    """``args`` with other sizes (a copy; an explicit ffn_dim stays as it was, a derived one follows dim)."""
    return dataclasses.replace(args, **sizes)
