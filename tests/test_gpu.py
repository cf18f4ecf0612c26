"""CUDA checks (marked `gpu`, deselected by default; run with `pytest -m gpu` on a machine with GPUs)."""

import json

import pytest
import torch

from tests.training_runs import DEBUG_CONFIG, run_train_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_gpu_bf16_trains(tmp_path):
    proc = run_train_cli(
        1, "--config", DEBUG_CONFIG, "--training.device", "cuda", "--training.mixed_precision", "bf16",
        "--training.steps", "20", "--run.dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = records(tmp_path)
    assert run[-1]["loss"] < run[0]["loss"] - 1.0
    assert run[-1]["peak_mem_bytes"] > 0  # torch.cuda.max_memory_allocated on GPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_fsdp_matches_one_gpu_over_nccl(tmp_path):
    common = ["--config", DEBUG_CONFIG, "--training.device", "cuda", "--training.steps", "6"]
    one = run_train_cli(1, *common, "--run.dir", str(tmp_path / "one"))
    two = run_train_cli(2, *common, "--parallel.dp_shard", "2", "--run.dir", str(tmp_path / "two"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    for a, b in zip(records(tmp_path / "two"), records(tmp_path / "one"), strict=True):
        # fp32 on GPU: TF32 is off by default for matmuls in PyTorch, so the CPU tolerance argument holds.
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5
