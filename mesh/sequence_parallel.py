"""Sequence parallelism's regather: keep each sub-layer's input as its sequence shard and gather it again in
backward (``parallel.sp_regather``). Two mechanisms, one per mode, with the same effect (the gathered input is not
kept, backward all-gathers it once more per sub-layer):

- **Eager**: saved-tensor hooks, entered while the sub-layer runs, find the gathered input among autograd's saved
  tensors by its storage and save the shard in its place; the first unpack in backward gathers it again.
- **Compiled** (``training.compile``): dynamo cannot trace hooks that compare storages, so the sub-layer's forward
  runs, gather included, inside a selective activation checkpoint whose policy recomputes only the all-gather
  (``_GATHER_OPS``: the collective, its wait, and the split and cat that put its chunks in sequence order) and
  leaves every other op to the partitioner. The partitioner honours the recompute tags (without them it never
  recomputes a collective, and keeps the cat's output, which backward's weight-gradient matmuls read), saves the
  shard the gather starts from, and all-gathers it again in the backward graph. The policy sees ops, not where their
  inputs came from, so every split and cat of the sub-layer is tagged, not only the gather's; that adds no memory
  (a split is a view, and a recomputed cat needs its inputs, together the size of its output). Measured on a tiny
  block (tests/test_tensor_parallel.py, ``test_compiled_sp_regather_keeps_shards_and_gathers_again_in_backward``):
  neither gathered input kept, 4 all-gathers in backward instead of 2, as in eager mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mesh.private_api import (
    dtensor_local_storage,
    outer_saved_tensors_hooks,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class GatherSavingShard(PrepareModuleInput):
    """SP: all-gather a sub-layer's input for its column-parallel matmuls but save only this rank's shard, gathering it
    again in backward (Megatron-LM; docs/tensor_parallel.md, section 6; ``parallel.sp_regather``): by saved-tensor hooks
    in eager mode, by a checkpoint that recomputes only the gather under torch.compile (module docstring). Without
    activation checkpointing only (planning/layout_rules.py): a checkpointed block keeps no gathered input."""

    def __init__(self):
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        active: list = []

        def gather(x: torch.Tensor) -> tuple[DTensor, DTensor]:
            shard = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return shard, shard.redistribute(placements=(Replicate(),))

        def gather_saving_shard(_module, inputs):
            if torch.compiler.is_compiling():  # the compiled path gathers inside forward's checkpoint (below)
                return None
            x, *rest = inputs
            shard, full = gather(x)
            hooks = torch.autograd.graph.saved_tensors_hooks(*_regather_hooks(shard.detach(), full))
            hooks.__enter__()
            active.append(hooks)
            return (full, *rest)

        def done(_module, _inputs, _output):
            if not torch.compiler.is_compiling():
                active.pop().__exit__(None, None, None)

        forward = module.forward

        def gathered_forward(x, *rest):  # the compiled path: gather and sub-layer in one checkpointed region
            return forward(gather(x)[1], *rest)

        def regathering_forward(x, *rest):
            if not torch.compiler.is_compiling():  # eager: the hooks above gathered x already
                return forward(x, *rest)
            return checkpoint(
                gathered_forward, x, *rest, use_reentrant=False, preserve_rng_state=False, context_fn=_recompute_gather
            )

        module.register_forward_pre_hook(gather_saving_shard)
        module.register_forward_hook(done)
        module.forward = regathering_forward
        return module


_funcol = torch.ops._c10d_functional
_GATHER_OPS = {
    _funcol.all_gather_into_tensor.default,
    _funcol.wait_tensor.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.cat.default,
}


def _recompute_gather_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Recompute the gather (module docstring); PREFER_SAVE tags no other op, leaving it to the partitioner's own
    choice, as without a checkpoint."""
    return CheckpointPolicy.MUST_RECOMPUTE if op in _GATHER_OPS else CheckpointPolicy.PREFER_SAVE


def _recompute_gather():
    """Fresh (forward, recompute) contexts for one checkpointed call, as torch.utils.checkpoint asks."""
    return create_selective_checkpoint_contexts(_recompute_gather_policy)


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
