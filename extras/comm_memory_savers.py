"""Communication and memory savers for data parallelism: fewer reductions, smaller ones, state on the host.

Three config switches, each a trade (docs/dp_savers.md, sections 2-4 give the arithmetic):

1. ``parallel.grad_sync = step``: reduce the gradients once per optimizer step instead of after every
   micro-batch. ``reduction_window`` wraps the forward *and* backward of each micro-batch; on every one but
   the last it switches the reduction off, so the gradients accumulate locally:

   - FSDP (one data-parallel dim): no reduce-scatter; each unit keeps its whole unsharded gradient (in the
     reduce dtype, fp32 by default) until the last micro-batch reduce-scatters the sum: +4Ψ bytes per rank
     for fp32 gradients, the memory the sharding of gradients had saved;
   - HSDP (dp_replicate x dp_shard): the reduce-scatter inside the shard group still runs on every
     micro-batch (fast links, the gradient stays sharded), only the all-reduce across the replicas is
     skipped; the reduce-scattered shards are summed locally until the last micro-batch: +4Ψ/dp_shard;
   - PowerSGD's replicated model (3. below): DDP's own switch, read by the *forward*, which is why the
     forward belongs inside the window.

   Under pipeline parallelism torch's schedule already does this across its own micro-batches (its stages
   turn FSDP's reduction off until the schedule step's last backward), so ``step`` is accepted there only
   when the training loop itself does not accumulate (``saver_errors``).

2. ``parallel.grad_compression``: ``bf16`` makes FSDP reduce gradients in bf16 (``reduce_dtype``: half the
   bytes, the sum rounded to 8 significant bits, then stored back into fp32 shards). ``powersgd`` replaces
   FSDP by a replicated model (DDP's reducer through ``replicate``) whose communication hook is torch's
   ``powerSGD_hook``: each gradient matrix M (n x m) is sent as two thin factors P (n x r) and Q (m x r),
   r = ``parallel.powersgd_rank``, with error feedback (what the approximation missed is added to the next
   step's gradient). It needs the whole gradient matrix on every rank, so only a pure data-parallel layout
   (dp_replicate only) can use it. ``onebit_adam`` (1-bit Adam) compresses Adam's momentum rather than the
   gradient, so its optimizer does the exchange itself: extras/onebit_adam.py.

3. ``parallel.fsdp_cpu_offload``: FSDP2's ``CPUOffloadPolicy``. Sharded parameters, their gradients and so
   the AdamW state live in host memory; a unit's shard is copied to the device for its all-gather and its
   reduced gradient copied back, and the optimizer steps on the host.

planning/layout_rules.py: ``saver_errors`` lists every combination that cannot work, with the field, the value
and the fix; it runs with the other layout rules before any process group exists.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from mesh.private_api import replicate_with_ddp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# PowerSGD's hook reduces exactly (plain all-reduce) for its first iterations: DDP may rebuild its buckets
# after the first one, and error feedback needs stable buckets. torch refuses fewer than 2 with error
# feedback; meshloom uses that minimum, so compression starts at the third reduction.
POWERSGD_START_ITER = 2


# ---- 1. reduce once per step -------------------------------------------------------------------------------


def _allow_reduction(parts: list[nn.Module], allowed: bool, hsdp: bool) -> None:
    for part in parts:
        if isinstance(part, FSDPModule) and hsdp:
            part.set_requires_all_reduce(allowed)  # the reduce-scatter inside the shard group still runs
        elif hasattr(part, "set_requires_gradient_sync"):  # FSDPModule, or replicate's DDP (PowerSGD)
            part.set_requires_gradient_sync(allowed)


@contextlib.contextmanager
def reduction_window(parts: list[nn.Module], *, reduce: bool, hsdp: bool):
    """Run one micro-batch's forward and backward inside: its gradients are reduced only when ``reduce``.

    With ``reduce=False`` FSDP skips the reduction (HSDP: only the all-reduce across replicas) and keeps
    the gradient locally, and a replicated (DDP) model skips its all-reduce; the next micro-batch that
    reduces sends the accumulated sum. DDP decides during the forward whether the coming backward reduces,
    so the forward must be inside the window too. On exit the default (reduce) is restored.
    """
    if reduce:
        yield
        return
    _allow_reduction(parts, False, hsdp)
    try:
        yield
    finally:
        _allow_reduction(parts, True, hsdp)


# ---- 2. compression ----------------------------------------------------------------------------------------


def reduce_dtype(grad_compression: str) -> torch.dtype:
    """The dtype FSDP reduces gradients in: bf16 for ``grad_compression=bf16``, else fp32."""
    return torch.bfloat16 if grad_compression == "bf16" else torch.float32


def apply_powersgd(model: nn.Module, replicate_mesh: DeviceMesh, rank: int, device: torch.device) -> nn.Module:
    """Replicate ``model`` over ``replicate_mesh`` with DDP's reducer and PowerSGD as its communication hook.

    The model keeps its class and parameter names (``replicate`` is DDP without a wrapper module), so the
    training loop, checkpoints and MoE code see the same module as on one process. Gradients are summed:
    DDP and the hook average over the group, and meshloom's loss is already each rank's share of the global
    mean (docs/data_parallel.md section 6), so the hook's result is multiplied back by the group size. That
    is exact only if each reduction sees one local gradient (no already-reduced part accumulated in it),
    hence ``grad_sync=step`` whenever the loop accumulates (``saver_errors``).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    group = replicate_mesh.get_group()
    size = dist.get_world_size(group)
    state = powersgd.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=POWERSGD_START_ITER,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )

    def summed_powersgd(state, bucket):
        return powersgd.powerSGD_hook(state, bucket).then(lambda fut: fut.value().mul_(size))

    hook = summed_powersgd
    if dist.get_backend(group) == "gloo":
        hook = one_bucket_at_a_time(hook)
    # broadcast_buffers=False: the buffers (rotary tables, MoE expert bias) are computed identically on every
    # rank; broadcasting rank 0's copy before each forward would be a collective for nothing.
    replicate_with_ddp(model, group, device, broadcast_buffers=False)
    model.register_comm_hook(state, hook)
    return model


