"""An MoE block under tensor parallelism: its tokens split over the tp ranks instead of its weights
(``TokenSplitMoE``), the per-sequence sums over tp ranks, and the gradient fix-up of the weights every tp rank
holds (``sum_token_split_gradients``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
)

from mesh.private_api import (
    all_gather_stacked,
    all_reduce_functional,
    mesh_ranks,
)
from models.local_tensor import local_tensor
from models.moe import MoE
from runtime.process import sum_in_place

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class SequenceChunks:
    """models/moe.py's ``MoE.sequence`` under TP: each tp rank holds chunk r of every sequence (rank order).

    ``sum`` adds a per-sequence quantity over the tp ranks: an all-reduce forward, and the identity backward,
    since every rank computes the same loss from the sum and back-propagates it itself (Megatron's "g").
    ``before`` gives, per sequence and expert, how many tokens chose the expert in the chunks of the ranks
    before this one: an all-gather of the (batch, E) counts. Both are functional collectives, so selective
    activation checkpointing saves their results instead of repeating them.
    """

    def __init__(self, tp_mesh: DeviceMesh):
        self.group, self.chunks, self.rank = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()

    def sum(self, per_sequence: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(per_sequence, self.group)

    def before(self, counts: torch.Tensor) -> torch.Tensor:
        return all_gather_stacked(counts, self.group)[: self.rank].sum(0)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce forward, identity backward (see SequenceChunks.sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return all_reduce_functional(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class TokenSplitMoE(ParallelStyle):
    """Under TP, an MoE block works on this tp rank's chunk of every sequence, like a data-parallel rank.

    A dense MLP splits its *weights* over tp; an MoE block's cost is per (token, expert) pair, so here the
    *tokens* are split instead, and each pair is computed exactly once across the tp ranks (before, every tp
    rank ran the whole gathered sequence through the same experts: tp-fold redundant work).

    1. Input: with SP the block's input already is this rank's sequence shard (no communication; before, it
       was all-gathered). Without SP it is the full sequence on every rank, and the rank keeps its chunk.
    2. Routing, capacity and the aux loss run on the chunk; the two per-sequence sums they need from the other
       chunks come from ``SequenceChunks`` (models/moe.py, "Sequences in chunks").
    3. Experts, EP dispatch/combine and the shared expert run on the chunk's tokens only.
    4. Output: with SP it is this rank's shard already; without SP the chunks are all-gathered.
    5. Each rank's gradient of the router and the shared expert covers only its tokens. Under FSDP they are
       sharded over dp_shard x cp x tp (mesh/data_parallel.py: ``Meshes.token_split``), so no tp rank holds
       them whole and FSDP's reduce-scatter sums them over tp (an MoE model under TP always uses FSDP:
       planning/plan.uses_fsdp). Where they are whole on every tp rank (PowerSGD's and 1-bit Adam's replicated
       models, if ever combined with TP) ``sum_token_split_gradients`` all-reduces them over tp once per step. With
       expert parallelism the ep group borrows the tp ranks (mesh/dims.py), so each tp rank dispatches its chunk
       to the experts' owners and holds other experts than its tp peers: FSDP sums those gradients over efsdp,
       and the tp sum leaves them out. Without ep the experts go into the router's FSDP unit (over the tp
       ranks too). The per-step expert-load statistics are summed over tp as well
       (mesh/expert_parallel.step_expert_load).
    """

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.sequence = SequenceChunks(device_mesh)
        if self.sequence_parallel:  # the input is this rank's shard (a DTensor from the SP norm)
            module.register_forward_pre_hook(lambda _m, inputs: tuple(local_tensor(x) for x in inputs))
            return module

        def keep_chunk(_module, inputs):
            x, *rest = inputs
            chunk = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False).redistribute(
                placements=(Shard(1),)
            )
            return (chunk.to_local(), *rest)

        def gather_chunks(_module, _inputs, out):
            return DTensor.from_local(out, device_mesh, (Shard(1),), run_check=False).full_tensor()

        module.register_forward_pre_hook(keep_chunk)
        module.register_forward_hook(gather_chunks)
        return module


def moe_plan(sequence_parallel: bool) -> dict:
    """The feed-forward part of the plan for an MoE block: tokens split over tp (``TokenSplitMoE``); its
    weights are not tp DTensors (expert parallelism may still shard the experts, mesh/expert_parallel.py)."""
    return {"feed_forward": TokenSplitMoE(sequence_parallel)}


@torch.no_grad()
def sum_token_split_gradients(parts: list[nn.Module], tp_mesh: DeviceMesh, experts: bool = True) -> None:
    """Sum over tp the gradients of the MoE blocks' weights that every tp rank holds (``TokenSplitMoE``, step
    5): one all-reduce. ``experts``: whether the experts are among them (``Meshes.experts_replicated_over_tp``);
    when ep borrows the tp ranks each tp rank holds other experts, and summing would add unrelated gradients.

    Local tensors are reduced: under FSDP each tp rank holds the same dp shard of a weight, so the sum of
    the shards is the shard of the sum; expert-parallel shards within dp_shard likewise.
    """
    tp_ranks = mesh_ranks(tp_mesh)
    grads = [
        local_tensor(p.grad)
        for part in parts
        for module in part.modules()
        if isinstance(module, MoE)
        for name, p in module.named_parameters()
        if p.grad is not None and (experts or not name.startswith("experts.")) and not _fsdp_over(p, tp_ranks)
    ]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        sum_in_place(same, tp_mesh.get_group())


def _fsdp_over(param: torch.Tensor, ranks: set[int]) -> bool:
    """Whether ``param`` is sharded over a mesh holding all of ``ranks`` (mesh/data_parallel.py shards an MoE
    block's router and shared expert over dp_shard x cp x tp): FSDP's reduce-scatter already sums it there."""
    return isinstance(param, DTensor) and ranks <= mesh_ranks(param.device_mesh)
