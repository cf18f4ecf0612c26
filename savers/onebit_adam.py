"""1-bit Adam (Tang et al. 2021): Adam whose data-parallel exchange sends one bit per element after a warm-up.

``parallel.grad_compression onebit_adam`` on a pure data-parallel layout (every rank a whole replica,
``dp_replicate`` = world size). The model is a plain replicated module: no FSDP, no DDP reducer; this
optimizer does the data-parallel communication itself, once per step. Adam's variance changes slowly once
training settles, and the momentum is a smoothed gradient that tolerates a coarse, error-compensated
exchange; so after a warm-up with exact Adam the variance is frozen and only the momentum travels, as signs.

Per step (meshloom sums gradients: each rank's gradient is its share of the global-mean loss, and the global
gradient is their sum, docs/data_parallel.md section 6):

Warm-up (the first ``parallel.onebit_warmup_steps`` steps): exact AdamW, as DDP.

1. ``prepare_gradients`` (train.py, before clipping): all-reduce (sum) every gradient over the replicas, in
   one flat fp32 buffer: the global gradient on every rank.
2. ``step``: torch's AdamW on it (the same kernel as every other layout: parity with DDP and one process).

Compression (every later step):

1. ``prepare_gradients``: no collective. Each rank multiplies its local gradient by the number of replicas,
   so that it estimates the global gradient (clipping then sees a gradient of the right size); the replicas
   then agree on one gradient norm for the log and the non-finite check (``agree_on_norm``: the largest
   local one, one scalar all-reduce).
2. Momentum from the local gradient: ``m_i = beta1 m + (1 - beta1) g_i``. The variance ``v`` stays frozen at
   its value after the warm-up, and so does its bias correction.
3. Error feedback: ``c_i = m_i + e_i``, where ``e_i`` is what this rank's last compression left out.
4. Compress: ``q_i = sign(c_i) * ||c_i|| / sqrt(n)`` per tensor (n elements; sign(0) = +1): one bit per
   element and one fp32 scale, with the same L2 norm as ``c_i``.

5. Keep the error for the next step: ``e_i = c_i - q_i``.
6. Exchange: the momentum becomes the mean of the ranks' ``q_i``, the same on every rank. This reference
   all-reduces the decompressed fp32 values (one flat buffer per step), which gives the mean exactly; an
   implementation for slow links sends the packed signs and the scales instead (DeepSpeed's compressed
   all-reduce: each rank sends its packed chunks to their owners, which average, re-compress with an error
   of their own, and all-gather the result). ``payload_bytes`` counts that compressed size:
   ceil(n / 8) + 4 bytes per tensor, against 4n for fp32.
7. AdamW's update with the frozen variance: ``p *= 1 - lr wd``, then
   ``p -= lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^W)) + eps)``, W the warm-up steps.

Checkpoints hold ``m``, ``v`` and the step count (AdamW's state, the same on every replica), not the error
buffers, which are each rank's own: a run resumed after the warm-up restarts error feedback at zero, like
PowerSGD's compressor (docs/dp_savers.md, section 3).

Every replica applies the same ``m`` and the same frozen ``v``: the replicas stay bitwise equal (the replica
check, observers/replica_check.py, holds under 1-bit Adam too). What cannot use it is refused before any process
group exists (planning/layout_rules.py: ``saver_errors``): sharded states (dp_shard > 1, FSDP), TP, PP and CP
(the momentum would be a shard, and the model is not a plain replica), bf16 and CPU offload (FSDP's).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mesh.data_parallel import sum_from_mean
from mesh.reductions import reduced_as_one, sum_in_place


class OneBitAdam(torch.optim.AdamW):
    """AdamW for the warm-up, then 1-bit compressed momentum with frozen variance (module docstring)."""

    def __init__(self, params, *, group, warmup_steps: int, **adamw):
        super().__init__(params, **adamw)
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.warmup_steps = warmup_steps
        self.payload_bytes = 0  # gradient or momentum bytes this rank handed to the exchange, all steps so far
        # Step 5's error buffers, one per parameter. They differ from rank to rank, so they are kept out of the
        # optimizer's state: DCP saves a plain tensor once, as if every rank held the same (and may take any
        # rank's copy), and would hand one rank's error to all. A resume after the warm-up restarts them at zero.
        self.errors: dict[torch.Tensor, torch.Tensor] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.grad is not None]

    @property
    def steps_done(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state[p]:
                    return int(self.state[p]["step"])
        return 0

    @property
    def compressing(self) -> bool:
        return self.steps_done >= self.warmup_steps

    @torch.no_grad()
    def prepare_gradients(self) -> None:
        """Step 1 of either phase: the global gradient (warm-up) or this rank's estimate of it (compression)."""
        grads = [p.grad for p in self._params()]
        if not grads:
            return
        if self.compressing:
            for g in grads:
                sum_from_mean(g, self.replicas)
            return
        # The one gradient all-reduce of a warm-up step, on the replicas' group (device plane).
        sum_in_place(grads, self.group)
        self.payload_bytes += sum(g.numel() * g.element_size() for g in grads)

    @torch.no_grad()
    def agree_on_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """Compression phase: the largest of the replicas' local gradient norms, on every replica (warm-up: the
        norm is already global and the same everywhere)."""
        if not self.compressing:
            return norm
        agreed = norm.detach().clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        self.payload_bytes += agreed.numel() * agreed.element_size()  # 4 bytes a step, counted all the same
        return agreed

    @torch.no_grad()
    def step(self, closure=None):
        if not self.compressing:
            return super().step(closure)
        work = []  # (param, its group, its compressed momentum)
        for group in self.param_groups:
            beta1, _ = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                if p not in self.errors:
                    self.errors[p] = torch.zeros_like(p)
                m, error = state["exp_avg"], self.errors[p]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)  # step 2
                c = m + error  # step 3
                scale = c.norm() / math.sqrt(c.numel())  # step 4
                q = torch.where(c >= 0, scale, -scale)
                error.copy_(c - q)  # step 5
                work.append((p, group, q))
        if not work:
            return None

        # Step 6: one exchange per step for the whole model.
        def mean_over_replicas(flat: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(flat, group=self.group)
            return flat.div_(self.replicas)

        means = reduced_as_one([q for _, _, q in work], mean_over_replicas)
        self.payload_bytes += sum(math.ceil(q.numel() / 8) + 4 for _, _, q in work)
        for (p, group, _q), mean in zip(work, means, strict=True):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.copy_(mean.view_as(m))
            t = float(state["step"])
            # Step 7: decoupled weight decay, then the update with the variance frozen after the warm-up.
            p.mul_(1 - group["lr"] * group["weight_decay"])
            denom = (v / (1 - beta2**self.warmup_steps)).sqrt_().add_(group["eps"])
            p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
        return None