def one_bucket_at_a_time(hook):
    """``hook`` with each DDP bucket's collectives started only after the previous bucket's finished (gloo).

    PowerSGD reduces a bucket in a chain of all-reduces, each issued from the completion callback of the one
    before. gloo runs those callbacks on its own threads, so with several buckets (DDP rebuilds its buckets
    after the first step: a 1 MiB first bucket, then 25 MiB ones) two ranks can issue the chains of two
    buckets interleaved in different orders: collective sizes then mismatch and gloo aborts ("Received data
    size doesn't match expected size"; measured here on the debug model from PowerSGD's first compressed
    step). Chaining the buckets makes the order the same on every rank. NCCL runs the callbacks in the issuing
    thread, so the order is already fixed there and the hook is used as it is.
    """
    previous: list[torch.futures.Future | None] = [None]

    def serialized(state, bucket):
        result = torch.futures.Future()

        def finish(fut) -> None:
            try:
                result.set_result(fut.value())
            except Exception as exc:  # noqa: BLE001 - handed to DDP, which raises it in backward
                result.set_exception(exc)

        def start(_=None) -> None:
            try:
                hook(state, bucket).add_done_callback(finish)
            except Exception as exc:  # noqa: BLE001
                result.set_exception(exc)

        before, previous[0] = previous[0], result
        if before is None:
            start()
        else:
            before.add_done_callback(start)
        return result

    return serialized


# ---- 3. CPU offload ----------------------------------------------------------------------------------------


def offload_policy(enabled: bool, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy: ``CPUOffloadPolicy`` (pinned host memory when the device is a GPU) or none."""
    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


# ---- the rules ---------------------------------------------------------------------------------------------
