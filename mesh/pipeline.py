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
4. **Schedule.** ``PipelineStage`` wraps each stage with the pp process group; the schedule splits each
   local batch into ``pp_microbatches`` micro-batches and orders their forward (F), backward (B, or I and
   W when zero-bubble schedules split it into input- and weight-gradient halves) and point-to-point
   sends. The loss function returns each micro-batch's token-loss sum divided by the *global* token count,
   and ``scale_grads=False`` stops the schedule from dividing by the micro-batch count again.

Everything a schedule needs is validated first (mesh/layout_rules.py: ``pipeline_errors``), so a misfit fails
before any send.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from mesh.memory_estimate import (
    MemoryLayout,
    block_parameters,
    chunks_in_flight,
    gathered_bytes,
    last_stage_held,
    layer_activation_bytes,
    logits_bytes,
    rank_memory,
    stage_parameters,
    states_bytes,
)
from mesh.private_api import after_shape_inference
from models.flops import head_flops_per_token, layer_flops_per_token
from models.llama import ModelArgs, Transformer
from runtime.config import PipelineSchedule


@dataclass(frozen=True)
class ScheduleFamily:
    """What meshloom needs to know about one of torch's pipeline schedules."""

    placement: Literal["single", "looped", "v"]  # stages per rank and where they sit (step 2 above)
    zero_bubble: bool  # backward split into input- and weight-gradient halves (I and W)
    forward_only_eval: bool  # torch 2.13's ``schedule.eval`` works for it (training/evaluation.py, step 2)

    @property
    def natural_stages_per_rank(self) -> int:
        return 1 if self.placement == "single" else 2


# The one table of schedule families: config lists the names a user may type (runtime/config.py:
# PipelineSchedule), everything else (stage placement, validation, evaluation, the pictures) reads this.
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
assert set(SCHEDULES) == set(typing.get_args(PipelineSchedule)), "runtime/config.py and SCHEDULE_FAMILIES disagree"


def schedules_of(placement: str) -> tuple[str, ...]:
    """The schedule names of one placement ("single", "looped" or "v"), in the table's order."""
    return tuple(name for name, family in SCHEDULE_FAMILIES.items() if family.placement == placement)


def stages_per_rank(schedule: str, requested: int) -> int:
    """``requested``, or when it is 0 the schedule's natural count: 1 for GPipe/1F1B, 2 for looped and V."""
    if requested:
        return requested  # mesh/layout_rules.py: pipeline_errors checks it against the schedule
    return SCHEDULE_FAMILIES[schedule].natural_stages_per_rank


def stage_ids_of_rank(pp_rank: int, pp: int, n_local: int, schedule: str) -> list[int]:
    """The global stage indices that pp rank ``pp_rank`` runs (see step 2 of the module docstring)."""
    if SCHEDULE_FAMILIES[schedule].placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(n_local)]


def default_microbatches(n_stages: int) -> int:
    """One micro-batch per stage: the fewest that every schedule accepts."""
    return n_stages


def layer_costs(args: ModelArgs, policy: str, seq_len: int) -> tuple[list[float], float, float]:
    """Cost of each layer, plus the extra cost of the first stage (embedding) and the last (norm + head).

    ``params``: each block's own parameter count (an MoE block counts every expert: they all sit in memory).
    ``flops``: each block's FLOPs per token from models/flops.py (an MoE block counts its active experts only),
    and the head's matmul on the last stage; the embedding lookup is free.
    """
    if policy == "params":
        head = args.vocab_size * args.dim
        return [float(args.layer_params(i)) for i in range(args.n_layers)], float(head), float(head + args.dim)
    layers = [float(layer_flops_per_token(args, i, seq_len)) for i in range(args.n_layers)]
    return layers, 0.0, float(head_flops_per_token(args))


def minmax_split(n_layers: int, n_stages: int, stage_cost: Callable[[int, int, int], float]) -> list[int]:
    """Layers per stage, contiguous, >= 1 each, minimising the largest ``stage_cost(s, i, j)`` (stage s holding
    layers i..j-1) by exact dynamic programming over the cut points."""
    n, inf = n_layers, float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], stage_cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    sizes, j = [], n
    for s in range(n_stages, 0, -1):
        sizes.append(j - cut[s][j])
        j = cut[s][j]
    return sizes[::-1]


def balanced_split(costs: list[float], first_extra: float, last_extra: float, n_stages: int) -> list[int]:
    """Layers per stage, contiguous, >= 1 each, minimising the most expensive stage (exact DP)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    return minmax_split(len(costs), n_stages, stage_cost)


def stages_of(sizes: list[int]) -> list[list[int]]:
    """Layer ids of each stage from the layers per stage."""
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(len(sizes))]


def rank_peaks(args: ModelArgs, layout: MemoryLayout, sizes: list[int], schedule: str) -> list[float]:
    """Each pipeline rank's estimated peak bytes (mesh/memory_estimate.py: rank_memory) under the split ``sizes``."""
    stages, pp = stages_of(sizes), layout.pp
    n_local = len(sizes) // pp
    return [rank_memory(args, layout, stages, r, stage_ids_of_rank(r, pp, n_local, schedule)).total for r in range(pp)]


