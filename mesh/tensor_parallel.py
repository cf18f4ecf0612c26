"""Tensor parallelism (Megatron-style) and sequence parallelism for the Llama model, via parallelize_module.

Tensor parallelism (TP) splits each block's matmuls across the ``tp`` ranks of a node:

1. MLP: Y = silu(X W1) * (X W3) is *column*-parallel (each rank holds a slice of W1's and W3's output
   columns and computes its slice of Y with no communication); Z = Y W2 is *row*-parallel (each rank holds
   the matching rows of W2 and produces a partial Z). One reduction over tp sums the partial Zs.
2. Attention: wq, wk, wv are column-parallel, i.e. split by heads (each rank runs n_heads/tp query heads and
   n_kv_heads/tp key/value heads); wo is row-parallel; again one reduction per attention.
3. Backward mirrors forward: the block input was used by every rank's slice, so its gradient is the sum of
   the ranks' partial gradients: one reduction per attention and per MLP.

Sequence parallelism (SP, ``parallel.sequence_parallel``) also shards what lies *between* the matmuls (the
RMSNorms, the residual stream) along the sequence dim, so those activations are 1/tp per rank. Each
all-reduce above then becomes a reduce-scatter (partial sums -> sequence shards) and the matching
all-gather (sequence shards -> full sequence before the next column-parallel matmul): the same bytes on the
wire, since all-reduce = reduce-scatter + all-gather, but no rank ever stores the full residual stream.

The embedding is row-parallel over the vocabulary, and the output head column-parallel over it: the logits
stay sharded on the vocab dim and ``loss_parallel`` computes the cross-entropy from the shards, so the full
(batch, seq, vocab) logits never exist on one rank.

Apply order (mesh/parallelize.py): TP -> EP -> activation checkpointing -> compile -> FSDP on the data-parallel
dims of the same world mesh (2-D layouts dp_shard x tp and dp_replicate x tp).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from mesh.grad_clip import group_by_placement
from mesh.moe_token_split import moe_plan
from mesh.private_api import (
    all_reduce_functional,
)
from mesh.reductions import reduced_as_one
from mesh.sequence_parallel import GatherSavingShard
from models.moe import MoE

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ReplicateParallel(ParallelStyle):
    """Run a module unsplit, its parameters Replicate DTensors over tp, so every parameter shares the (dp, tp) mesh
    (AdamW's and clipping's foreach kernels cannot mix meshes)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(_module, output, _mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class VocabParallelEmbedding(ParallelStyle):
    """The embedding split by vocabulary rows, as ``RowwiseParallel`` splits an ``nn.Embedding``: each rank looks up
    the tokens it owns (zeros for the others) and the partial embeddings are summed into ``output_layout``
    (all-reduce to Replicate, or reduce-scatter to the sequence shards of SP); the output is a plain tensor.

    Unlike ``RowwiseParallel`` the sum is finished before the output leaves the module: ``RowwiseParallel`` leaves
    it in flight (``async_op=True``: an ``AsyncCollectiveTensor``), and a compiled block given one (torch 2.13 and
    2.14) waits on it *outside* its autograd function, which cuts the embedding out of the backward graph: the
    reduction's backward then receives a plain tensor ("'Tensor' object has no attribute '_local_tensor'"), or the
    embedding gets no gradient at all. The first block needs the whole output at once, so waiting here gives up no
    overlap; eagerly the numbers are the same."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_rows(_name, module, mesh):
            for name, param in module.named_parameters(recurse=False):
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, (Shard(0),))))

        def to_dtensor(_module, inputs, mesh):
            tokens, *rest = inputs
            if not isinstance(tokens, DTensor):
                tokens = DTensor.from_local(tokens, mesh, (Replicate(),), run_check=False)
            return (tokens, *rest)

        def summed(_module, output, _mesh):
            return output.redistribute(placements=(self.output_layout,)).to_local()

        return distribute_module(module, device_mesh, shard_rows, to_dtensor, summed)


class ReplicatedDTensor(ParallelStyle):
    """Latent attention's low-rank projections and norms: whole on every tp rank as Replicate DTensors; their gradient
    is Partial, reduced once by ``reduce_partial_gradients``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


def shared_key_local(k_rope):
    """Latent attention's shared rope key (a Replicate DTensor) as this rank's local tensor. Each rank uses it
    for its own heads only, so its gradient on each rank is a partial sum over heads: Partial, not Replicate."""
    return k_rope.to_local(grad_placements=(Partial(),)) if isinstance(k_rope, DTensor) else k_rope


def latent_plan() -> dict:
    """The attention entries of a block with latent attention: the per-head projections (wq or wq_b, wkv_b)
    split by heads, wo by rows (as in ``block_plan``), the low-rank projections and norms replicated."""
    plan = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wq_b", "wkv_b")}
    plan.update({f"attention.{n}": ReplicatedDTensor() for n in ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm")})
    return plan


def block_plan(sequence_parallel: bool, regather: bool = False) -> dict:
    """The TP plan of one TransformerBlock; without SP each sub-layer's input is one Replicate DTensor, so backward sums
    its input gradients before a *single* all-reduce (Megatron's "f")."""
    # Between sub-layers, activations are sequence shards (SP) or replicated (no SP).
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention": PrepareModuleInput(
            # (x, rope cos, rope sin, documents): cos/sin and the document ids (or None) stay plain tensors
            input_layouts=(between, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),  # SP: all-gather the sequence here
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),  # all-reduce, or reduce-scatter with SP
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel and regather:
        plan["attention"] = GatherSavingShard()
        plan["feed_forward"] = GatherSavingShard()
    norm_style = SequenceParallel if sequence_parallel else ReplicateParallel
    plan["attention_norm"] = norm_style()
    plan["ffn_norm"] = norm_style()
    return plan


def model_plan(sequence_parallel: bool) -> dict:
    """The TP plan of the embedding, final norm and output head."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # Vocab rows are split: each rank looks up the tokens it owns, the partial embeddings are summed
        # (all-reduce), or reduce-scattered straight into sequence shards with SP.
        "tok_embeddings": VocabParallelEmbedding(output_layout=between),
        # Vocab columns are split; keep the logits as a vocab-sharded DTensor for loss_parallel.
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, regather: bool = False
) -> nn.Module:
    """Shard ``model``'s blocks, embedding and head over ``tp_mesh``; a stage's missing embedding or head is skipped."""
    plan = {name: style for name, style in model_plan(sequence_parallel).items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    # Tied embeddings: each style above made its module's weight a new DTensor Parameter, so the head no longer
    # shares the embedding's. Both are Shard(0) over tp (the embedding's vocab rows, the head's vocab output
    # columns, i.e. the rows of its [vocab, dim] weight): the same piece of the same [vocab, dim] tensor on
    # each tp rank, so one DTensor serves both; the head takes the embedding's again.
    model.tie_weights()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan_of(block, sequence_parallel, regather))
        if hasattr(block.attention, "shared_key_local"):  # latent attention's seam (models/latent_attention.py)
            block.attention.shared_key_local = shared_key_local
    return model


def block_plan_of(block: nn.Module, sequence_parallel: bool, regather: bool = False) -> dict:
    """The TP plan of this block: ``block_plan``, with an MoE block's feed-forward split by tokens instead."""
    plan = block_plan(sequence_parallel, regather)
    if isinstance(block.feed_forward, MoE):
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        plan.update(moe_plan(sequence_parallel))
    if hasattr(block.attention, "wkv_a"):  # latent attention (DeepSeek-V3)
        plan = {k: v for k, v in plan.items() if k not in ("attention.wq", "attention.wk", "attention.wv")}
        plan.update({k: v for k, v in latent_plan().items() if hasattr(block.attention, k.split(".")[1])})
    if getattr(
        block.attention, "qk_norm", False
    ):  # Qwen3: each rank normalises its own heads (dim 2) with the replicated
        # weight, whose gradient is then a Partial sum over the heads of all ranks (reduce_partial_gradients)
        plan.update({f"attention.{n}_norm": SequenceParallel(sequence_dim=2, use_local_output=True) for n in "qk"})
    return plan


def row_parallel_linears(block: nn.Module) -> list[nn.Module]:
    """The block's row-parallel linears (wo, a dense block's w2); empty when TP was not applied (call before FSDP)."""
    linears = [
        block.get_submodule(path)
        for path, style in block_plan_of(block, sequence_parallel=False).items()
        if isinstance(style, RowwiseParallel)
    ]
    return [m for m in linears if isinstance(m.weight, DTensor)]


def loss_context(tp_enabled: bool):
    """Cross-entropy on vocab-sharded logits (forward *and* backward must run inside it)."""
    return loss_parallel() if tp_enabled else contextlib.nullcontext()


@torch.no_grad()
def reduce_partial_gradients(params: list[torch.Tensor]) -> None:
    """All-reduce once, in one flat collective per mesh and placements, the Partial gradients of SP norm weights under
    TP alone; DTensor would redo it on every use. Under FSDP nothing is Partial."""
    partial = [p for p in params if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)]
    for group in group_by_placement(partial):
        mesh, placements = group[0].grad.device_mesh, group[0].grad.placements
        replicated = [Replicate() if pl.is_partial() else pl for pl in placements]
        if any(pl.is_partial() and pl.reduce_op != "sum" for pl in placements):  # not a plain sum: one by one
            for p in group:
                p.grad = p.grad.redistribute(placements=replicated)
            continue
        partial_dims = [dim for dim, pl in enumerate(placements) if pl.is_partial()]

        def reduce(flat: torch.Tensor, mesh=mesh, partial_dims=partial_dims) -> torch.Tensor:
            for dim in partial_dims:
                flat = all_reduce_functional(flat, mesh.get_group(dim))
            return flat

        summed = reduced_as_one([p.grad.to_local() for p in group], reduce)
        for p, total in zip(group, summed, strict=True):
            p.grad = DTensor.from_local(
                total, mesh, replicated, run_check=False, shape=p.grad.shape, stride=p.grad.stride()
            )


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """The plain value of a loss; under loss_parallel it is a DTensor replicated over tp."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
