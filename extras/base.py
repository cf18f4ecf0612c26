"""The one seam extras attach through: hooks around the training step, so the loop never branches on a flag.

An extra is a feature a run may switch on that is not the algorithm itself: the profiler, the rank-balance
clock, the pipeline timeline, the replica check. train.py builds the list of the run's extras once, from the
config: each extra module's ``for_run(RunContext)`` returns the extra when its config key switches it on
(train.py: ``EXTRAS``); the step and the loop call every hook at its place, whichever extras are in the list. A
hook an extra does not need is the base class's, which does nothing. The extras that change how gradients
travel attach at the two other seams, and need no hook, a file each:

- where the model is parallelized (training/build.py builds mesh/parallelize.py's ``ParallelOptions``):
  powersgd.py (``powersgd``: a replicated model in FSDP's place); bf16 reduction and CPU offload are plain
  FSDP options there (``reduce_dtype``, ``offload_policy``);
- inside the step: reduce_once_per_step.py (``parallel.grad_sync step``: training/step.py runs each
  micro-batch in its ``reduction_window``), and onebit_adam.py (1-bit Adam replaces the optimizer:
  training/optimizer.py, ``Optimizers``).

The hooks, in the order one step calls them:

1. ``begin_step(step)``: before the step's clock starts (the profiler opens its step);
2. ``step_started(wall)``: the step's first clock reading (the rank-balance clock starts);
3. ``before_forward_backward()`` / ``after_forward_backward()``: around the micro-batches' forward and backward,
   after data loading (the pipeline timeline's window);
4. ``step_timed(wall)``: the step's last clock reading, after the optimizer step;
5. ``after_step(step)``: after the step is timed, before anything is logged or saved (the replica check: a check
   step's throughput stays comparable);
6. ``after_log(record)``: on a logged step, a line for the console or None (the rank-balance warning);
7. ``end_step(step)``: the step is over (the profiler closes its step);

and once: ``finish()`` after the last step (the pipeline timeline is gathered and written), ``close()`` on every
exit path (the profiler writes a trace that is still open).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunContext:
    """What an extra may be built from: the run's config and its built parts (train.py's ``build``). Each extra
    module has a ``for_run(ctx)`` that returns the extra when the config switches it on, else None."""

    cfg: Any
    plan: Any
    meshes: Any
    device: Any
    control: Any
    parts: list
    stages: list
    tied: Any
    start_step: int


class Extra:
    """Every hook does nothing; an extra overrides the ones it needs (module docstring for when each runs)."""

    def begin_step(self, step: int) -> None:
        pass

    def step_started(self, wall: float) -> None:
        pass

    def before_forward_backward(self) -> None:
        pass

    def after_forward_backward(self) -> None:
        pass

    def step_timed(self, wall: float) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def after_log(self, record: dict) -> str | None:
        return None

    def end_step(self, step: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class Extras(Extra):
    """The run's extras as one: each hook calls that hook of every extra, in the list's order."""

    def __init__(self, extras: list[Extra] | None = None):
        self.extras = list(extras or [])

    def add(self, extra: Extra) -> Extra:
        self.extras.append(extra)
        return extra

    def begin_step(self, step: int) -> None:
        for extra in self.extras:
            extra.begin_step(step)

    def step_started(self, wall: float) -> None:
        for extra in self.extras:
            extra.step_started(wall)

    def before_forward_backward(self) -> None:
        for extra in self.extras:
            extra.before_forward_backward()

    def after_forward_backward(self) -> None:
        for extra in self.extras:
            extra.after_forward_backward()

    def step_timed(self, wall: float) -> None:
        for extra in self.extras:
            extra.step_timed(wall)

    def after_step(self, step: int) -> None:
        for extra in self.extras:
            extra.after_step(step)

    def after_log(self, record: dict) -> list[str]:
        """The lines the extras have for the console after a logged step."""
        return [line for extra in self.extras if (line := extra.after_log(record))]

    def end_step(self, step: int) -> None:
        for extra in self.extras:
            extra.end_step(step)

    def finish(self) -> None:
        for extra in self.extras:
            extra.finish()

    def close(self) -> None:
        for extra in self.extras:
            extra.close()
