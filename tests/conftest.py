import os

import pytest

# One intra-op thread per process: ranks share two cores, and more threads were measured 3-6x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_gpu_unless_marked(request, monkeypatch):
    """Every command a test starts sees no GPU unless the test is marked ``gpu``.

    launch/spawn.py and launch/local_runs.py already pin their ranks and commands to the CPU; this also covers
    a test's own ``subprocess`` calls, which inherit this environment. On a GPU host the CPU tests would
    otherwise run on ``cuda:LOCAL_RANK`` (tests/test_harness.py).
    """
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