def memory_split(args: ModelArgs, layout: MemoryLayout, n_stages: int, schedule: str) -> list[int]:
    """Layers per stage that make the pipeline ranks' peak memory as even as whole layers allow.

    A rank's peak (mesh/memory_estimate.py: ``rank_memory``) is its stages' states (weights, gradients, Adam
    after FSDP sharding) and FSDP-gathered weights, plus its chunks in flight under the schedule
    (``chunks_in_flight``: under 1F1B rank r holds pp - r micro-batches) times its mean chunk of activations
    (the per-layer bytes of the activation-memory chapter, under the run's activation checkpointing), the one
    block it rebuilds under checkpointing, and on the last stage the logits; the embedding counts on the
    first stage, the final norm and head on the last.

    1. Split each rank's peak into its stages' shares: a stage's states and gathered weights, its activations
       times (the rank's chunks in flight / stages per rank), its rebuilt block, and its embedding, head and
       logits. With one stage per rank (GPipe, 1F1B) the share is the rank's peak.
    2. Minimise the largest share over contiguous cuts (``minmax_split``, exact).
    3. With several stages per rank (looped and V schedules) a rank's peak is the sum of its stages' shares,
       which step 2 balances only stage by stage: move one cut by one layer at a time while the ranks' peaks,
       sorted from the largest, get lexicographically smaller (a local search that ends; with one stage per
       rank it changes nothing, step 2 being already optimal).
    """
    pp = layout.pp
    n_local = n_stages // pp
    owner = {s: r for r in range(pp) for s in stage_ids_of_rank(r, pp, n_local, schedule)}
    checkpointed = layout.activation_checkpoint != "none"
    fixed, acts, rebuilt = [], [], []
    for i in range(args.n_layers):
        fixed.append(
            states_bytes(args, layout, block_parameters(args, i)) + gathered_bytes(args, layout, [i], False, False)
        )
        acts.append(layer_activation_bytes(args, i, layout))
        rebuilt.append(layer_activation_bytes(args, i, layout, "none") - acts[-1] if checkpointed else 0.0)
    ends = {  # the embedding on the first stage; final norm, head and logits on the last
        "first": states_bytes(args, layout, stage_parameters(args, [], True, False))
        + gathered_bytes(args, layout, [], True, False),
        "last": states_bytes(args, layout, stage_parameters(args, [], False, True))
        + gathered_bytes(args, layout, [], False, True)
        + logits_bytes(args, layout, last_stage_held(layout)),
    }
    held = [chunks_in_flight(schedule, pp, r, layout.pp_microbatches, n_local) / n_local for r in range(pp)]

    def share(s: int, i: int, j: int) -> float:  # step 1
        cost = sum(fixed[i:j]) + held[owner[s]] * sum(acts[i:j]) + max(rebuilt[i:j])
        return cost + (ends["first"] if s == 0 else 0.0) + (ends["last"] if s == n_stages - 1 else 0.0)

    sizes = minmax_split(args.n_layers, n_stages, share)  # step 2
    if n_local == 1:
        return sizes
    score = sorted(rank_peaks(args, layout, sizes, schedule), reverse=True)
    improved = True
    while improved:  # step 3
        improved = False
        for k in range(n_stages - 1):
            for move in (1, -1):  # one layer from stage k + 1 to stage k, or back
                trial = list(sizes)
                trial[k], trial[k + 1] = trial[k] + move, trial[k + 1] - move
                if min(trial) < 1:
                    continue
                trial_score = sorted(rank_peaks(args, layout, trial, schedule), reverse=True)
                if trial_score < score:
                    sizes, score, improved = trial, trial_score, True
    return sizes


def split_layers(
    args: ModelArgs, n_stages: int, policy: str, seq_len: int, layout: MemoryLayout | None = None
) -> list[list[int]]:
    """Layer indices of each stage under ``policy`` (params | flops | memory | "n0,n1,..."); ``memory`` needs
    the ``layout`` whose peaks it balances."""
    if policy in ("params", "flops"):
        sizes = balanced_split(*layer_costs(args, policy, seq_len), n_stages)
    elif policy == "memory":
        if layout is None:
            raise ValueError("pp_split 'memory' needs the MemoryLayout whose ranks it balances")
        sizes = memory_split(args, layout, n_stages, layout.pp_schedule)
    else:
        sizes = [int(x) for x in policy.split(",")]
    return stages_of(sizes)


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


def forget_metadata_inference_statistics(stage: PipelineStage) -> None:
    """Reset the MoE load counters after torch's metadata inference, so they count real micro-batches only.

    In torch 2.13 a stage built without example inputs infers shapes on the first step by running one real
    forward and backward. Its routing would otherwise be counted in that step's expert load (and in the
    bias update).
    """

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
):
    """Wrap each local stage in a PipelineStage and build ``schedule`` over them."""
    stages = [
        PipelineStage(module, stage_id, n_stages, device, group=pp_group)
        for module, stage_id in zip(stage_modules, stage_ids, strict=True)
    ]
    for stage in stages:
        forget_metadata_inference_statistics(stage)
    schedule_class = get_schedule_class(schedule)
    # scale_grads=False: loss_fn already divides by the global token count (see the module docstring).
    if SCHEDULE_FAMILIES[schedule].placement == "single":
        return schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages
    return schedule_class(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages


def run_schedule(
    schedule, stage_ids: list[int], n_stages: int, inputs: torch.Tensor, targets: torch.Tensor, forward_only: bool
) -> list[torch.Tensor]:
    """One local batch through ``schedule``; returns the per-micro-batch losses (empty off the last stage).

    The first stage feeds the inputs, the last the targets; ranks in between only pass activations (and,
    for V-shaped schedules, rank 0 holds both the first and the last stage). ``forward_only`` runs torch's
    forward-only path (``schedule.eval``) for the schedules where it works (``forward_only_eval``); training
    and evaluation both come through here.
    """
    losses: list[torch.Tensor] = []
    is_first, is_last = 0 in stage_ids, n_stages - 1 in stage_ids
    run = schedule.eval if forward_only else schedule.step
    run(*((inputs,) if is_first else ()), **({"target": targets, "losses": losses} if is_last else {}))
    return losses
