"""Misfit layouts are refused before any process group exists, naming the field, the value and the fix."""

import os
import time

import pytest

from launch.local_runs import DEBUG_CONFIG, run_train_cli
from runtime.config import ConfigError, load_config
from train import check_config


def refusal(world_size: int, **overrides) -> str:
    cfg = load_config(path=DEBUG_CONFIG, overrides={k.replace("__", "."): v for k, v in overrides.items()})
    with pytest.raises(ConfigError) as err:
        check_config(cfg, world_size)
    return str(err.value)


def test_degrees_that_do_not_multiply_to_the_world():
    msg = refusal(4, parallel__dp_shard=3)
    assert "WORLD_SIZE=4" in msg and "dp_shard" in msg and "= 3" in msg and "make the product equal" in msg


def test_dp_shard_rest_that_does_not_divide():
    msg = refusal(4, parallel__dp_replicate=3)
    assert "parallel.dp_shard=-1" in msg and "WORLD_SIZE=4" in msg


def test_tp_must_divide_the_heads():
    msg = refusal(3, parallel__tp=3, parallel__dp_shard=1)
    assert "parallel.tp=3 does not divide model.n_heads=8" in msg
    assert "parallel.tp=3 does not divide model.n_kv_heads=4" in msg


def test_every_broken_rule_is_reported_at_once():
    msg = refusal(6, parallel__dp_shard=6, training__global_batch=8, training__seq_len=4096)
    assert "training.global_batch=8 is not divisible" in msg
    assert "training.seq_len=4096 exceeds model.max_seq_len" in msg


def test_micro_batch_must_divide_the_local_batch():
    assert "training.micro_batch=3 does not divide the per-rank batch 4" in refusal(
        2, parallel__dp_shard=2, training__micro_batch=3
    )


def test_expert_parallel_needs_experts():
    assert "parallel.ep=2 needs an MoE model" in refusal(2, parallel__ep=2, parallel__dp_shard=2)


def test_a_valid_layout_passes(tmp_path):
    cfg = load_config(path=DEBUG_CONFIG, overrides={"parallel.dp_shard": 2, "run.dir": str(tmp_path)})
    plan, _ = check_config(cfg, 4 // 2)
    assert plan.dims.dp == 2


def test_existing_metrics_are_not_overwritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    msg = refusal(1, run__dir=str(tmp_path))
    assert "run.dir" in msg and "--run.overwrite true" in msg
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_torchrun_misfit_fails_fast_on_every_rank(tmp_path):
    start = time.monotonic()
    proc = run_train_cli(
        4, "--config", DEBUG_CONFIG, "--parallel.dp_shard", "3", "--run.dir", str(tmp_path), timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    reports = [line for line in out.splitlines() if "configuration error" in line]
    # Every rank validates the same config with no process group, so every rank that gets that far prints
    # the same report; torchrun may stop slower ranks once the first has exited (observed: all four print).
    assert reports, out[-2000:]
    assert len({line.split(":", 1)[1] for line in reports}) == 1, reports
    assert "make the product equal the number of processes" in out
    assert "Connection closed" not in out and "Timeout" not in out
    assert elapsed < 90, f"took {elapsed:.0f} s"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"model.n_heads": 0}, "model.n_heads=0 must be >= 1"),
        (
            {"model.dim": 120, "model.n_heads": 8, "model.n_kv_heads": 8},
            "must be even (rotary embeddings rotate pairs)",
        ),
        ({"run.log_every": 0}, "run.log_every=0 must be >= 1"),
        ({"training.global_batch": 0}, "training.global_batch=0 must be >= 1"),
        ({"training.lr": -1.0}, "training.lr=-1.0 must be > 0"),
        ({"model.moe_shared_experts": 2}, "model.moe_shared_experts=2 must be >= 0 and <= 1"),
    ],
)
def test_out_of_range_values_are_refused(overrides, expected, tmp_path):
    msg = refusal(1, run__dir=str(tmp_path), **{k.replace(".", "__"): v for k, v in overrides.items()})
    assert expected in msg


def test_a_corpus_shorter_than_one_global_batch_is_refused_before_any_process_group(tmp_path):
    (tmp_path / "tiny.txt").write_text("too short")
    msg = refusal(1, data__source=str(tmp_path / "tiny.txt"), run__dir=str(tmp_path / "run"))
    assert "holds 9 training tokens, fewer than one global batch" in msg and "8 x 128 + 1 = 1,025" in msg


def test_a_failure_on_rank_0_alone_is_raised_on_every_rank(tmp_path):
    # Another live run holds run.dir's lock (this test process plays it): only rank 0 tries the lock, so
    # only rank 0 fails. The others must learn it at once, with its message, instead of waiting in the first
    # collective.
    from launch.local_runs import run_training
    from launch.spawn import RankFailure, run_on_ranks
    from runtime.run_dir import RunLock

    held = RunLock(str(tmp_path / "run")).acquire()
    try:
        with pytest.raises(RankFailure) as err:
            run_on_ranks(run_training, 2, {"parallel.dp_shard": 2}, str(tmp_path / "run"), DEBUG_CONFIG, timeout=60)
    finally:
        held.release()
    report = str(err.value)
    assert "still running" not in report
    # Both ranks raise, and both show rank 0's message (the fix), not just "another rank failed".
    assert report.count("--- rank ") == 2 and report.count("is in use by another live run") == 2
    assert f"pid {os.getpid()}" in report and "(reported by rank 0)" in report
