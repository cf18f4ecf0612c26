"""The layout plan: every number that follows from (config, world size, rank), worked out once.

``LayoutPlan.resolve`` runs on every rank before any process group exists:

1. Check every field against its range (runtime/config.py: ``check_values``), then resolve the degrees
   (``ParallelDims.resolve``) and the model's shapes (``model_args``).
2. Derive the batch arithmetic: global batch = micro-batch x dp x accumulation. The local batch is
   global_batch / dp sequences per step; without pipelining the loop runs ``accumulation`` forward/backward
   passes of ``micro_batch`` sequences, with pipelining the schedule splits the local batch into
   ``pp_microbatches`` pieces itself (planning/layout_rules.py: ``batch_split``). Context parallelism consumes
   no batch: the cp ranks of one dp rank split each of its sequences.
3. Derive the pipeline: stages per rank (1, or 2 for looped and V schedules), the number of stages, the
   layers of each stage (``pp_split``) and this rank's stage ids.
4. Check every rule against the world size, the model and the batch (planning/layout_rules.py:
   ``layout_errors``), and raise one ConfigError listing each broken rule with its field, value and fix.
   The same text on every rank, before any collective could hang.

Everything else (train.py, the checkpoint metadata, the pipeline timeline) reads these fields instead of
recomputing them. Two names to keep apart: ``micro_batch`` is the number of *sequences* one call of the
training loop's forward/backward takes (``accumulation`` such calls per step); ``pp_microbatches`` is how
many *pieces* the pipeline schedule cuts each of those calls into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mesh.dims import MESH_DIMS, ParallelDims
from mesh.pipeline import StageShapes, default_microbatches, stage_ids_of_rank, stages_per_rank
from planning.layout_rules import batch_split, layout_errors
from planning.memory_estimate import MemoryLayout
from planning.pipeline_split import split_layers
from runtime.config import Config, ConfigError, check_values, model_args
from runtime.process import choose_precision, device_type_of

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
    fsdp: bool  # whether FSDP2 wraps the model (mesh/parallelize.py)
    sequence_parallel: bool = True  # parallel.sequence_parallel (under tp > 1)
    mixed_precision: str = "fp32"  # training.mixed_precision: the compute dtype between pipeline stages

    @property
    def global_tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def pp_rank(self) -> int:
        return self.dims.pp_rank_of(self.rank)

    @classmethod
    def resolve(cls, cfg: Config, world_size: int, rank: int = 0) -> LayoutPlan:
        """Steps 1-4 of the module docstring; raises ConfigError on a misfit."""
        check_values(cfg)  # every field in its range first: the rules below assume it
        p, t = cfg.parallel, cfg.training
        # training.mixed_precision=auto becomes what this machine runs: bf16 on CUDA, fp32 on CPU
        t.mixed_precision = choose_precision(t.mixed_precision, device_type_of(t.device), p.grad_compression)
        degrees = {name: getattr(p, name) for name in (*MESH_DIMS, "ep")}
        dims = ParallelDims.resolve(world_size, **degrees)
        args = model_args(cfg)
        n_local = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank) if dims.pp > 1 else 1
        microbatches = (p.pp_microbatches or default_microbatches(dims.pp * n_local)) if dims.pp > 1 else 1
        batch = batch_split(t.global_batch, dims.dp, t.micro_batch)
        errors = layout_errors(dims, cfg, args, n_local, microbatches, batch)
        if errors:
            raise ConfigError(f"the parallel layout ({dims.describe()}) does not fit:\n  - " + "\n  - ".join(errors))
        n_stages = dims.pp * n_local
        fsdp = uses_fsdp(dims, cfg)
        memory = MemoryLayout.of_config(cfg, dims, batch.micro, microbatches, n_local, fsdp=fsdp)
        layers = (
            split_layers(args, n_stages, p.pp_split, t.seq_len, memory) if dims.pp > 1 else [list(range(args.n_layers))]
        )
        stage_ids = stage_ids_of_rank(dims.pp_rank_of(rank), dims.pp, n_local, p.pp_schedule) if dims.pp > 1 else [0]
        return cls(
            dims=dims,
            model=args,
            rank=rank,
            seq_len=t.seq_len,
            global_batch=t.global_batch,
            local_batch=batch.local,
            micro_batch=batch.micro,
            accumulation=batch.accumulation,
            pp_schedule=p.pp_schedule if dims.pp > 1 else None,
            stages_per_rank=n_local,
            n_stages=n_stages,
            pp_microbatches=microbatches,
            stage_layers=tuple(tuple(ls) for ls in layers),
            stage_ids=tuple(stage_ids),
            fsdp=fsdp,
            sequence_parallel=p.sequence_parallel,
            mixed_precision=t.mixed_precision,
        )

    def stage_shapes(self, tp_mesh) -> StageShapes:
        """What flows between this rank's pipeline stages (mesh/pipeline.py: static stage metadata)."""
        tp = self.dims.tp
        return StageShapes(
            microbatch=self.micro_batch // self.pp_microbatches,
            seq=self.seq_len // self.dims.cp,
            dim=self.model.dim,
            vocab=self.model.vocab_size,
            dtype=torch.bfloat16 if self.mixed_precision == "bf16" else torch.float32,
            sequence_split=tp if tp > 1 and self.sequence_parallel else 1,
            tp_mesh=tp_mesh if tp > 1 else None,
        )

    def batch_line(self) -> str:
        cp = f" ({self.seq_len // self.dims.cp} per cp rank)" if self.dims.cp > 1 else ""
        return (
            f"global {self.global_batch} = micro {self.micro_batch} x dp {self.dims.dp} x accumulation "
            f"{self.accumulation}; seq_len {self.seq_len}{cp}; {self.global_tokens:,} tokens/step"
        )

    def split_line(self) -> str:
        """The layer split, whatever ``parallel.pp_split`` chose it by: ``layers per stage 2,3,3``."""
        return "layers per stage " + ",".join(str(len(layers)) for layers in self.stage_layers)

    def banner(self, mesh_lines: str, local_params: int, device, precision: str, data: str) -> str:
        """What rank 0 prints at start: the layout, each mesh dim with its coordinate, parameters, batch, data."""
        stages = f"; pipeline stages {list(self.stage_ids)} of {self.n_stages} on rank 0" if self.dims.pp > 1 else ""
        return (
            f"meshloom | world {self.dims.world_size} | {self.dims.describe()} | device {device} | {precision}\n"
            f"{mesh_lines}\n"
            f"  parameters    {self.model.num_params():,} total, {local_params:,} on rank 0{stages}\n"
            + (f"  pipeline      {self.pp_schedule}, {self.split_line()}\n" if self.dims.pp > 1 else "")
            + f"  batch         {self.batch_line()}\n"
            f"  data          {data}"
        )


def uses_fsdp(dims: ParallelDims, cfg: Config) -> bool:
    """FSDP with data or context parallelism, bf16 or CPU offload (its policies hold them), and an MoE model under TP
    (it shards the router over the tp ranks); not with PowerSGD (DDP) or 1-bit Adam (exchanges momentum itself)."""
    p = cfg.parallel
    if p.grad_compression in ("powersgd", "onebit_adam"):  # a replicated model: DDP's, or a plain one
        return False
    moe_tp = cfg.model.n_experts > 0 and dims.tp > 1
    return dims.dp > 1 or dims.cp > 1 or cfg.training.mixed_precision == "bf16" or p.fsdp_cpu_offload or moe_tp
