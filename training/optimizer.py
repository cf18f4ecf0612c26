"""AdamW with linear warmup then cosine decay, one optimizer per model part.

A rank may hold several model parts (two pipeline stages under a V schedule). Each part gets its own AdamW
and LR schedule, so that its optimizer state can be saved and loaded under the part's own parameter names
(checkpoint/), whatever the pipeline split. Within a part, parameters are grouped by (weight decay, mesh):
fused foreach kernels cannot mix DTensors that live on different meshes (dense vs expert weights).

With ``parallel.grad_compression onebit_adam`` the optimizer is 1-bit Adam (savers/onebit_adam.py), which
exchanges the data-parallel gradient (warm-up) or the compressed momentum (after it) itself:
``prepare_gradients`` runs before clipping, ``agree_on_norm`` after it; both do nothing for plain AdamW.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from runtime.schema import Config


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr after ``step`` optimizer steps: linear warmup, then cosine to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(part: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on 1-D parameters (norm weights); one group per (decay, mesh)."""
    groups: dict[tuple, list] = defaultdict(list)
    for p in part.parameters():
        mesh = getattr(p, "device_mesh", None)
        groups[(p.ndim >= 2, id(mesh) if mesh is not None else None)].append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0} for (decay, _), ps in groups.items()]


class Optimizers:
    """One AdamW + LambdaLR per model part, stepped together."""

    def __init__(self, parts: list[nn.Module], cfg: Config, replicate_group=None, steps: int | None = None):
        t = cfg.training
        self.parts = parts
        adamw = {"lr": t.lr, "betas": (t.beta1, t.beta2), "foreach": True}
        # 1-bit Adam has no found_inf: the step reads the divergence flag before every update instead
        self.obeys_found_inf = cfg.parallel.grad_compression != "onebit_adam"
        if not self.obeys_found_inf:
            from savers.onebit_adam import OneBitAdam

            self.optimizers = [
                OneBitAdam(
                    param_groups(part, t.weight_decay),
                    group=replicate_group,
                    warmup_steps=cfg.parallel.onebit_warmup_steps,
                    **adamw,
                )
                for part in parts
            ]
        else:
            # fused: one kernel per group, its step counter on the device (no host read for the bias correction),
            # and found_inf, which skips the update on the device (training/step.py, step 5); on CPU it
            # computes what foreach computes (bit for bit on torch 2.13's CPU kernels)
            fused = {**adamw, "foreach": None, "fused": True}
            self.optimizers = [torch.optim.AdamW(param_groups(part, t.weight_decay), **fused) for part in parts]
        total = steps or t.steps  # the plan's (training.epochs may set it)
        schedule = lambda step: lr_factor(step, t.warmup_steps, total, t.min_lr_ratio)  # noqa: E731
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, schedule) for opt in self.optimizers]

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def prepare_gradients(self) -> None:
        """Before clipping: 1-bit Adam's data-parallel exchange of the gradients (savers/onebit_adam.py, step 1)."""
        for opt in self.optimizers:
            if hasattr(opt, "prepare_gradients"):
                opt.prepare_gradients()

    def agree_on_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """After clipping: the gradient norm every replica logs and checks (1-bit Adam's compression phase)."""
        for opt in self.optimizers:
            if hasattr(opt, "agree_on_norm"):
                norm = opt.agree_on_norm(norm)
        return norm

    def skip_if(self, found_inf: torch.Tensor) -> None:
        """The next ``step`` is skipped on the device where ``found_inf`` (a device scalar, 1.0 or 0.0) is 1.0,
        without a host read: fused AdamW's GradScaler hook (the update is not applied, its step counter rolled
        back). Only where ``obeys_found_inf``."""
        assert self.obeys_found_inf, "this optimizer cannot skip a step on the device"
        for opt in self.optimizers:
            opt.found_inf = found_inf

    def step(self) -> None:
        """Apply the gradients, clear them, and advance the LR schedule."""
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for sched in self.schedulers:
            sched.step()
