"""Rank imbalance in view: how far the ranks' step compute times spread, and a warning when it lasts.

A rank that computes more slowly than its peers (a hotter or throttled GPU, a busier host, an uneven pipeline
stage) makes every other rank wait for it in the next collective, so every rank's *wall* step time is the
same and hides it. What differs is the time each rank spends working rather than waiting:

1. **Clock** (``compute_clock``). On CPU, the training thread's CPU time (``time.thread_time``): the thread
   burns it while it computes, and sleeps while a gloo collective waits for a peer (gloo's own threads move
   the bytes). On CUDA, the step's wall time on the host (the step's one read waits for the device): NCCL's
   kernels keep the device busy while they wait, so this reading sees imbalance only where no collective
   is in flight (not measured here: no GPU).
2. **Exchange.** Each rank's compute seconds for the step ride on the stop agreement that every step already
   runs on the CPU control plane (runtime/signals.py: ``agreed_stop``, one all-gather of a small CPU
   tensor): no collective of its own, no device sync, nothing on the device plane.
3. **Spread** (``fields``): max / min over the ranks, with the slowest and fastest ranks' seconds and the
   slowest rank's number, in metrics.jsonl as ``compute_spread``, ``compute_s_max``, ``compute_s_min``,
   ``slowest_rank`` (1.0 on one process).
4. **Warning** (``RankBalance.check``). meshloom's own health rule: compute time should differ by less than
   15% across ranks (the step runs at the slowest rank's pace, so at 1.15 the fastest waits 13% of every step;
   docs/profiling.md). When the spread exceeds ``SPREAD_RULE`` (1.15) on ``WARN_AFTER`` (3) logged steps
   in a row, rank 0 prints one warning naming the slowest rank; it stays quiet while that spell of imbalance
   lasts (a long run on a busy host would otherwise repeat it every few steps: metrics.jsonl keeps every
   step's spread) and counts again once a logged step is back within the rule.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from observers.base import Observer, RunContext
from runtime.process import device_time

if TYPE_CHECKING:
    import torch

SPREAD_RULE = 1.15  # max / min compute time across ranks: meshloom's "differ by less than 15%" rule
WARN_AFTER = 3  # logged steps in a row above the rule before the console warns


def compute_clock(device: torch.device, wall: float | None = None) -> float:
    """Step 1: a reading in seconds of this rank's own work: the training thread's CPU time, or on CUDA the
    host's wall time (``wall``, a ``time.perf_counter`` reading the step passes in; no sync of its own)."""
    if device.type == "cuda":
        return device_time(device) if wall is None else wall
    return time.thread_time()


def fields(times: list[float]) -> dict:
    """Step 3: the metrics.jsonl fields of one step from every rank's compute seconds (rank order)."""
    slowest = max(range(len(times)), key=times.__getitem__)
    fastest = min(times)
    return {
        "compute_spread": times[slowest] / fastest if fastest > 0 else float("inf"),
        "compute_s_max": times[slowest],
        "compute_s_min": fastest,
        "slowest_rank": slowest,
    }


def for_run(ctx: RunContext) -> RankBalance:
    """Always on: metrics.jsonl's compute_spread."""
    return RankBalance(ctx.step.plan.rank, ctx.step.device)


class RankBalance(Observer):
    """Times this rank's compute in each step (step 1) and warns when the spread lasts (step 4); an observer whose
    hooks (observers/base.py) start and stop the clock and give the warning."""

    def __init__(self, rank: int, device: torch.device):
        self.device = device
        self.started = 0.0
        self.streak = 0
        self.warned = False  # this spell of imbalance has had its warning
        self.compute_s = 0.0  # the last step's compute seconds, shared on the stop agreement (step 2)

    def start(self, wall: float) -> None:
        """At the step's start; ``wall`` is the step's own host clock reading."""
        self.started = compute_clock(self.device, wall)

    def elapsed(self, wall: float) -> float:
        """The step's compute seconds on this rank; ``wall`` is the step's closing host clock reading."""
        return compute_clock(self.device, wall) - self.started

    def step_started(self, wall: float) -> None:
        self.start(wall)

    def step_timed(self, wall: float) -> None:
        self.compute_s = self.elapsed(wall)

    def after_log(self, record: dict) -> str | None:
        return self.check(record)

    def check(self, record: dict) -> str | None:
        """After a logged step: the warning to print, once ``WARN_AFTER`` logged steps in a row exceeded the rule."""
        if record["compute_spread"] <= SPREAD_RULE:
            self.streak, self.warned = 0, False
            return None
        self.streak += 1
        if self.streak < WARN_AFTER or self.warned:
            return None
        self.warned = True
        return (
            f"meshloom: warning: step compute time differs across ranks by {record['compute_spread'] - 1:.0%} "
            f"(max / min {record['compute_spread']:.2f}: slowest rank {record['slowest_rank']} "
            f"{record['compute_s_max']:.3f} s, fastest {record['compute_s_min']:.3f} s) for {WARN_AFTER} logged "
            f"steps in a row, above the {SPREAD_RULE - 1:.0%} rule; every other rank waits for the slowest in "
            "each collective (an uneven pipeline split, a throttled device, a busy host: docs/profiling.md); "
            "said once until a logged step is back within the rule"
        )
