"""The one seam observers attach through: hooks around the training step, so the loop never branches on a flag.

An observer watches a run without changing what it computes: the profiler, the rank-balance clock, the pipeline
timeline, the replica check. train.py builds the run's observers once, from the config (observers/registry.py:
each observer module's ``for_run(RunContext)`` returns the observer when its config key switches it on, under the
name the registry gives it); the step and the loop call every hook at its place, whichever observers are on. A
hook an observer does not need is the base class's, which does nothing. What changes how gradients travel is a
saver (savers/), attached where the model is parallelized, inside the step or as the optimizer: no hook.

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.process import ControlPlane
    from runtime.schema import Config


@dataclass(frozen=True)
class RunContext:
    """What an observer may be built from: the run's config, the step that was built (training/build.py:
    ``StepParts``: the plan, meshes, device, model parts, pipeline stages, tied embedding), the control plane and
    the first step to run. Each observer module has a ``for_run(ctx)`` that returns the observer when the config
    switches it on, else None."""

    cfg: Config
    step: Any  # training/step.py: StepParts (training imports this room, not the reverse)
    control: ControlPlane
    start_step: int


class Observer:
    """Every hook does nothing; an observer overrides the ones it needs (module docstring for when each runs)."""

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


class Observers(Observer):
    """The run's observers as one: each hook calls that hook of every observer, in the order they were added; each
    observer under its name (observers/registry.py), so the loop takes the one it reads by name."""

    def __init__(self):
        self.observers: dict[str, Observer] = {}

    def add(self, name: str, observer: Observer) -> Observer:
        assert name not in self.observers, f"two observers named {name!r}"
        self.observers[name] = observer
        return observer

    def named(self, name: str) -> Observer:
        """The observer added under ``name``; a KeyError names the ones that are on."""
        if name not in self.observers:
            raise KeyError(f"no observer named {name!r} in this run (on: {sorted(self.observers)})")
        return self.observers[name]

    def begin_step(self, step: int) -> None:
        for observer in self.observers.values():
            observer.begin_step(step)

    def step_started(self, wall: float) -> None:
        for observer in self.observers.values():
            observer.step_started(wall)

    def before_forward_backward(self) -> None:
        for observer in self.observers.values():
            observer.before_forward_backward()

    def after_forward_backward(self) -> None:
        for observer in self.observers.values():
            observer.after_forward_backward()

    def step_timed(self, wall: float) -> None:
        for observer in self.observers.values():
            observer.step_timed(wall)

    def after_step(self, step: int) -> None:
        for observer in self.observers.values():
            observer.after_step(step)

    def after_log(self, record: dict) -> list[str]:
        """The lines the observers have for the console after a logged step."""
        return [line for observer in self.observers.values() if (line := observer.after_log(record))]

    def end_step(self, step: int) -> None:
        for observer in self.observers.values():
            observer.end_step(step)

    def finish(self) -> None:
        for observer in self.observers.values():
            observer.finish()

    def close(self) -> None:
        for observer in self.observers.values():
            observer.close()
