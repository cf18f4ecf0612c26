"""Gradient clipping by the true global norm, across every shard and every mesh dim.

A gradient may be a plain tensor (one process), an FSDP shard, a TP shard, or a 2-D (dp, tp) DTensor;
pipeline stages each hold only their own layers. The global norm is sqrt(sum over all gradients of
||g||^2), counted once per element of the full model:

1. Group the gradients by (mesh, placements), so one fused norm call covers each group.
2. For a DTensor group, ``get_total_norm`` returns a DTensor whose ``full_tensor()`` reduces the partial
   squared sums over the sharded mesh dims (and does not double count replicated ones). A weight sharded
   by FSDP and by TP is partial over two dims: DTensor reduces both in one all-reduce over the flattened
   (dp_shard, cp, tp) mesh that mesh/dims.build_mesh creates for it (``fsdp_with_tp``), instead of one
   all-reduce per dim.
3. Add the groups' squared norms; with pipeline parallelism, all-reduce that sum over the pp dim, since
   each stage only saw its own layers. (A tied embedding's second copy on the last stage is not counted:
   ``counted``.)
4. Scale every gradient by min(1, max_norm / norm), one group at a time (a fused foreach kernel cannot
   mix DTensors that live on different meshes, e.g. dense and expert weights).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mesh.reductions import sum_over

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def group_by_placement(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters that have a gradient, grouped by their gradient's (mesh, placements)."""
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups[key].append(p)
    return list(groups.values())


@torch.no_grad()
def global_grad_norm(params: list[nn.Parameter], pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model (a 0-dim fp32 tensor, same on every rank)."""
    squared = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for group in group_by_placement(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared += norm.float() ** 2
    if pp_mesh is not None:
        # Offloaded (FSDP CPU offload) gradients give a host tensor; the pp group reduces device tensors.
        squared = sum_over(squared.to(pp_mesh.device_type), pp_mesh)
    return squared.sqrt()


@torch.no_grad()
def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
    counted: list[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Clip to ``max_norm`` (if > 0) by the global norm, measured over ``counted`` (default all); returns it."""
    norm = global_grad_norm(params if counted is None else counted, pp_mesh)
    if max_norm > 0:
        for group in group_by_placement(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm
