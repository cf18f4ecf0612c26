"""``parallel.fsdp_cpu_offload``: FSDP2's ``CPUOffloadPolicy``, the sharded state in host memory.

The trade (docs/dp_savers.md, section 4): sharded parameters, their gradients and so the AdamW state live in
host memory; a unit's shard is copied to the device for its all-gather and its reduced gradient copied back,
and the optimizer steps on the host. It attaches where the model is parallelized (planning/options.py puts
``offload_policy`` into mesh/parallelize.py's ``ParallelOptions``), and where the mesh is built: train.py
asks mesh/dims.py for groups that also reduce host tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

if TYPE_CHECKING:
    import torch


def offload_policy(enabled: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy: ``CPUOffloadPolicy`` (pinned host memory when the device is a GPU) or none."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")
