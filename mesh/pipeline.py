"""Pipeline parallelism with torch.distributed.pipelining: split the model into stages, run a schedule.

1. **Split.** The layers are cut into ``S = pp x stages_per_rank`` contiguous stages; the embedding goes
   with the first stage, the final norm and head with the last. ``parallel.pp_split`` picks the cut:
   ``params`` balances parameter counts, ``flops`` balances per-token FLOPs (the embedding lookup is free,
   the head is a big matmul, attention adds its seq_len term), ``memory`` balances each pipeline rank's
   peak memory (``memory_split``: states plus activations times the micro-batches in flight under the
   schedule), or an explicit list of layers per stage such as ``"3,5"``. Each stage is the original
   ``Transformer`` with the other layers deleted, so every parameter keeps its original name.
2. **Place.** Stage s lives on pp rank ``s % pp`` for looped schedules (Interleaved1F1B, LoopedBFS,
   InterleavedZeroBubble: rank r holds stages r, r+pp, ...), and on ranks 0, 1, ..., pp-1, pp-1, ..., 0 for
   the V-shaped ones (ZBVZeroBubble, DualPipeV: rank r holds stages r and 2pp-1-r, so the first and the
   last stage share rank 0). GPipe and 1F1B have one stage per rank.
3. **Parallelize.** Each stage module is then parallelized like a whole model: TP over ``tp``, FSDP over
   the data-parallel dims (mesh/parallelize.py: build_model_parts), giving the 3-D layout pp x dp x tp.
4. **Schedule.** ``PipelineStage`` wraps each stage with the pp process group and static metadata from the plan
   (``StageShapes``: what the stage receives and sends, so the first step infers no shapes and exchanges no
   metadata); the schedule splits each
   local batch into ``pp_microbatches`` micro-batches and orders their forward (F), backward (B, or I and
   W when zero-bubble schedules split it into input- and weight-gradient halves) and point-to-point
   sends. The loss function returns each micro-batch's token-loss sum divided by the *global* token count,
   and ``scale_grads=False`` stops the schedule from dividing by the micro-batch count again.

Everything a schedule needs is validated first (planning/layout_rules.py: ``pipeline_errors``), so a misfit fails
before any send.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from mesh.private_api import (
    after_shape_inference,
    no_warm_up_messages_to_self,
    static_stage_arguments,
    step_without_outputs,
)
from models.llama import ModelArgs, Transformer


@dataclass(frozen=True)
class ScheduleFamily:
    """What meshloom needs to know about one of torch's pipeline schedules."""

    placement: Literal["single", "looped", "v"]  # stages per rank and where they sit (step 2 above)
    zero_bubble: bool  # backward split into input- and weight-gradient halves (I and W)
    forward_only_eval: bool  # torch 2.13's ``schedule.eval`` works for it (training/evaluation.py, step 2)

    @property
    def natural_stages_per_rank(self) -> int:
        return 1 if self.placement == "single" else 2


# The one table of schedule families: the config lists the names a user may type (``PipelineSchedule``, checked
# against this table in planning/layout_rules.py), everything else (placement, validation, evaluation, the
# pictures) reads this.
SCHEDULE_FAMILIES: dict[str, ScheduleFamily] = {
    "GPipe": ScheduleFamily("single", zero_bubble=False, forward_only_eval=True),
    "1F1B": ScheduleFamily("single", zero_bubble=False, forward_only_eval=True),
    "Interleaved1F1B": ScheduleFamily("looped", zero_bubble=False, forward_only_eval=True),
    "LoopedBFS": ScheduleFamily("looped", zero_bubble=False, forward_only_eval=True),
    "InterleavedZeroBubble": ScheduleFamily("looped", zero_bubble=True, forward_only_eval=True),
    "ZBVZeroBubble": ScheduleFamily("v", zero_bubble=True, forward_only_eval=False),
    "DualPipeV": ScheduleFamily("v", zero_bubble=True, forward_only_eval=False),
}
SCHEDULES = tuple(SCHEDULE_FAMILIES)


def schedules_of(placement: str) -> tuple[str, ...]:
    """The schedule names of one placement ("single", "looped" or "v"), in the table's order."""
    return tuple(name for name, family in SCHEDULE_FAMILIES.items() if family.placement == placement)


def stages_per_rank(schedule: str, requested: int) -> int:
    """``requested``, or when it is 0 the schedule's natural count: 1 for GPipe/1F1B, 2 for looped and V."""
    if requested:
        return requested  # planning/layout_rules.py: pipeline_errors checks it against the schedule
    return SCHEDULE_FAMILIES[schedule].natural_stages_per_rank


def stage_ids_of_rank(pp_rank: int, pp: int, n_local: int, schedule: str) -> list[int]:
    """The global stage indices that pp rank ``pp_rank`` runs (see step 2 of the module docstring)."""
    if SCHEDULE_FAMILIES[schedule].placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(n_local)]


def default_microbatches(n_stages: int) -> int:
    """One micro-batch per stage: the fewest that every schedule accepts."""
    return n_stages


