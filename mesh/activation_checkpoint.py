"""Activation checkpointing: trade recomputation for activation memory, one transformer block at a time.

- ``full``: a block keeps only its input during forward and recomputes everything inside it in backward.
- ``selective``: a block saves the outputs of the expensive ops (matmuls and attention) and recomputes the
  cheap, memory-hungry ones (norms, activations, rotary, elementwise products).

Applied after tensor parallelism and before FSDP, so an FSDP unit wraps a checkpointed block and the
recomputation sees the already-parallelized layers. The wrapper inserts ``_checkpoint_wrapped_module``
into parameter names; ``mesh.materialize.canonical_name`` and the wrapper's state-dict hook remove it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Ops whose outputs are worth keeping: recomputing them costs FLOPs, storing them costs little extra.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block of ``model.layers`` according to ``mode`` (none | full | selective)."""
    if mode == "none":
        return model
    for key, block in list(model.layers.items()):
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
    return model
