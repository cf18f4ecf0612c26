"""The user-facing commands: `python train.py` and `torchrun ... train.py`, compared through metrics.jsonl."""

import pytest

from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS, ROOT, read_metrics, run_train_cli
from tests.training_runs import assert_same_curve


def launch(tmp_path, name: str, nproc: int, *args: str) -> list[dict]:
    run_dir = tmp_path / name
    proc = run_train_cli(nproc, *args, "--training.steps", str(PARITY_STEPS), "--run.dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step " in proc.stdout and "tok/s" in proc.stdout
    records = read_metrics(run_dir)
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_bytes"):
        assert key in records[0], key
    assert (run_dir / "tb").is_dir() and any((run_dir / "tb").iterdir()), "no TensorBoard events"
    return records


@pytest.fixture(scope="module")
def embedded_default(tmp_path_factory):
    """`python train.py` with no --config: the embedded default (the same model as configs/debug.toml)."""
    return launch(tmp_path_factory.mktemp("cli"), "one", 1)


def test_embedded_default_trains(embedded_default):
    assert embedded_default[-1]["loss"] < embedded_default[0]["loss"] - 0.5


def test_torchrun_fsdp4_matches_one_process(embedded_default, tmp_path):
    run = launch(tmp_path, "fsdp4", 4, "--config", DEBUG_CONFIG, "--parallel.dp_shard", "4")
    assert_same_curve(run, embedded_default)


@pytest.mark.slow
def test_torchrun_hsdp_matches_one_process(embedded_default, tmp_path):
    run = launch(
        tmp_path, "hsdp", 4, "--config", DEBUG_CONFIG, "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"
    )
    assert_same_curve(run, embedded_default)


@pytest.mark.slow
def test_torchrun_fsdp2_x_tp2_matches_one_process(embedded_default, tmp_path):
    run = launch(tmp_path, "fsdp2xtp2", 4, "--config", DEBUG_CONFIG, "--parallel.dp_shard", "2", "--parallel.tp", "2")
    assert_same_curve(run, embedded_default)


@pytest.mark.slow
def test_torchrun_3d_pipeline_matches_one_process(embedded_default, tmp_path):
    run = launch(
        tmp_path,
        "pp2xfsdp2xtp2",
        8,
        "--config",
        DEBUG_CONFIG,
        "--parallel.pp",
        "2",
        "--parallel.dp_shard",
        "2",
        "--parallel.tp",
        "2",
        "--parallel.pp_schedule",
        "ZBVZeroBubble",
    )
    assert_same_curve(run, embedded_default)


@pytest.mark.slow
def test_torchrun_4d_moe_matches_one_process(tmp_path):
    moe = str(ROOT / "configs" / "debug_moe.toml")
    reference = launch(tmp_path, "moe-one", 1, "--config", moe)
    run = launch(
        tmp_path,
        "moe-4d",
        8,
        "--config",
        moe,
        "--parallel.pp",
        "2",
        "--parallel.dp_shard",
        "2",
        "--parallel.tp",
        "2",
        "--parallel.ep",
        "2",
    )
    assert_same_curve(run, reference)
    assert [r["expert_load"] for r in run] == [r["expert_load"] for r in reference]
