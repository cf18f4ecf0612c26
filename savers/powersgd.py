"""``parallel.grad_compression = powersgd``: a replicated model whose gradients travel as low-rank factors.

The trade (docs/dp_savers.md, section 3): FSDP is replaced by a replicated model (DDP's reducer through
``replicate``) whose communication hook is torch's ``powerSGD_hook``: each gradient matrix M (n x m) is sent
as two thin factors P (n x r) and Q (m x r), r = ``parallel.powersgd_rank``, with error feedback (what the
approximation missed is added to the next step's gradient). It needs the whole gradient matrix on every
rank, so only a pure data-parallel layout (dp_replicate only) can use it (planning/layout_rules.py:
``saver_errors``). It attaches where the model is parallelized: training/build.py hands ``apply_powersgd``
to mesh/parallelize.py's ``ParallelOptions`` in FSDP's place. 1-bit Adam compresses Adam's momentum rather
than the gradient, so its optimizer does the exchange itself: savers/onebit_adam.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mesh.data_parallel import sum_from_mean
from mesh.private_api import replicate_with_ddp

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# PowerSGD's hook reduces exactly (plain all-reduce) for its first iterations: DDP may rebuild its buckets
# after the first one, and error feedback needs stable buckets. torch refuses fewer than 2 with error
# feedback; meshloom uses that minimum, so compression starts at the third reduction.
POWERSGD_START_ITER = 2


def apply_powersgd(model: nn.Module, replicate_mesh: DeviceMesh, rank: int, device: torch.device) -> nn.Module:
    """Replicate ``model`` over ``replicate_mesh`` with DDP's reducer and PowerSGD as its hook, keeping its class and
    names. The hook's mean is multiplied back to a sum, exact only with one local gradient per reduction: hence
    ``grad_sync=step`` whenever the loop accumulates (``saver_errors``)."""
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
        return powersgd.powerSGD_hook(state, bucket).then(lambda fut: sum_from_mean(fut.value(), size))

    hook = summed_powersgd
    if dist.get_backend(group) == "gloo":
        hook = one_bucket_at_a_time(hook)
    # broadcast_buffers=False: the buffers (rotary tables, MoE expert bias) are computed identically on every
    # rank; broadcasting rank 0's copy before each forward would be a collective for nothing.
    replicate_with_ddp(model, group, device, broadcast_buffers=False)
    model.register_comm_hook(state, hook)
    return model


def one_bucket_at_a_time(hook):
    """``hook`` with each bucket's collectives started after the previous bucket's finished. gloo runs PowerSGD's
    chained callbacks on its own threads, so two buckets could interleave differently per rank and gloo aborts
    ("Received data size doesn't match expected size"). NCCL needs no chaining."""
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
