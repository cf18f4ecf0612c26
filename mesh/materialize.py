"""Materialise a parallelized meta-device model with weights that do not depend on the layout.

DTensor's random ops are not sharding-aware on CPU (every shard would draw the same numbers), and the
order or shape in which shards are created differs between layouts. So instead, for each parameter:

1. Ask the model for the parameter's full initial value, a function of (seed, canonical name) only.
2. Keep this rank's piece of it: ``distribute_tensor(..., src_data_rank=None)`` slices the full tensor
   locally by the parameter's placements (FSDP shards, TP shards) without any communication, since every
   rank computed the same full tensor.
3. Copy that piece into the parameter's local storage.

Before step 1, ``to_empty`` allocates the storage; it may replace a module's Parameter by a new object,
which would untie a tied embedding and head (models/llama.py: ``tie_weights`` ties them again, the one place
that does). A tied weight is then one parameter and is filled once.

One parameter is materialised in full at a time, so peak extra memory is the largest single parameter.

Then ``check_placement`` (train.py runs it once the model is built) looks at every parameter and buffer:
each must sit on the compute device, except parameters under FSDP's CPU offload, which sit in host memory.
On a CPU machine a tensor left on the wrong device cannot be seen (the host *is* the compute device), and on
a GPU it fails at the first forward with an error about mixed devices, far from its cause; the check names
the tensor at start-up instead. tests/test_materialize.py runs it on every layout with the meta device
standing in for the GPU.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.local_tensor import local_tensor

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
    """Allocate ``model`` on ``device`` with the layout-independent initial weights; ``param_device``: the host under
    FSDP CPU offload (buffers always go to ``device``)."""
    param_device = param_device or device
    model.to_empty(device=param_device)
    model.tie_weights()
    for name, param in model.named_parameters():
        full = model.initial_value(canonical_name(name), param.shape, seed).to(device=param_device, dtype=param.dtype)
        if isinstance(param, DTensor):
            piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(piece.to_local())
        else:
            param.copy_(full)
    model.reset_buffers(device)


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` (a DTensor: its local shard) lives on ``device`` (``cuda`` without an index: any GPU)."""
    local = local_tensor(tensor)
    return local.device.type == device.type and device.index in (None, local.device.index)


def misplaced_tensors(model: nn.Module, device: torch.device, host_params: bool = False) -> list[str]:
    """Each parameter and buffer of ``model`` not where the layout says (``host_params``: FSDP CPU offload), and
    where."""
    host = torch.device("cpu")
    wrong = []
    for kind, tensors, expected in (
        ("parameter", model.named_parameters(), host if host_params else device),
        ("buffer", model.named_buffers(), device),
    ):
        for name, tensor in tensors:
            if not on_device(tensor, expected):
                actual = local_tensor(tensor).device
                wrong.append(f"{kind} {canonical_name(name)} is on {actual}, not {expected}")
    return wrong


def check_placement(model: nn.Module, device: torch.device, host_params: bool = False) -> None:
    """Raise naming every tensor of ``model`` not on its device; reads devices only, no copy or sync."""
    wrong = misplaced_tensors(model, device, host_params)
    if wrong:
        raise RuntimeError(
            f"{len(wrong)} tensor(s) of the model are not on the device their layout puts them on: "
            + "; ".join(wrong[:8])
            + ("; ..." if len(wrong) > 8 else "")
            + ". Whatever created them must pass the compute device (mesh/materialize.py: materialize_weights)."
        )
