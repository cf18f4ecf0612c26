"""Validation loss: the global token mean over the same held-out batches, identical on every layout.

``evaluate`` runs every ``eval.interval`` optimizer steps and after the last one (``eval_due``):

1. The validation loader is rewound to position 0, so every evaluation reads the same ``eval.steps``
   global batches, and each data-parallel rank takes its slice of them exactly as in training
   (data/loader.py): the tokens evaluated do not depend on the layout.
2. The model parts go to eval mode (MoE layers add no auxiliary loss), and each micro-batch runs forward
   only, without autograd. Under pipeline parallelism the schedule's forward-only path
   (``schedule.eval``, torch 2.13) passes activations from stage to stage, and the last stage computes the
   loss with the schedule's loss function (the token-loss sum divided by the global token count, which is
   multiplied back here, as training does). Under TP the cross-entropy runs on vocab-sharded logits.
   Exception: torch 2.13's forward-only path fails on the V-shaped schedules (ZBVZeroBubble, DualPipeV:
   the hand-off between the two stages of one rank asks for a backward that ``eval`` skipped). For those
   the ordinary training step runs and its gradients are dropped: the same forward gives the same loss,
   at the price of a backward (tests/test_real_data.py checks both paths against one process).
3. The token-loss sums of all micro-batches and batches are summed over the loss mesh (data-parallel ranks
   and pipeline stages; only last-stage ranks hold a non-zero part) and divided by the global number of
   tokens evaluated: ``eval.steps x global_batch x seq_len``.
4. Afterwards: parts back to train mode; FSDP units resharded (a forward with no backward leaves the units
   that keep their weights for backward gathered); MoE load counters cleared, so evaluation never counts
   toward the training step's expert load or bias update.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

from mesh.runtime import sum_over
from mesh.tensor_parallel import loss_context, loss_value


def eval_due(step: int, interval: int, last_step: int) -> bool:
    return interval > 0 and (step % interval == 0 or step == last_step)


def evaluate(
    parts, schedule, loader, *, steps: int, stage_ids: list[int], n_stages: int, loss_fn, tp_enabled: bool,
    loss_mesh, device: torch.device,
) -> float:  # fmt: skip
    """The validation loss (a float, the same on every rank); see the module docstring for the steps."""
    loader.load_state_dict({"tokens_consumed": 0})  # step 1
    global_tokens = loader.global_batch * loader.seq_len
    is_first, is_last = 0 in stage_ids, n_stages - 1 in stage_ids
    with_backward = isinstance(schedule, (ScheduleZBVZeroBubble, ScheduleDualPipeV))  # the exception of step 2
    for part in parts:
        part.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    try:
        for _ in range(steps):  # step 2
            for inputs, targets in loader.next_batch():
                inputs, targets = inputs.to(device), targets.to(device)
                with loss_context(tp_enabled), contextlib.nullcontext() if with_backward else torch.no_grad():
                    if schedule is None:
                        loss_sum += loss_value(loss_fn(parts[0](inputs), targets)).double()
                        continue
                    losses: list[torch.Tensor] = []
                    run = schedule.step if with_backward else schedule.eval
                    run(
                        *((inputs,) if is_first else ()),
                        **({"target": targets, "losses": losses} if is_last else {}),
                    )
                    loss_sum += sum(loss_value(loss.detach()).double() for loss in losses) * global_tokens
    finally:
        for part in parts:  # step 4
            part.train()
            for param in part.parameters():
                param.grad = None  # only the V-shaped fallback makes any; the optimizer step already used its own
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
                if hasattr(module, "reset_stats"):
                    module.reset_stats()
    sum_over(loss_sum, loss_mesh)  # step 3
    return (loss_sum / (steps * global_tokens)).item()
