"""A step whose loss or gradient norm is not finite never reaches the weights, the expert bias or a checkpoint.

The check sits between backward and the optimizer step (training/step.py): the loss is summed over the world and the
gradient norm measured first, both identical on every rank, so every rank stops at the same step with exit
code 3, and the newest checkpoint is the last finite step's.
"""

import math
import re

import pytest
import torch

from checkpoint.export import load_model_state
from checkpoint.folder import published
from launch.local_runs import DEBUG_CONFIG, read_metrics, run_train_cli


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "fsdp2"])
def test_a_diverging_run_stops_before_the_step_and_saves_nothing_after_the_last_finite_one(nproc, tmp_path):
    proc = run_train_cli(
        nproc,
        "--config",
        DEBUG_CONFIG,
        "--training.lr",
        "1e6",
        "--training.grad_clip",
        "0",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_last",
        "0",
        "--training.steps",
        "10",
        "--run.dir",
        str(tmp_path),
        timeout=240,
    )
    assert proc.returncode == (3 if nproc == 1 else 1), proc.stderr[-3000:]  # torchrun itself exits 1 ...
    if nproc > 1:  # ... and reports each worker's own exit code
        assert re.search(r"exitcode\s*:\s*3", proc.stderr), proc.stderr[-3000:]
    found = re.search(r"at step (\d+) the loss is (\S+) and the gradient norm (\S+);", proc.stderr)
    assert found, proc.stderr[-3000:]
    diverged = int(found.group(1))
    assert not (math.isfinite(float(found.group(2))) and math.isfinite(float(found.group(3))))
    assert diverged >= 2, "the first step of this run is finite; the check must not fire early"
    # Every finite step was saved, nothing at or after the diverged one, and the newest weights are finite.
    saved = list(published(tmp_path / "checkpoints"))
    assert saved == list(range(1, diverged)), saved
    state, _ = load_model_state(tmp_path / "checkpoints" / f"step-{diverged - 1}")
    assert all(torch.isfinite(t).all() for t in state.values())
    logged = read_metrics(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, diverged))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logged)


def diverge_counting_optimizer_steps(run_dir: str) -> tuple[int, int]:
    """Rank body: the diverging run, counting the optimizer steps actually taken; (steps taken, diverged)."""
    import training.optimizer as optim
    from launch.local_runs import run_training
    from training.step import DivergenceError

    taken, plain = [], optim.Optimizers.step

    def counted(self):
        taken.append(1)
        plain(self)

    optim.Optimizers.step = counted
    try:
        run_training({"training.lr": 1e6, "training.grad_clip": 0.0, "training.steps": 10}, run_dir)
    except DivergenceError as exc:
        return len(taken), int(re.search(r"at step (\d+)", str(exc)).group(1))
    raise AssertionError("the run did not diverge")


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "fsdp2"])
def test_the_diverged_step_never_reaches_the_optimizer(world, tmp_path):
    from launch.spawn import run_on_ranks

    for taken, diverged in run_on_ranks(diverge_counting_optimizer_steps, world, str(tmp_path), timeout=180):
        assert taken == diverged - 1, f"{taken} optimizer steps for a run that diverged at step {diverged}"
