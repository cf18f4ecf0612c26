"""Shared pieces of the parity tests: the fp32 tolerance, the loss-curve comparison, and the runs several
tests compare with, above all the one-process references (trained once per session: ``SharedRuns``).

A one-process reference is train.py's own core on a world of one; tests/reference.py is the independent check
of that core (a plain loop that shares no code with train.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import NamedTuple

from launch.local_runs import DEBUG_CONFIG, train_on

# fp32 parity tolerance. Sharded runs add the same numbers in a different order (reduce-scatter, all-reduce,
# split matmuls): each sum differs by ~1e-7 relative, and a few optimizer steps grow that to ~1e-6 on the
# loss (measured: <= 3e-7 over 6 steps). 1e-5 leaves headroom yet still fails on any real bug, which shows
# up at 1e-3 or more (a gradient scaled by 1/dp, a wrong data slice, a different init).
LOSS_RTOL = 1e-5

# Multi-rank parity runs also compare their replicas after every step (observers/replica_check.py): a layout that
# left two replicas of a parameter with different bits fails there, and a clean layout shows no false positive.
CHECK_REPLICAS = {"debug.check_replicas": 1}


def assert_same_curve(
    actual: list[dict], expected: list[dict], rtol: float = LOSS_RTOL, keys=("loss", "grad_norm"), tokens: bool = True
):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        for key in keys:
            rel = abs(a[key] - e[key]) / abs(e[key])
            assert rel <= rtol, f"step {e['step']} {key}: {a[key]!r} vs reference {e[key]!r} (rel {rel:.2e} > {rtol})"
        if tokens:
            assert a["tokens_consumed"] == e["tokens_consumed"]


class SharedRun(NamedTuple):
    records: list[dict]  # rank 0's per-step records (launch/local_runs.py: train_on)
    checkpoints: Path  # its checkpoint folder (run.dir/checkpoints), filled when the overrides save


class SharedRuns:
    """Training runs that several tests compare with, each trained once per session (tests/conftest.py's
    ``shared_runs``): above all the one-process references, ``shared_runs.records(overrides, config)``.

    A run is ``world`` gloo ranks (1 unless given) training ``config`` with ``overrides`` for PARITY_STEPS
    steps unless the overrides say otherwise. The first test that asks for a (world, config, overrides)
    trains it; every later one gets the same records, as a fresh copy. The checkpoint folder is shared:
    tests read it or copy from it, and never write into it.
    """

    def __init__(self, root: Path):
        self.root = root
        self.runs: dict[tuple, SharedRun] = {}

    def run(self, overrides: dict | None = None, config: str = DEBUG_CONFIG, world: int = 1) -> SharedRun:
        overrides = dict(overrides or {})
        assert "checkpoint.folder" not in overrides and "run.dir" not in overrides, "a shared run has its own folders"
        key = (world, config, tuple(sorted(overrides.items())))
        if key not in self.runs:
            run_dir = self.root / f"run{len(self.runs)}"
            checked = {**CHECK_REPLICAS, **overrides} if world > 1 else overrides
            self.runs[key] = SharedRun(train_on(world, checked, run_dir, config=config), run_dir / "checkpoints")
        found = self.runs[key]
        return SharedRun(copy.deepcopy(found.records), found.checkpoints)

    def records(self, overrides: dict | None = None, config: str = DEBUG_CONFIG, world: int = 1) -> list[dict]:
        return self.run(overrides, config, world).records
