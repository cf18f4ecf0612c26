"""The device plane's small reductions: sums of tensors on the device, over a mesh dim or a group of its.

Rank-to-rank traffic is device plane (here and the rest of mesh/) or control plane (runtime/process.py:
``ControlPlane``, CPU objects on one gloo group). These three take tensors that live on the device the group
serves (NCCL serves CUDA only), so they sit with the mesh, beside the collectives of the parallelisms:

- ``sum_over``: a number every rank of a 1-D mesh needs the sum of, computed from the model (the loss sum over
  the loss mesh: training/step.py, training/evaluation.py; the gradient norm's squares over pp:
  mesh/grad_clip.py; the MoE expert load: mesh/expert_parallel.py). It checks the tensor's device against the
  mesh first, because gloo forgives a CPU tensor on CPU and NCCL does not: a mistake would pass every CPU test
  and fail at step 0 on a GPU.
- ``reduced_as_one``: many small tensors reduced in one collective instead of one each (one flat buffer, split
  back): the partial gradients TP leaves (mesh/tensor_parallel.py), 1-bit Adam's momenta (savers/onebit_adam.py).
- ``sum_in_place``: ``reduced_as_one`` with an all-reduce, written back into the tensors: the shared weights'
  gradients of an MoE block under TP (mesh/moe_token_split.py), 1-bit Adam's warm-up gradients.

Control-plane helpers (``ControlPlane``, ``all_gather_objects`` over the control or checkpoint group) carry CPU
objects and stay in runtime/process.py, which sits below mesh/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def sum_over(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """In-place sum of ``tensor`` over the ranks of ``mesh`` (a 1-D DeviceMesh): a device-plane collective."""
    if tensor.device.type != mesh.device_type:
        raise RuntimeError(
            f"a {tensor.device.type} tensor cannot be reduced on a {mesh.device_type} mesh: device-plane "
            "collectives take tensors on the device their group serves (mesh/reductions.py)"
        )
    if mesh.size() > 1:
        dist.all_reduce(tensor, group=mesh.get_group())
    return tensor


def reduced_as_one(tensors: list[torch.Tensor], reduce) -> list[torch.Tensor]:
    """Concatenate ``tensors``, reduce the flat buffer once (``reduce(flat) -> flat``: one collective instead of
    one per tensor), split it back: the reduced values, each viewed like its input."""
    flat = reduce(torch.cat([t.reshape(-1) for t in tensors]))
    return [r.view_as(t) for t, r in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True)]


def sum_in_place(tensors: list[torch.Tensor], group) -> None:
    """Sum each of ``tensors`` over ``group``'s ranks with one all-reduce, written back into each tensor."""

    def all_reduce(flat: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flat, group=group)
        return flat

    for t, summed in zip(tensors, reduced_as_one(tensors, all_reduce), strict=True):
        t.copy_(summed)
