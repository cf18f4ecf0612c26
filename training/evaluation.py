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
   tokens evaluated: ``eval.steps x global_batch x seq_len`` (with a loss mask: the trained targets among them).
4. Afterwards: parts back to train mode; FSDP units resharded (a forward with no backward leaves the units
   that keep their weights for backward gathered); MoE load counters cleared, so evaluation never counts
   toward the training step's expert load or bias update.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import FSDPModule

from mesh.pipeline import SCHEDULE_FAMILIES
from mesh.reductions import sum_over
from training.step import forward_backward

if TYPE_CHECKING:
    from mesh.dims import Meshes
    from planning.plan import LayoutPlan
    from training.step import StepParts


def eval_due(step: int, interval: int, last_step: int) -> bool:
    return interval > 0 and (step % interval == 0 or step == last_step)


def evaluate_step(s: StepParts, loader, steps: int) -> float:
    """``evaluate`` with what the training step was built with (training/build.py)."""
    return evaluate(
        s.parts, s.schedule, loader, s.plan, s.meshes, steps=steps, device=s.device, loss_divisor=s.loss_divisor
    )


def evaluate(
    parts, schedule, loader, plan: LayoutPlan, meshes: Meshes, *, steps: int, device: torch.device, loss_divisor=None
) -> float:
    """The validation loss (a float, the same on every rank); see the module docstring for the steps."""
    loader.load_state_dict({"tokens_consumed": 0})  # step 1
    trained = 0  # the global count of trained targets over the steps (global_batch x seq_len each, unmasked)
    # the exception of step 2: torch 2.13's forward-only path fails on the V-shaped schedules
    forward_only = schedule is None or SCHEDULE_FAMILIES[plan.layout.pp_schedule].forward_only_eval
    for part in parts:
        part.eval()
    f64 = torch.float64
    loss_sum = torch.zeros((), device=device, dtype=f64)
    try:
        for _ in range(steps):  # step 2
            batch = loader.next_batch()
            trained += loader.trained_tokens
            for index, (inputs, targets) in enumerate(batch):
                inputs, targets = inputs.to(device), targets.to(device)
                docs = None if loader.documents is None else loader.documents[index].to(device)
                with torch.no_grad() if forward_only else contextlib.nullcontext():
                    # the training step's forward (training/step.py), without its backward where torch allows
                    backward = not forward_only
                    loss_sum += forward_backward(
                        parts,
                        schedule,
                        plan,
                        inputs,
                        targets,
                        backward=backward,
                        dtype=f64,
                        trained_tokens=loader.trained_tokens,
                        documents=docs,
                        loss_divisor=loss_divisor,
                    )
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
    sum_over(loss_sum, meshes.loss)  # step 3
    return (loss_sum / max(trained, 1)).item()
