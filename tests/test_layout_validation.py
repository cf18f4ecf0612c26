"""What validation does around the rules: a valid layout passes, run.dir and the corpus are checked before any
process group, and a failure on one rank reaches every rank (the rules themselves: test_bad_input.py:
CONFIG_ERRORS)."""

import os

import pytest

from launch.local_runs import DEBUG_CONFIG
from runtime.config import ConfigError, load_config
from train import check_config


def refusal(world_size: int, **overrides) -> str:
    cfg = load_config(path=DEBUG_CONFIG, overrides={k.replace("__", "."): v for k, v in overrides.items()})
    with pytest.raises(ConfigError) as err:
        check_config(cfg, world_size)
    return str(err.value)


def test_a_valid_layout_passes(tmp_path):
    cfg = load_config(path=DEBUG_CONFIG, overrides={"parallel.dp_shard": 2, "run.dir": str(tmp_path)})
    plan, _ = check_config(cfg, 4 // 2)
    assert plan.dims.dp == 2


def test_existing_metrics_are_not_overwritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    msg = refusal(1, run__dir=str(tmp_path))
    assert "run.dir" in msg and "--run.overwrite true" in msg
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


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
