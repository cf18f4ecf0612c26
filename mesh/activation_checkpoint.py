"""Activation checkpointing: trade recomputation for activation memory, one transformer block at a time.

- ``full``: a block keeps only its input during forward and recomputes everything inside it in backward
  (its collectives too: TP/SP all-gathers, EP all-to-alls run again).
- ``selective``: a block saves the outputs of the ops that are expensive to redo, and recomputes the cheap,
  memory-hungry ones (norms, activations, rotary, elementwise products). Saved:

  1. matmuls (the MoE experts' grouped ones too) and every attention kernel (CPU, and CUDA's flash,
     memory-efficient and cuDNN SDPA; ring attention's blocks call the same kernels): they are the FLOPs;
  2. every collective the block issues (all-gather, reduce-scatter, all-reduce, all-to-all, and the wait
     on each): recomputing one would repeat communication, and a rank that recomputed it alone would hang;
  3. ``topk``: the MoE routing decision, so the recomputed block sends every token to the same experts
     (and the same ranks) as the forward did.

Applied after tensor and expert parallelism and before FSDP, so an FSDP unit wraps a checkpointed block and
the recomputation sees the already-parallelized layers. The wrapper inserts ``_checkpoint_wrapped_module``
into parameter names; ``mesh.materialize.canonical_name`` and the wrapper's state-dict hook remove it.

During recomputation MoE blocks must not count their tokens a second time: the recompute context turns
their statistics off (``MoE.count_stats``) while the block reruns.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mesh.private_api import checkpoint_wrapper
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
    _funcol.all_gather_into_tensor.default,
    _funcol.reduce_scatter_tensor.default,
    _funcol.all_reduce.default,
    _funcol.all_to_all_single.default,
    _funcol.wait_tensor.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    _aten.topk.default,
}


def _save_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


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


def _contexts(block: nn.Module, selective: bool, compiled: bool):
    """(forward context, recompute context) for one checkpointed call of ``block``."""
    forward, recompute = (
        create_selective_checkpoint_contexts(_save_policy) if selective else (contextlib.nullcontext(),) * 2
    )
    if compiled:
        # Under torch.compile the contexts must be TorchDispatchModes; a compiled backward does not rerun the
        # statistics' buffer updates, so there is nothing to switch off.
        return forward, recompute
    return forward, _recomputing(block, recompute)


@contextlib.contextmanager
def _recomputing(block: nn.Module, recompute):
    with _moe_stats_off(block), recompute:
        yield


def apply_activation_checkpointing(model: nn.Module, mode: str, compiled: bool = False) -> nn.Module:
    """Wrap every block of ``model.layers`` according to ``mode`` (none | full | selective)."""
    if mode == "none":
        return model
    for key, block in list(model.layers.items()):
        if mode == "full" and compiled:
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
            continue
        context_fn = lambda block=block: _contexts(block, mode == "selective", compiled)  # noqa: E731
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
    return model
