"""Shared helpers for parity tests: run the training core on N ranks and compare the per-step records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = str(ROOT / "configs" / "debug.toml")
PARITY_STEPS = 6

# fp32 parity tolerance. Sharded runs add the same numbers in a different order (reduce-scatter, all-reduce,
# split matmuls): each sum differs by ~1e-7 relative, and a few optimizer steps grow that to ~1e-6 on the
# loss (measured: <= 3e-7 over 6 steps). 1e-5 leaves headroom yet still fails on any real bug, which shows
# up at 1e-3 or more (a gradient scaled by 1/dp, a wrong data slice, a different init).
LOSS_RTOL = 1e-5


def run_training(overrides: dict, run_dir: str, config: str = DEBUG_CONFIG) -> list[dict]:
    """Rank body: train ``config`` with ``overrides``; returns this rank's per-step records."""
    from config import load_config
    from train import train

    base = {"training.steps": PARITY_STEPS, "run.dir": run_dir, "run.tensorboard": False}
    return train(load_config(path=config, overrides={**base, **overrides}))


def train_on(
    world_size: int, overrides: dict, run_dir, timeout: float = 180.0, config: str = DEBUG_CONFIG
) -> list[dict]:
    """Rank 0's records of a run on ``world_size`` ranks (every rank's loss is checked equal too)."""
    results = run_on_ranks(run_training, world_size, overrides, str(run_dir), config, timeout=timeout)
    for rank, records in enumerate(results[1:], start=1):
        assert [r["loss"] for r in records] == [r["loss"] for r in results[0]], f"rank {rank} logged another loss"
    return results[0]


def assert_same_curve(actual: list[dict], expected: list[dict], rtol: float = LOSS_RTOL, keys=("loss", "grad_norm")):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        for key in keys:
            rel = abs(a[key] - e[key]) / abs(e[key])
            assert rel <= rtol, f"step {e['step']} {key}: {a[key]!r} vs reference {e[key]!r} (rel {rel:.2e} > {rtol})"
        assert a["tokens_consumed"] == e["tokens_consumed"]


def run_train_cli(nproc: int, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` (nproc 1) or ``torchrun --nproc-per-node N train.py ARGS``, from the repo root."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [*launcher, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
