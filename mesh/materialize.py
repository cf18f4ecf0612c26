"""Materialise a parallelized meta-device model with weights that do not depend on the layout.

DTensor's random ops are not sharding-aware on CPU (every shard would draw the same numbers), and the
order or shape in which shards are created differs between layouts. So instead, for each parameter:

1. Ask the model for the parameter's full initial value, a function of (seed, canonical name) only.
2. Keep this rank's piece of it: ``distribute_tensor(..., src_data_rank=None)`` slices the full tensor
   locally by the parameter's placements (FSDP shards, TP shards) without any communication, since every
   rank computed the same full tensor.
3. Copy that piece into the parameter's local storage.

One parameter is materialised in full at a time, so peak extra memory is the largest single parameter.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Prefixes that wrappers insert into parameter names; the canonical (checkpoint/init) name drops them.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The parameter's name in the plain single-device model, whatever wrappers were applied."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def materialize_weights(
    model: nn.Module, device: torch.device, seed: int, param_device: torch.device | None = None
) -> None:
    """Allocate ``model``'s storage on ``device`` and fill it with the layout-independent initial weights.

    ``param_device``: where the parameters live when that is not ``device`` (the host, under FSDP's CPU
    offload, which requires its sharded parameters there); buffers always go to ``device``.
    """
    param_device = param_device or device
    model.to_empty(device=param_device)
    for name, param in model.named_parameters():
        full = model.initial_value(canonical_name(name), param.shape, seed).to(device=param_device, dtype=param.dtype)
        if isinstance(param, DTensor):
            piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(full)
    model.reset_buffers(device)
