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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
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
from mesh.private_api import (
    all_gather_stacked,
    all_reduce_functional,
    dtensor_local_storage,
    outer_saved_tensors_hooks,
)
from models.local_tensor import local_tensor
from models.moe import MoE
from runtime.process import reduced_as_one, sum_in_place

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ReplicateParallel(ParallelStyle):
    """Run a module unsplit on the replicated input, its parameters held as Replicate DTensors over tp.

    Without SP the norms do identical work on every tp rank. Their weights still become DTensors so that,
    once FSDP adds the dp dims, every parameter of the model lives on the same (dp, tp) mesh: the foreach
    kernels of AdamW and of clipping cannot mix DTensors from different meshes.
    """

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


class ReplicatedDTensor(ParallelStyle):
    """Latent attention's low-rank projections and their norms (models/latent_attention.py): small, held whole on
    every tp rank as Replicate DTensors, and run on the replicated input as DTensors (no output conversion), so
    the column-parallel wq_b / wkv_b after them take a DTensor and backward sums what each rank's heads send
    back (a Partial gradient, reduced once by ``reduce_partial_gradients``)."""

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


class GatherSavingShard(PrepareModuleInput):
    """SP: all-gather a sub-layer's input for its column-parallel matmuls, but let autograd keep only this rank's
    sequence shard of it, and all-gather it again in backward (Megatron-LM's sequence parallelism).

    With plain ``PrepareModuleInput`` the matmuls wq/wk/wv (or w1/w3) save the gathered (b, s, h) input for
    their weight gradients: 2bsh per block that SP does not divide (docs/tensor_parallel.md, section 6). Here,
    while the sub-layer runs forward, a saved-tensor hook recognises that gathered tensor (by its storage) and
    saves the shard instead; the first matmul backward that needs it gathers it once more, and the others of
    the sub-layer reuse that copy, which is freed with their graph nodes. Cost: one more all-gather of the
    input per sub-layer in backward (``parallel.sp_regather``). Everything else goes to whatever saved-tensor
    hooks were active outside (a memory probe, CPU offload), unchanged. Eager mode without activation
    checkpointing only (config.check_values): a checkpointed block keeps no gathered input anyway, or keeps it
    by policy, and its recomputation must see the same hooks as its forward.
    """

    def __init__(self):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        active: list = []

        def gather(_module, inputs):
            x, *rest = inputs
            shard = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            full = shard.redistribute(placements=(Replicate(),))
            hooks = torch.autograd.graph.saved_tensors_hooks(*_regather_hooks(shard.detach(), full))
            hooks.__enter__()
            active.append(hooks)
            return (full, *rest)

        def done(_module, _inputs, _output):
            active.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(done)
        return module


class _Regathered:
    """What autograd keeps of one gathered input: its shard (through the outer hooks), and the gathered copy
    while the sub-layer's backward needs it."""

    def __init__(self, shard: DTensor, outer):
        self.outer, self.shard, self.packed, self.full = outer, shard, None, None

    def pack(self) -> _Regathered:
        if self.packed is None:  # the shard is saved once, however many views of the full tensor were
            self.packed = self.outer[0](self.shard) if self.outer else self.shard
            self.shard = None
        return self

    def local_full(self) -> torch.Tensor:
        if self.full is None:
            shard = self.outer[1](self.packed) if self.outer else self.packed
            self.full = shard.redistribute(placements=(Replicate(),)).to_local()
        return self.full


def _regather_hooks(shard: DTensor, full: DTensor):
    """(pack, unpack) for ``saved_tensors_hooks``: views of ``full``'s storage are saved as the shard plus their
    geometry; everything else goes to the hooks that were active before (or is saved as itself)."""
    ptr, mesh = full.to_local().untyped_storage().data_ptr(), full.device_mesh
    outer = outer_saved_tensors_hooks()
    record = _Regathered(shard, outer)

    def pack(t: torch.Tensor):
        if isinstance(t, DTensor) and dtensor_local_storage(t).untyped_storage().data_ptr() == ptr:
            local = dtensor_local_storage(t)
            return ("regather", record.pack(), local.size(), local.stride(), local.storage_offset())
        return ("outer", outer[0](t) if outer else t)

    def unpack(packed):
        if packed[0] == "outer":
            return outer[1](packed[1]) if outer else packed[1]
        _, saved, size, stride, offset = packed
        view = saved.local_full().as_strided(size, stride, offset)
        return DTensor.from_local(view, mesh, (Replicate(),), run_check=False)

    return pack, unpack


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
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
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
    return isinstance(param, DTensor) and ranks <= set(param.device_mesh.mesh.flatten().tolist())


def block_plan(sequence_parallel: bool, regather: bool = False) -> dict:
    """The TP plan of one TransformerBlock (keys are submodule paths inside the block).

    Without SP the residual stream is replicated; ``PrepareModuleInput`` still turns each sub-layer's input
    into one Replicate DTensor, so wq/wk/wv (and w1/w3) share it and backward sums their input gradients
    before a *single* all-reduce, as in Megatron's "f" operator.
    """
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
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # Vocab columns are split; keep the logits as a vocab-sharded DTensor for loss_parallel.
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    plan["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, regather: bool = False
) -> nn.Module:
    """Shard ``model``'s blocks, embedding and head over ``tp_mesh`` (a 1-D mesh, one node's GPUs).

    A pipeline stage may lack the embedding or the head (they are None): their plan entries are skipped.
    """
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
    """The block's linears that TP made row-parallel (attention.wo, and a dense block's feed_forward.w2): each
    produces a whole-sequence partial sum that an all-reduce or reduce-scatter follows. Empty when TP was not
    applied (their weights are then plain tensors; call before FSDP, which makes every weight a DTensor)."""
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
    """All-reduce, once, the gradients that backward left as Partial sums (SP norm weights under TP alone).

    A sequence-parallel norm sees only this rank's tokens, so its replicated weight gets a Partial gradient.
    DTensor would reduce it lazily on *every* use (the clipping norm, then each AdamW update), repeating the
    same all-reduce; doing it here once gives every later use a Replicate gradient. The gradients that share
    a mesh and placements go in one flat all-reduce (2 n_layers + 1 norm weights, one collective: a
    collective's fixed cost is paid once, not per weight). Under FSDP the gradient reduction already did this,
    and nothing is Partial.
    """
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
