"""The one adapter from the TOML config to the parallelisms' typed options.

mesh/ never reads ``runtime.config``: each parallelism takes the few typed values it needs. This module reads
the config (and the layout plan worked out from it) once and builds those values:

- ``parallel_options``: mesh/parallelize.py's ``ParallelOptions``, one typed group per parallelism (TP, AC and
  compile, data parallelism, CP), including what a gradient-compression extra changes there (bf16 reduction,
  PowerSGD's replicated model in FSDP's place) and FSDP's CPU offload policy;
- ``model_parts``: this rank's parallelized model parts for a config, the way train.py builds them.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from mesh.parallelize import (
    ContextParallelOptions,
    DataParallelOptions,
    ParallelOptions,
    TensorParallelOptions,
    build_model_parts,
)
from savers.powersgd import apply_powersgd

if TYPE_CHECKING:
    from torch import nn

    from mesh.dims import Meshes
    from planning.plan import LayoutPlan
    from runtime.config import Config


def reduce_dtype(grad_compression: str) -> torch.dtype:
    """The dtype FSDP reduces gradients in: bf16 for ``parallel.grad_compression=bf16`` (half the bytes, the sum
    rounded to 8 significant bits; docs/dp_savers.md, section 3), else fp32."""
    return torch.bfloat16 if grad_compression == "bf16" else torch.float32


def offload_policy(enabled: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for ``parallel.fsdp_cpu_offload``: ``CPUOffloadPolicy`` (sharded parameters, gradients and
    AdamW state in host memory, pinned when the device is a GPU; docs/dp_savers.md, section 4) or none."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def parallel_options(cfg: Config, plan: LayoutPlan, meshes: Meshes, device: torch.device) -> ParallelOptions:
    """``ParallelOptions`` for ``cfg`` on this rank (``meshes`` and ``device``: PowerSGD's replica group)."""
    p, t = cfg.parallel, cfg.training
    replicate = None
    if p.grad_compression == "powersgd":  # a pure data-parallel layout, replicated with DDP
        replicate = partial(
            apply_powersgd, replicate_mesh=meshes.world["dp_replicate"], rank=p.powersgd_rank, device=device
        )
    return ParallelOptions(
        seed=t.seed,
        tp=TensorParallelOptions(sequence_parallel=p.sequence_parallel, regather=p.sp_regather),
        activation_checkpoint=t.activation_checkpoint,
        compile=t.compile,
        dp=DataParallelOptions(
            fsdp=plan.fsdp,
            mixed_precision=t.mixed_precision,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            reduce_dtype=reduce_dtype(p.grad_compression),  # bf16 gradient compression
            offload=offload_policy(p.fsdp_cpu_offload, device),  # CPU offload
            replicate=replicate,  # PowerSGD
        ),
        cp=ContextParallelOptions(attention=p.cp_attention, seq_len=plan.seq_len),
    )


def model_parts(cfg: Config, plan: LayoutPlan, meshes: Meshes, device: torch.device) -> list[nn.Module]:
    """This rank's model parts for ``cfg``: the whole model, or its pipeline stages, parallelized."""
    options = parallel_options(cfg, plan, meshes, device)
    return build_model_parts(plan.model, plan.stage_layers, plan.stage_ids, meshes, options, device)
