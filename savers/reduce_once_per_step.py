"""``parallel.grad_sync = step``: reduce the gradients once per optimizer step instead of after every micro-batch.

The trade (docs/dp_savers.md, section 2): fewer reductions for more gradient memory. It attaches at the step
(training/step.py runs each micro-batch's forward *and* backward inside ``reduction_window``); on every
micro-batch but the last the window switches the reduction off, so the gradients accumulate locally:

- FSDP (one data-parallel dim): no reduce-scatter; each unit keeps its whole unsharded gradient (in the
  reduce dtype, fp32 by default) until the last micro-batch reduce-scatters the sum: +4Ψ bytes per rank
  for fp32 gradients, the memory the sharding of gradients had saved;
- HSDP (dp_replicate x dp_shard): the reduce-scatter inside the shard group still runs on every
  micro-batch (fast links, the gradient stays sharded), only the all-reduce across the replicas is
  skipped; the reduce-scattered shards are summed locally until the last micro-batch: +4Ψ/dp_shard;
- PowerSGD's replicated model (savers/powersgd.py): DDP's own switch, read by the *forward*, which is why
  the forward belongs inside the window.

Under pipeline parallelism torch's schedule already does this across its own micro-batches (its stages
turn FSDP's reduction off until the schedule step's last backward), so ``step`` is accepted there only
when the training loop itself does not accumulate (planning/layout_rules.py: ``saver_errors``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from torch import nn


def _allow_reduction(parts: list[nn.Module], allowed: bool, hsdp: bool) -> None:
    for part in parts:
        if isinstance(part, FSDPModule) and hsdp:
            part.set_requires_all_reduce(allowed)  # the reduce-scatter inside the shard group still runs
        elif hasattr(part, "set_requires_gradient_sync"):  # FSDPModule, or replicate's DDP (PowerSGD)
            part.set_requires_gradient_sync(allowed)


@contextlib.contextmanager
def reduction_window(parts: list[nn.Module], *, reduce: bool, hsdp: bool):
    """Run one micro-batch's forward and backward inside: its gradients are reduced only when ``reduce``. The forward
    belongs inside too (DDP decides there); on exit the default (reduce) is restored."""
    if reduce:
        yield
        return
    _allow_reduction(parts, False, hsdp)
    try:
        yield
    finally:
        _allow_reduction(parts, True, hsdp)
