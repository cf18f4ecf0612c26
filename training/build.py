"""One rank's training step assembled from its plan: the one build that train.py, the simulation and measure/ share.

A run, a simulated rank (training/simulated_rank.py) and a measurement differ in what surrounds the step (a
process group or a fake world, real data or token batches of the right shape, a checkpointer or none), never in
how the step is built, so the build is written once:

1. ``build_meshes``: the one DeviceMesh of the plan's degrees and its named views (mesh/dims.py), with the groups
   the layout needs besides: the flattened (dp_shard, cp, tp) group where FSDP and TP shard one weight, host
   tensors on the groups under CPU offload.
2. ``parallel_options``: the layout as the typed options mesh/ takes (mesh/parallelize.py: ``ParallelOptions``;
   mesh/ never reads the config), with what a gradient saver changes there: bf16 reduction, CPU offload, and
   PowerSGD's replicated model in FSDP's place (savers/powersgd.py).
3. ``build_step``: the model parts parallelized (``build_model_parts``: the whole model, or this rank's pipeline
   stages), the pipeline schedule over them, a tied embedding's pipeline copies, the optimizers, and the
   ``StepParts`` that training/step.py's ``train_step`` runs. Every rank calls it in the same order: building
   the tied embedding's group is a collective.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from mesh.dims import build_mesh
from mesh.parallelize import (
    ContextParallelOptions,
    DataParallelOptions,
    ParallelOptions,
    TensorParallelOptions,
    build_model_parts,
)
from mesh.pipeline import SCHEDULE_FAMILIES
from mesh.tied_embeddings import TiedEmbeddings
from observers.base import Observers
from savers.powersgd import apply_powersgd
from training.optimizer import Optimizers
from training.step import StepParts, divergence_advice, pipeline_schedule

if TYPE_CHECKING:
    from mesh.dims import Meshes
    from planning.layout import Layout
    from planning.plan import LayoutPlan
    from runtime.schema import Config
    from training.mfu import Throughput


def build_meshes(plan: LayoutPlan, device: torch.device, timeout_s: float) -> Meshes:
    """Step 1: the mesh of ``plan``'s degrees on ``device`` (every rank, before any model part is built)."""
    layout = plan.layout
    return build_mesh(
        plan.dims,
        device,
        timeout_s,
        has_experts=plan.model.moe is not None,
        host_tensors=layout.fsdp_cpu_offload,  # CPU offload: the groups also reduce host tensors
        fsdp_with_tp=layout.fsdp and plan.dims.tp > 1,
    )


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


def parallel_options(layout: Layout, seed: int, meshes: Meshes, device: torch.device) -> ParallelOptions:
    """Step 2: ``ParallelOptions`` for ``layout`` on this rank (``meshes`` and ``device``: PowerSGD's replica
    group)."""
    replicate = None
    if layout.grad_compression == "powersgd":  # a pure data-parallel layout, replicated with DDP
        replicate = partial(
            apply_powersgd, replicate_mesh=meshes.world["dp_replicate"], rank=layout.powersgd_rank, device=device
        )
    return ParallelOptions(
        seed=seed,
        tp=TensorParallelOptions(sequence_parallel=layout.sequence_parallel, regather=layout.sp_regather),
        activation_checkpoint=layout.activation_checkpoint,
        compile=layout.compile,
        split_backward=layout.dims.pp > 1 and SCHEDULE_FAMILIES[layout.pp_schedule].zero_bubble,
        dp=DataParallelOptions(
            fsdp=layout.fsdp,
            mixed_precision=layout.mixed_precision,
            reshard_after_forward=layout.fsdp_reshard_after_forward,
            reduce_dtype=reduce_dtype(layout.grad_compression),  # bf16 gradient compression
            offload=offload_policy(layout.fsdp_cpu_offload, device),  # CPU offload
            replicate=replicate,  # PowerSGD
        ),
        cp=ContextParallelOptions(attention=layout.cp_attention, seq_len=layout.seq_len),
    )


def build_step(
    cfg: Config,
    plan: LayoutPlan,
    meshes: Meshes,
    device: torch.device,
    loader=None,
    throughput: Throughput | None = None,
    before_update=lambda: None,
) -> StepParts:
    """Step 3: this rank's step for ``plan`` (``cfg``: the seed, the optimizer's settings, the clip). ``loader``:
    the batches ``train_step`` reads (None for a measurement that runs the parts itself); ``before_update``: the
    checkpointer's wait for an async save's copy. The run's observers are added to ``StepParts.observers`` after."""
    t = cfg.training
    options = parallel_options(plan.layout, t.seed, meshes, device)
    parts = build_model_parts(plan.model, plan.stage_layers, plan.stage_ids, meshes, options, device)
    schedule, stages, loss_divisor = pipeline_schedule(parts, plan, meshes, device)  # None, [], None unpipelined
    tied = TiedEmbeddings.build(parts, meshes, cfg.parallel.collective_timeout_s)  # every rank: may create groups
    replicas = meshes.world["dp_replicate"].get_group()  # 1-bit Adam exchanges momentum over the replicas
    optimizers = Optimizers(parts, cfg, replicate_group=replicas, steps=plan.steps)
    return StepParts(
        parts,
        schedule,
        plan,
        meshes,
        device,
        optimizers,
        loader,
        tied,
        throughput,
        Observers(),
        loss_divisor,
        stages=stages,
        grad_clip=t.grad_clip,
        advice=divergence_advice(cfg, plan.layout.mixed_precision),
        before_update=before_update,
    )
