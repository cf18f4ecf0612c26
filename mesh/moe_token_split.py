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
from mesh.reductions import sum_in_place
from models.local_tensor import local_tensor
from models.moe import MoE

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class SequenceChunks:
    """``MoE.sequence`` under TP (rank r holds chunk r): ``sum`` all-reduces a per-sequence quantity (identity backward,
    Megatron's "g"); ``before`` counts earlier chunks' tokens per expert. Functional collectives."""

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
    """Under TP, an MoE block works on this tp rank's chunk of every sequence, like a data-parallel rank: tokens are
    split instead of weights, so each (token, expert) pair is computed once across tp. Router and shared expert
    gradients cover the rank's tokens: FSDP over dp_shard x cp x tp sums them, or ``sum_token_split_gradients``."""

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
    """Sum over tp, in one all-reduce of local tensors, the MoE weights' gradients every tp rank holds (``experts``:
    include the experts; not when ep borrows the tp ranks, whose experts differ)."""
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
