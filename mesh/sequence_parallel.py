"""Sequence parallelism's regather: keep each sub-layer's input as its sequence shard and gather it again in
backward (``parallel.sp_regather``), found among autograd's saved tensors by storage (saved-tensor hooks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
)

from mesh.private_api import (
    dtensor_local_storage,
    outer_saved_tensors_hooks,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class GatherSavingShard(PrepareModuleInput):
    """SP: all-gather a sub-layer's input for its column-parallel matmuls but save only this rank's shard, gathering it
    again in backward (Megatron-LM; docs/tensor_parallel.md, section 6; ``parallel.sp_regather``). Eager mode without
    activation checkpointing only (config.check_values): a recomputation must see the same hooks."""

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
