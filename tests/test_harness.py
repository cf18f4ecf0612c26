"""The rank harness itself: a failure on one rank, in Python or in native code, reaches the test with its stack;
ranks and launched commands run on the CPU unless a test asks for GPUs."""

import ctypes
import os

import pytest
import torch.distributed as dist

from launch import local_runs
from launch.local_runs import TorchrunLaunch, run_train_cli
from launch.spawn import RankFailure, run_on_ranks


def raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke")
    return dist.get_rank()


def segfault_on_rank_1() -> int:
    if dist.get_rank() == 1:
        ctypes.string_at(0)  # read address 0: SIGSEGV, no Python exception
    return dist.get_rank()


def test_a_python_error_on_one_rank_fails_the_test_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)--- rank 1 ---.*ValueError: rank 1 broke"):
        run_on_ranks(raise_on_rank_1, 2, timeout=60)


def test_a_native_crash_on_one_rank_is_reported_with_its_python_stack():
    with pytest.raises(RankFailure) as err:
        run_on_ranks(segfault_on_rank_1, 2, timeout=60)
    report = str(err.value)
    assert "rank 1 produced no result (exit code -11)" in report
    assert "Segmentation fault" in report and "segfault_on_rank_1" in report  # the Python frame that crashed


# ---- the CPU unless asked: a GPU host must pass the default suite as this machine does -----------------------


def devices_seen() -> dict:
    import torch

    from runtime.process import select_device

    return {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": torch.cuda.is_available(),
        "auto": str(select_device("auto")),
    }


def test_spawned_ranks_see_no_gpu_unless_asked(monkeypatch):
    # As on a GPU host whose launcher gave this process GPU 3 (no GPU here: what is checked is what the ranks
    # are told, and that select_device("auto") then picks the CPU despite the harness's LOCAL_RANK).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    hidden = {"CUDA_VISIBLE_DEVICES": "", "cuda": False, "auto": "cpu"}
    assert run_on_ranks(devices_seen, 2, timeout=60) == [hidden, hidden]
    [shown] = run_on_ranks(devices_seen, 1, timeout=60, gpus=True)  # tests marked gpu
    assert shown["CUDA_VISIBLE_DEVICES"] == "3"


def test_launched_commands_see_no_gpu_unless_asked(monkeypatch, tmp_path):
    envs = []
    record = lambda cmd, **kwargs: envs.append(kwargs["env"])  # stands in for the launch
    monkeypatch.setattr(local_runs.subprocess, "run", record)
    monkeypatch.setattr(local_runs.subprocess, "Popen", record)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    run_train_cli(2, "--help")
    TorchrunLaunch(tmp_path, 2).out.close()
    run_train_cli(1, "--help", gpus=True)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["", "", "3"]
    assert all(env["OMP_NUM_THREADS"] == "1" for env in envs)


def test_a_test_of_its_own_subprocess_sees_no_gpu_unless_marked():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # tests/conftest.py: no_gpu_unless_marked
