"""The layout plan: every number that follows from (config, world size, rank), worked out once.

``LayoutPlan.resolve`` runs on every rank before any process group exists:

1. Check every field against its range (runtime/config.py: ``check_values``), with the model the run trains
   (the config's [model], or the one a transformers folder gives: checkpoint/hf_folder.py, ``folder_model``)
   and its steps (``training.steps``, or what ``training.epochs`` makes of the data), then the model's shapes
   (``model_args``).
2. Derive the batch arithmetic: global batch = micro-batch x dp x accumulation. The local batch is
   global_batch / dp sequences per step; without pipelining the loop runs ``accumulation`` forward/backward
   passes of ``micro_batch`` sequences, with pipelining the schedule splits the local batch into
   ``pp_microbatches`` pieces itself (planning/layout_rules.py: ``batch_split``). Context parallelism consumes
   no batch: the cp ranks of one dp rank split each of its sequences.
3. Make the layout (planning/layout.py: ``Layout.from_config``): the degrees, stages per rank (1, or 2 for
   looped and V schedules), the schedule's micro-batches, the precision ``auto`` resolves to, whether FSDP
   wraps the model.
4. Check every rule against the world size, the model and the batch (planning/layout_rules.py:
   ``layout_errors``), and raise one ConfigError listing each broken rule with its field, value and fix.
   The same text on every rank, before any collective could hang.
5. Derive the pipeline: the layers of each stage (``pp_split``) and this rank's stage ids.

The config is never written: what the run derives lives here. Everything else (train.py, the checkpoint
metadata, the pipeline timeline) reads these fields instead of recomputing them. Two names to keep apart:
``micro_batch`` is the number of *sequences* one call of the training loop's forward/backward takes
(``accumulation`` such calls per step); ``pp_microbatches`` is how many *pieces* the pipeline schedule cuts each
of those calls into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mesh.pipeline import StageShapes, stage_ids_of_rank
from planning.layout import Layout
from planning.layout_rules import batch_split, layout_errors
from planning.pipeline_split import split_layers
from runtime.config import ConfigError, check_values, model_args
from runtime.process import device_type_of

if TYPE_CHECKING:
    from mesh.dims import ParallelDims
    from models.llama import ModelArgs
    from runtime.schema import Config, ModelConfig


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout  # the degrees and how a step runs on them (planning/layout.py)
    model: ModelArgs
    model_config: ModelConfig  # the [model] section the run trains: the config's, or a transformers folder's
    rank: int
    steps: int  # optimizer steps in total: training.steps, or what training.epochs makes of the data
    global_batch: int  # sequences per optimizer step, whole world
    local_batch: int  # sequences per step on one data-parallel rank
    micro_batch: int  # sequences per forward call of the training loop
    accumulation: int  # forward/backward calls per step (the pipeline schedule splits each call further)
    stage_ids: tuple[int, ...]  # the stages this rank runs

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    @property
    def stage_layers(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.stage_layers

    @property
    def global_tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def pp_rank(self) -> int:
        return self.dims.pp_rank_of(self.rank)

    @classmethod
    def resolve(
        cls,
        cfg: Config,
        world_size: int,
        rank: int = 0,
        *,
        model_config: ModelConfig | None = None,
        steps: int | None = None,
        device_type: str | None = None,
    ) -> LayoutPlan:
        """Steps 1-5 of the module docstring; raises ConfigError on a misfit. ``model_config``: a transformers
        folder's [model] (checkpoint/hf_folder.py: ``folder_model``); ``steps``: from training.epochs
        (data/dataset.py: ``epoch_steps``); ``device_type``: the device kind ``mixed_precision = auto`` resolves
        for (default: this machine's). The config itself is never written."""
        model_config = model_config or cfg.model
        steps = steps or cfg.training.steps
        check_values(cfg, model_config, steps)  # every field in its range first: the rules below assume it
        t = cfg.training
        args = model_args(cfg, model_config)
        batch = batch_split(t.global_batch, Layout.resolve_dims(cfg, world_size).dp, t.micro_batch)
        layout = Layout.from_config(cfg, world_size, args, device_type or device_type_of(t.device), batch.micro or 1)
        dims = layout.dims
        errors = layout_errors(layout, args, batch, requested_dp_shard=cfg.parallel.dp_shard)
        if errors:
            raise ConfigError(f"the parallel layout ({dims.describe()}) does not fit:\n  - " + "\n  - ".join(errors))
        if dims.pp > 1:
            layers = split_layers(args, layout.n_stages, layout.pp_split, t.seq_len, layout)
            stage_ids = stage_ids_of_rank(dims.pp_rank_of(rank), dims.pp, layout.stages_per_rank, layout.pp_schedule)
        else:
            layers, stage_ids = [list(range(args.n_layers))], [0]
        return cls(
            layout=layout.replace(stage_layers=tuple(tuple(ls) for ls in layers)),
            model=args,
            model_config=model_config,
            rank=rank,
            steps=steps,
            global_batch=t.global_batch,
            local_batch=batch.local,
            micro_batch=batch.micro,
            accumulation=batch.accumulation,
            stage_ids=tuple(stage_ids),
        )

    def stage_shapes(self, tp_mesh) -> StageShapes:
        """What flows between this rank's pipeline stages (mesh/pipeline.py: static stage metadata)."""
        tp, layout = self.dims.tp, self.layout
        return StageShapes(
            microbatch=self.micro_batch // layout.pp_microbatches,
            seq=self.seq_len // self.dims.cp,
            dim=self.model.dim,
            vocab=self.model.vocab_size,
            dtype=torch.bfloat16 if layout.mixed_precision == "bf16" else torch.float32,
            sequence_split=tp if layout.sp else 1,
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
        stages = (
            f"; pipeline stages {list(self.stage_ids)} of {self.layout.n_stages} on rank 0" if self.dims.pp > 1 else ""
        )
        return (
            f"meshloom | world {self.dims.world_size} | {self.dims.describe()} | device {device} | {precision}\n"
            f"{mesh_lines}\n"
            f"  parameters    {self.model.num_params():,} total, {local_params:,} on rank 0{stages}\n"
            + (f"  pipeline      {self.layout.pp_schedule}, {self.split_line()}\n" if self.dims.pp > 1 else "")
            + f"  batch         {self.batch_line()}\n"
            f"  data          {data}"
        )
