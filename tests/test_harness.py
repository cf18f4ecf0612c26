"""The rank harness itself: a failure on one rank, in Python or in native code, reaches the test with its stack."""

import ctypes

import pytest
import torch.distributed as dist

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
