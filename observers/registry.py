"""The run's observers, each under a name, in the order their hooks run (observers/base.py for the hooks).

Each observer module has a ``for_run(RunContext)`` that returns the observer when its config key switches it on,
else None; ``add_observers`` adds the ones that are on to the run's ``Observers``. The loop reads one of them
itself, the rank-balance clock (its compute time rides on the stop agreement): it takes it by name,
``observers.named("rank_balance")``, which is always on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from observers import pipeline_timeline, profiling, rank_balance, replica_check

if TYPE_CHECKING:
    from observers.base import Observers, RunContext

OBSERVERS = {
    "profiler": profiling.for_run,  # profile.enabled
    "rank_balance": rank_balance.for_run,  # always: metrics.jsonl's compute_spread
    "pipeline_timeline": pipeline_timeline.for_run,  # run.pp_timeline
    "replica_check": replica_check.for_run,  # debug.check_replicas
}


def add_observers(observers: Observers, ctx: RunContext) -> Observers:
    """Adds to ``observers`` every observer its config key switches on, in ``OBSERVERS``' order."""
    for name, for_run in OBSERVERS.items():
        if (observer := for_run(ctx)) is not None:
            observers.add(name, observer)
    return observers
