"""Activation checkpointing: trade recomputation for activation memory, one transformer block at a time.

What each ``training.activation_checkpoint`` policy keeps is one table, mesh/ac_policies.py (``POLICIES``),
which planning/memory_estimate.py reads too. The selective policies below differ only in the matmuls:
``selective`` (torchtitan's per-op policy, the default) keeps every second one (``_every_second_matmul``),
``selective_keep_mm`` every one; what else is kept is the list that follows.

- ``full``: a block keeps only its input during forward and recomputes everything inside it in backward
  (its collectives too: TP/SP all-gathers, EP all-to-alls run again).
- ``selective``, ``selective_keep_mm``: a block saves the outputs of the ops that are expensive to redo, and recomputes the cheap,
  memory-hungry ones (norms, activations, rotary, elementwise products). Saved (mesh/ac_policies.py says why
  for each choice, as torchtitan's policy makes them):

  1. matmuls (the MoE experts' grouped ones too; ``mm`` and ``addmm`` each counted on their own by the
     every-second rule) and every attention kernel (CPU, and CUDA's flash, memory-efficient and cuDNN SDPA; ring
     attention's blocks call the same kernels): they are the FLOPs;
  2. the reduce-scatters and all-to-alls the block issues. All-gathers and all-reduces (and every wait) are
     recomputed: every rank recomputes the same block, so every rank issues them again, in the same order;
  3. ``topk``: the MoE routing decision, so the recomputed block sends every token to the same experts
     (and the same ranks) as the forward did; ``max`` (a low-precision recipe's amax);
  4. device-to-host copies: recomputing one would read the device again, blocking, in backward.

  Except, under tensor parallelism, the row-parallel matmuls (attention.wo, a dense block's feed_forward.w2:
  ``mesh.tensor_parallel.row_parallel_linears``, read from the TP plan): each writes a whole-sequence partial
  sum (b, s, h) that the all-reduce or reduce-scatter after it consumes at once. With SP the reduce-scatter's
  output is saved (2); without SP the all-reduce is recomputed from the recomputed matmul. Saving the matmul's
  output would hold b·s·h bytes per row-parallel layer (without checkpointing autograd never keeps it, since mm
  saves its inputs), so selective would keep more than no checkpointing at large tp.
  The price: wo and w2 run again in backward, 2·h·h + 2·h·H FLOPs per token of a block's forward matmuls
  (about 35% of them at Llama 3 8B's shape), which the rest of the recomputation does not pay. How, per op:

  a. the policy is built per block; at each matmul it reads the row-parallel linears' *current* local weights
     (FSDP gathers them into new storage for the recomputation) and compares the matmul's operands' storage
     with theirs: the same answer in forward and in the recomputation, as SAC requires (torch 2.11 asks the
     policy in both; later releases only in forward, and replay its answers by op index);
  b. a match is recomputed, every other op of the list above saved.

  Under torch.compile the policy is called while tracing, on fake tensors that have no real storage to
  compare, so the policy of a compiled block does not try: it treats the row-parallel matmuls like the others.
  A compiled TP block under selective checkpointing therefore keeps wo's and w2's whole-sequence partial sums
  where the every-second rule picks them, more than eager mode keeps (at large tp more than no checkpointing);
  planning/memory_estimate.py models eager mode.

Applied after tensor and expert parallelism and before FSDP, so an FSDP unit wraps a checkpointed block and
the recomputation sees the already-parallelized layers. The wrapper inserts ``_checkpoint_wrapped_module``
into parameter names; ``mesh.materialize.canonical_name`` and the wrapper's state-dict hook remove it.

During recomputation MoE blocks must not count their tokens a second time: the recompute context turns
their statistics off (``MoE.count_stats``) while the block reruns.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mesh.ac_policies import POLICIES, SELECTIVE, keeps_matmul
from mesh.compile import compiles_whole
from mesh.private_api import checkpoint_wrapper, dtensor_local_storage, selective_checkpoint_contexts
from mesh.tensor_parallel import row_parallel_linears
from models.moe import MoE

_aten, _funcol = torch.ops.aten, torch.ops._c10d_functional
# Ops whose outputs a selective checkpoint keeps (module docstring, 1-3).
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._grouped_mm.default,  # the MoE experts' matmuls (models/kernels.py)
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    # mesh/ac_policies.py: SAVED_COLLECTIVES (all-gathers, all-reduces and waits are recomputed)
    _funcol.reduce_scatter_tensor.default,
    _funcol.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    _aten.topk.default,
    _aten.max.default,
}


_MATMULS = {_aten.mm.default, _aten.addmm.default}  # how a row-parallel linear runs on its local shard


def _to_host(op, args, kwargs) -> bool:
    """A device-to-host copy (module docstring, 4): ``_to_copy`` of an accelerator tensor to the CPU."""
    if op is not _aten._to_copy.default or not args or not isinstance(args[0], torch.Tensor):
        return False
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == "cpu" and args[0].device.type != "cpu"


def _storage_id(t) -> int:
    """Which storage ``t`` views (a DTensor: its local shard's), by the storage object's identity. Not ``data_ptr()``,
    which is 0 for every fake tensor."""
    local = dtensor_local_storage(t) if isinstance(t, DTensor) else t
    return local.untyped_storage()._cdata


def _save_policy(row_linears: list[nn.Module]):
    """The selective policy of one block (module docstring, 1-3 and a-b): ``row_linears`` are its row-parallel
    linears under TP (empty: save every op of SAVE_OPS)."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if _to_host(op, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if op not in SAVE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if row_linears and op in _MATMULS:
            weights = {_storage_id(m.weight) for m in row_linears}  # now: FSDP may have regathered them
            if any(isinstance(a, torch.Tensor) and _storage_id(a) in weights for a in args):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def _every_second_matmul(keep, mode: str):
    """``mode``'s policy from ``keep``: a kept matmul whose 1-based count ``keeps_matmul`` rejects is recomputed.
    ``mm`` and ``addmm`` count apart (mesh/ac_policies.py), and so do forward and recomputation (torch asks the
    policy in both on some releases); a new policy per call."""
    if POLICIES[mode].matmuls == "all":
        return keep
    counts = {False: Counter(), True: Counter()}  # per op, in forward and in recomputation

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = keep(ctx, op, *args, **kwargs)
        if op in _MATMULS:
            count = counts[bool(getattr(ctx, "is_recompute", False))]
            count[op] += 1
            if decision == CheckpointPolicy.MUST_SAVE and not keeps_matmul(mode, count[op]):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return decision

    return policy


@contextlib.contextmanager
def _moe_stats_off(block: nn.Module):
    moes = [m for m in block.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.count_stats = False
    try:
        yield
    finally:
        for moe in moes:
            moe.count_stats = True


def _contexts(block: nn.Module, mode: str, compiled: bool, row_linears: list[nn.Module]):
    """(forward context, recompute context) for one checkpointed call of ``block`` under ``mode``."""
    # Eager: torch's contexts, passing over FSDP's profiler annotations (a nested FSDP unit, the MoE experts' under
    # ep, opens more of them in recomputation than in forward: mesh/private_api.selective_checkpoint_contexts).
    # Compiled: torch's own, whose modes the compiler knows by their exact class.
    contexts = create_selective_checkpoint_contexts if compiled else selective_checkpoint_contexts
    forward, recompute = (
        contexts(_every_second_matmul(_save_policy([] if compiled else row_linears), mode))
        if mode in SELECTIVE
        else (contextlib.nullcontext(),) * 2
    )
    if compiled:
        # Under torch.compile the contexts must be TorchDispatchModes; a compiled backward does not rerun the
        # statistics' buffer updates, so there is nothing to switch off.
        return forward, recompute
    return forward, _recomputing(block, recompute)


class _recomputing:
    """The recompute context: MoE statistics off, then ``recompute`` (the selective policy's replay, or nothing).
    A class, not a generator: torch enters one call's recompute context once per recomputation, and a split
    backward (a zero-bubble schedule's input-gradient pass, then its weight-gradient pass) recomputes twice."""

    def __init__(self, block: nn.Module, recompute):
        self.block, self.recompute, self.stack = block, recompute, None

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(_moe_stats_off(self.block))
            stack.enter_context(self.recompute)
            self.stack = stack.pop_all()

    def __exit__(self, *exc):
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc)


def apply_activation_checkpointing(model: nn.Module, mode: str, compiled: bool = False) -> nn.Module:
    """Wrap every block of ``model.layers`` according to ``mode`` (mesh/ac_policies.py: ``POLICIES``)."""
    if mode == "none":
        return model
    for key, block in list(model.layers.items()):
        # a block compiled whole traces its checkpoint; one compiled by parts runs it eagerly (mesh/compile.py)
        traced = compiled and compiles_whole(block)
        if mode == "full" and traced:
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
            continue
        # read before FSDP makes every weight a DTensor: TP's row-parallel linears, if TP was applied
        rows = row_parallel_linears(block)
        context_fn = lambda block=block, rows=rows, traced=traced: _contexts(block, mode, traced, rows)  # noqa: E731
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
    return model