def build_stage_module(args: ModelArgs, layers: list[int], is_first: bool, is_last: bool) -> Transformer:
    """A meta-device Transformer holding only ``layers`` (and the embedding / head where it owns them)."""
    with torch.device("meta"):
        stage = Transformer(args)
    for key in list(stage.layers.keys()):
        if int(key) not in layers:
            del stage.layers[key]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    return stage


@dataclass(frozen=True)
class StageShapes:
    """What flows between stages, from the plan: micro-batches of ``seq`` tokens (seq_len / cp, / tp under SP) of width
    ``dim`` in ``dtype``, and the last stage's logits of ``vocab`` (vocab-sharded under TP)."""

    microbatch: int
    seq: int
    dim: int
    vocab: int
    dtype: torch.dtype
    sequence_split: int = 1  # tp under sequence parallelism, else 1
    tp_mesh: object = None  # the tp DeviceMesh when tp > 1

    def examples(self, is_first: bool, is_last: bool) -> dict:
        """Meta tensors shaped like the stage's inputs, outputs and their gradients (PipelineStage's static
        ``input_args``/``output_args``/``input_grads``/``output_grads``)."""
        hidden = torch.empty(
            self.microbatch, self.seq // self.sequence_split, self.dim, dtype=self.dtype, device="meta"
        )
        if is_first:
            inputs, input_grads = torch.empty(self.microbatch, self.seq, dtype=torch.long, device="meta"), None
        else:
            inputs, input_grads = hidden.requires_grad_(), hidden.detach()
        if not is_last:
            outputs = hidden.detach().requires_grad_()
        elif self.tp_mesh is None:
            outputs = torch.empty(self.microbatch, self.seq, self.vocab, dtype=self.dtype, device="meta")
        else:
            from torch.distributed.tensor import DTensor, Shard

            tp = self.tp_mesh.size()
            local = torch.empty(self.microbatch, self.seq, self.vocab // tp, dtype=self.dtype, device="meta")
            outputs = DTensor.from_local(local, self.tp_mesh, (Shard(2),), run_check=False)
        output_grads = outputs.detach()
        outputs = outputs.requires_grad_()
        return {"input_args": inputs, "output_args": outputs, "input_grads": input_grads, "output_grads": output_grads}


def forget_metadata_inference_statistics(stage: PipelineStage) -> None:
    """Reset the MoE load counters after torch's metadata inference (a real forward and backward on torch 2.13), so they
    count real micro-batches only."""

    def reset() -> None:
        for module in stage.submod.modules():
            if hasattr(module, "reset_stats"):
                module.reset_stats()

    after_shape_inference(stage, reset)


def build_pipeline_schedule(
    stage_modules: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    *,
    schedule: str,
    microbatches: int,
    pp_group,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shapes: StageShapes | None = None,
):
    """Wrap each local stage in a PipelineStage and build ``schedule``; ``shapes`` gives static metadata, so the first
    step runs no shape inference."""
    stages = [
        PipelineStage(
            module,
            stage_id,
            n_stages,
            device,
            group=pp_group,
            **(static_stage_arguments(shapes.examples(stage_id == 0, stage_id == n_stages - 1)) if shapes else {}),
        )
        for module, stage_id in zip(stage_modules, stage_ids, strict=True)
    ]
    for stage in stages:
        forget_metadata_inference_statistics(stage)
        no_warm_up_messages_to_self(stage)
    schedule_class = get_schedule_class(schedule)
    # scale_grads=False: loss_fn already divides by the global token count (see the module docstring).
    if SCHEDULE_FAMILIES[schedule].placement == "single":
        return schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages
    return schedule_class(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages


def run_schedule(
    schedule,
    stage_ids: list[int],
    n_stages: int,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    forward_only: bool,
    documents: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """One local batch through ``schedule`` (training and evaluation); returns the per-micro-batch losses (empty off the
    last stage). ``forward_only`` uses ``schedule.eval`` where it works."""
    losses: list[torch.Tensor] = []
    is_first, is_last = 0 in stage_ids, n_stages - 1 in stage_ids
    # training keeps no outputs: the last stage would otherwise hold every micro-batch's logits (and a merged copy)
    # until the next step, which nothing here reads (the losses come through ``losses``)
    run = schedule.eval if forward_only else step_without_outputs(schedule)
    # The loader's inputs and targets are slices of one (b, s + 1) window: torch 2.11 checks each micro-batch's
    # strides against those it inferred and refuses a slice, so the stages get dense tensors.
    inputs, targets = inputs.contiguous(), targets.contiguous()
    # Document positions (data/loader.py) go to *every* stage as a keyword argument, which the schedule splits
    # into micro-batches like the inputs: each stage's attention needs them, not only the first's.
    kwargs = {} if documents is None else {"documents": documents.contiguous()}
    if is_last:
        kwargs.update(target=targets, losses=losses)
    run(*((inputs,) if is_first else ()), **kwargs)
    return losses
