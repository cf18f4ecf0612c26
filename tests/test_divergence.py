"""A step whose loss or gradient norm is not finite never reaches the weights, the expert bias or a checkpoint.

The check sits between backward and the optimizer step (training/step.py): the loss is summed over the world and the
gradient norm measured first, both identical on every rank, so every rank stops at the same step with exit
code 3, and the newest checkpoint is the last finite step's.
"""

import math
import re
from pathlib import Path

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


def diverge_between_log_steps(run_dir: str) -> tuple[int, list[bool], list[int], int]:
    """Rank body: the diverging run logged only at its end, saving every 5 steps, the stop agreement every 6:
    (the step the error names, whether the weights were finite after each optimizer step, the saved steps, the
    step the run was at when it stopped)."""
    import training.optimizer as optim
    from checkpoint.folder import published
    from launch.local_runs import run_training
    from training.step import DivergenceError

    finite, plain = [], optim.Optimizers.step

    def checked(self):
        plain(self)
        finite.append(
            all(
                bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                for part in self.parts
                for p in part.parameters()
            )
        )

    optim.Optimizers.step = checked
    overrides = {
        "training.lr": 1e6,
        "training.grad_clip": 0.0,
        "training.steps": 20,
        "run.log_every": 100,
        "run.agree_every": 6,
        "checkpoint.interval": 5,
        "checkpoint.keep_last": 0,
    }
    try:
        run_training(overrides, run_dir)
    except DivergenceError as exc:
        bad = int(re.search(r"at step (\d+) the loss is (\S+) and the gradient norm (\S+);", str(exc)).group(1))
        return bad, finite, sorted(published(Path(run_dir) / "checkpoints")), len(finite)
    raise AssertionError("the run did not diverge")


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "fsdp2"])
def test_between_log_steps_the_device_flag_keeps_a_non_finite_step_from_the_weights_and_the_checkpoints(
    world, tmp_path
):
    # An ordinary step reads nothing on the host: the non-finite step is skipped on the device (fused AdamW's
    # found_inf), and the run stops at the next check step (a save every 5, an agreement every 6), exit 3.
    # This run first diverges at step 4 (lr 1e6), so steps 4 and 5 show it: 4 is skipped, 5 stops.
    from launch.spawn import run_on_ranks

    for bad, finite, saved, stopped_at in run_on_ranks(diverge_between_log_steps, world, str(tmp_path), timeout=240):
        assert bad >= 2 and all(finite), (bad, finite)
        assert saved == list(range(5, bad, 5)), (bad, saved)
        checks = [s for s in range(bad, 21) if s % 5 == 0 or s % 6 == 0]
        assert stopped_at == checks[0] - 1, (bad, stopped_at)  # the check step raises before its update
