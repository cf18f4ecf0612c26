"""The layout plan: every number that follows from (config, world size, rank), worked out once.

``LayoutPlan.resolve`` runs on every rank before any process group exists:

1. Resolve the degrees (``ParallelDims.resolve``) and the model's shapes (``config.model_args``).
2. Derive the batch arithmetic: global batch = micro-batch x dp x accumulation. The local batch is
   global_batch / dp sequences per step; without pipelining the loop runs ``accumulation`` forward/backward
   passes of ``micro_batch`` sequences, with pipelining the schedule splits the local batch into
   ``pp_microbatches`` pieces itself. Context parallelism consumes no batch: the cp ranks of one dp rank
   split each of its sequences (``context_parallel_errors`` holds cp's rules).
3. Derive the pipeline: stages per rank (1, or 2 for looped and V schedules), the number of stages, the
   layers of each stage (``pp_split``) and this rank's stage ids.
4. Check every rule against the world size, the model and the batch (``layout_errors``), and raise one
   ConfigError listing each broken rule with its field, value and fix. The same text on every rank,
   before any collective could hang.

Everything else (train.py, the checkpoint metadata, the pipeline timeline) reads these fields instead of
recomputing them. Two names to keep apart: ``micro_batch`` is the number of *sequences* one call of the
training loop's forward/backward takes (``accumulation`` such calls per step); ``pp_microbatches`` is how
many *pieces* the pipeline schedule cuts each of those calls into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mesh.comm_memory_savers import saver_errors
from mesh.dims import ParallelDims
from mesh.pipeline import default_microbatches, pipeline_errors, split_layers, stage_ids_of_rank, stages_per_rank
from runtime.config import Config, ConfigError, model_args

if TYPE_CHECKING:
    from models.llama import ModelArgs


@dataclass(frozen=True)
class LayoutPlan:
    dims: ParallelDims
    model: ModelArgs
    rank: int
    seq_len: int
    global_batch: int  # sequences per optimizer step, whole world
    local_batch: int  # sequences per step on one data-parallel rank
    micro_batch: int  # sequences per forward call of the training loop
    accumulation: int  # forward/backward calls per step (the pipeline schedule splits each call further)
    pp_schedule: str | None  # None without pipelining
    stages_per_rank: int
    n_stages: int
    pp_microbatches: int  # micro-batches the schedule splits each local batch into (1 without pipelining)
    stage_layers: tuple[tuple[int, ...], ...]  # layer ids of every stage
    stage_ids: tuple[int, ...]  # the stages this rank runs
    fsdp: bool  # whether FSDP2 wraps the model (train.parallelize)

    @property
    def global_tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def pp_rank(self) -> int:
        return self.dims.pp_rank_of(self.rank)

    @classmethod
    def resolve(cls, cfg: Config, world_size: int, rank: int = 0) -> LayoutPlan:
        """Steps 1-4 of the module docstring; raises ConfigError on a misfit."""
        dims = ParallelDims.resolve(cfg, world_size)
        args = model_args(cfg)
        p, t = cfg.parallel, cfg.training
        n_local = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank) if dims.pp > 1 else 1
        microbatches = (p.pp_microbatches or default_microbatches(dims.pp * n_local)) if dims.pp > 1 else 1
        errors = layout_errors(dims, cfg, args, n_local, microbatches)
        if errors:
            raise ConfigError(f"the parallel layout ({dims.describe()}) does not fit:\n  - " + "\n  - ".join(errors))
        local_batch = t.global_batch // dims.dp
        micro_batch = t.micro_batch or local_batch
        n_stages = dims.pp * n_local
        layers = split_layers(args, n_stages, p.pp_split, t.seq_len) if dims.pp > 1 else [list(range(args.n_layers))]
        stage_ids = stage_ids_of_rank(dims.pp_rank_of(rank), dims.pp, n_local, p.pp_schedule) if dims.pp > 1 else [0]
        return cls(
            dims=dims,
            model=args,
            rank=rank,
            seq_len=t.seq_len,
            global_batch=t.global_batch,
            local_batch=local_batch,
            micro_batch=micro_batch,
            accumulation=local_batch // micro_batch,
            pp_schedule=p.pp_schedule if dims.pp > 1 else None,
            stages_per_rank=n_local,
            n_stages=n_stages,
            pp_microbatches=microbatches,
            stage_layers=tuple(tuple(ls) for ls in layers),
            stage_ids=tuple(stage_ids),
            fsdp=uses_fsdp(dims, cfg),
        )

    def batch_line(self) -> str:
        cp = f" ({self.seq_len // self.dims.cp} per cp rank)" if self.dims.cp > 1 else ""
        return (
            f"global {self.global_batch} = micro {self.micro_batch} x dp {self.dims.dp} x accumulation "
            f"{self.accumulation}; seq_len {self.seq_len}{cp}; {self.global_tokens:,} tokens/step"
        )

    def banner(self, mesh_lines: str, local_params: int, device, precision: str, data: str) -> str:
        """What rank 0 prints at start: the layout, each mesh dim with its coordinate, parameters, batch, data."""
        stages = f"; pipeline stages {list(self.stage_ids)} of {self.n_stages} on rank 0" if self.dims.pp > 1 else ""
        return (
            f"meshloom | world {self.dims.world_size} | {self.dims.describe()} | device {device} | {precision}\n"
            f"{mesh_lines}\n"
            f"  parameters    {self.model.num_params():,} total, {local_params:,} on rank 0{stages}\n"
            f"  batch         {self.batch_line()}\n"
            f"  data          {data}"
        )


def uses_fsdp(dims: ParallelDims, cfg: Config) -> bool:
    """FSDP whenever there is data or context parallelism (both need their gradients summed), and also for bf16
    or CPU offload on one rank: its policies are where bf16 compute with fp32 master weights and fp32 gradient
    reduction, and offloading, live. Not with PowerSGD, whose layouts are replicated with DDP (mesh/comm_memory_savers.py)."""
    p = cfg.parallel
    if p.grad_compression == "powersgd":
        return False
    return dims.dp > 1 or dims.cp > 1 or cfg.training.mixed_precision == "bf16" or p.fsdp_cpu_offload


def layout_errors(dims: ParallelDims, cfg: Config, model: ModelArgs, n_local: int, microbatches: int) -> list[str]:
    """Every rule the layout breaks, as messages naming the field, the value and the fix."""
    errors: list[str] = []
    t = cfg.training
    product = dims.pp * dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp
    if product != dims.world_size:
        cp, cp_value = ("*cp", f"*{dims.cp}") if dims.cp > 1 else ("", "")
        errors.append(
            f"pp*dp_replicate*dp_shard{cp}*tp = {dims.pp}*{dims.dp_replicate}*{dims.dp_shard}{cp_value}*{dims.tp} = "
            f"{product} but WORLD_SIZE={dims.world_size}; make the product equal the number of processes "
            f"(or set parallel.dp_shard=-1 to take the rest)."
        )

    # The model must split evenly across tensor-parallel ranks.
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
    if dims.tp > 1 and cfg.parallel.sequence_parallel and dims.cp == 1 and t.seq_len % dims.tp:
        errors.append(
            f"training.seq_len={t.seq_len} is not divisible by parallel.tp={dims.tp}, which sequence "
            "parallelism needs; change seq_len or set parallel.sequence_parallel=false."
        )
    elif (
        dims.tp > 1
        and model.moe is not None
        and (t.seq_len // dims.cp) % dims.tp
        # with cp, a seq_len that breaks 2*cp, or SP's own per-cp-rank rule, is reported once, below
        and not (dims.cp > 1 and (t.seq_len % (2 * dims.cp) or cfg.parallel.sequence_parallel))
    ):
        errors.append(
            f"training.seq_len={t.seq_len}"
            + (f" (per cp rank: {t.seq_len // dims.cp})" if dims.cp > 1 else "")
            + " is not divisible by "
            f"parallel.tp={dims.tp}: under TP each tp rank runs the MoE layers on its own chunk of every sequence "
            "(mesh/tensor_parallel.TokenSplitMoE); change seq_len."
        )
    errors += context_parallel_errors(dims, cfg)

    # Pipeline and expert degrees against the model.
    if dims.pp > 1:
        p = cfg.parallel
        # The per-rank batch is unknown while global_batch % dp is broken (reported below); check the rest.
        local_batch = None if t.global_batch % dims.dp else (t.micro_batch or t.global_batch // dims.dp)
        errors += pipeline_errors(
            dims.pp, p.pp_schedule, n_local, microbatches, local_batch, p.pp_split, model.n_layers, compiled=t.compile
        )
    m = cfg.model
    if m.n_experts and not 1 <= m.top_k <= m.n_experts:
        errors.append(f"model.top_k={m.top_k} must be between 1 and model.n_experts={m.n_experts}.")
    if dims.ep > 1:
        if m.n_experts == 0:
            errors.append(f"parallel.ep={dims.ep} needs an MoE model; set model.n_experts or parallel.ep=1.")
        elif m.n_experts % dims.ep:
            errors.append(
                f"parallel.ep={dims.ep} does not divide model.n_experts={m.n_experts}; each ep rank must own "
                "the same number of experts: choose an ep that divides n_experts."
            )
        if dims.dp_shard % dims.ep:
            errors.append(
                f"parallel.ep={dims.ep} must divide parallel.dp_shard={dims.dp_shard}: expert-parallel ranks are "
                "carved from the data-parallel shard ranks."
            )

    if t.compile:
        errors += compile_errors(dims)

    # The batch must split evenly: global = micro x dp x accumulation.
    if t.global_batch % dims.dp:
        errors.append(
            f"training.global_batch={t.global_batch} is not divisible by the data-parallel degree "
            f"dp_replicate*dp_shard={dims.dp}; use a multiple of {dims.dp}."
        )
    else:
        local = t.global_batch // dims.dp
        if t.micro_batch < 0 or (t.micro_batch and local % t.micro_batch):
            errors.append(
                f"training.micro_batch={t.micro_batch} does not divide the per-rank batch {local} "
                f"(global_batch {t.global_batch} / dp {dims.dp}); use a divisor of {local} or 0 for all of it."
            )
    # Gradient-sync, compression and offload settings against the layout (mesh/comm_memory_savers.py).
    local = None if t.global_batch % dims.dp else t.global_batch // dims.dp
    micro_ok = local is not None and t.micro_batch >= 0 and not (t.micro_batch and local % t.micro_batch)
    errors += saver_errors(dims, cfg, local // (t.micro_batch or local) if micro_ok else None)
    if t.seq_len > model.max_seq_len:
        errors.append(
            f"training.seq_len={t.seq_len} exceeds model.max_seq_len={model.max_seq_len}; raise "
            "model.max_seq_len or shorten training.seq_len."
        )
    return errors


def context_parallel_errors(dims: ParallelDims, cfg: Config) -> list[str]:
    """The rules of context parallelism (mesh/context_parallel.py), as messages naming the field and the fix."""
    if dims.cp == 1:
        return []
    errors: list[str] = []
    t, m = cfg.training, cfg.model
    if t.seq_len % (2 * dims.cp):
        errors.append(
            f"training.seq_len={t.seq_len} is not divisible by 2*parallel.cp={2 * dims.cp}: each cp rank holds two "
            f"equal chunks of every sequence (chunks r and 2cp-1-r, for the causal load balance); use a multiple "
            f"of {2 * dims.cp} or another parallel.cp."
        )
    elif dims.tp > 1 and cfg.parallel.sequence_parallel and (t.seq_len // dims.cp) % dims.tp:
        errors.append(
            f"training.seq_len={t.seq_len} / parallel.cp={dims.cp} = {t.seq_len // dims.cp} tokens per cp rank, "
            f"not divisible by parallel.tp={dims.tp}, which sequence parallelism needs; make seq_len a multiple of "
            f"cp*tp={dims.cp * dims.tp} (and of 2*cp) or set parallel.sequence_parallel=false."
        )
    if dims.ep > 1:
        errors.append(
            f"parallel.ep={dims.ep} with parallel.cp={dims.cp} is not supported: expert weights would be sharded over "
            "ep and FSDP-sharded over the dp_shard ranks outside ep times cp, a set of mesh dims with ep in between "
            "that DTensor cannot reduce over; use parallel.ep=1 (experts FSDP-sharded over dp_shard x cp) or "
            "parallel.cp=1."
        )
    if m.n_experts and m.moe_aux_loss_coef > 0:
        errors.append(
            f"model.moe_aux_loss_coef={m.moe_aux_loss_coef} with parallel.cp={dims.cp}: the auxiliary loss is computed "
            "per whole sequence, and a cp rank holds only part of each; set model.moe_aux_loss_coef=0 (the "
            "aux-loss-free bias, model.moe_bias_update_rate, works with cp) or parallel.cp=1."
        )
    if m.n_experts and m.moe_capacity_factor > 0:
        errors.append(
            f"model.moe_capacity_factor={m.moe_capacity_factor} with parallel.cp={dims.cp}: expert capacity is counted "
            "per whole sequence, and a cp rank holds only part of each; set model.moe_capacity_factor=0 "
            "(dropless) or parallel.cp=1."
        )
    return errors


def compile_errors(dims: ParallelDims) -> list[str]:
    """Layouts that ``training.compile`` cannot run in torch 2.13 (measured on CPU; docs/profiling.md, section 8.5).

    Each failed at its first step with the error quoted; they are refused here so that no run gets that far.
    (Zero-bubble pipeline schedules are refused in mesh/pipeline.py, ``parallel.sp_regather`` in runtime/config.py.)
    """
    errors = []
    if dims.tp > 1:
        errors.append(
            f"training.compile=true with parallel.tp={dims.tp}: in torch 2.13 the backward of a DTensor "
            "redistribution outside the compiled blocks receives a plain tensor from them and fails "
            "(\"AttributeError: 'Tensor' object has no attribute '_local_tensor'\"); run TP layouts eagerly "
            "(training.compile=false)."
        )
    if dims.ep > 1:
        errors.append(
            f"training.compile=true with parallel.ep={dims.ep}: dynamo resumes the experts' forward after the graph "
            'break at the token counts with the expert weights still DTensors ("aten.mm.default got mixed '
            'torch.Tensor and DTensor"); run EP layouts eagerly (training.compile=false).'
        )
    return errors
