import os

# One intra-op thread per process: ranks share two cores, and more threads were measured 3-6x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU backend checks, once per process, that each vector ISA /proc/cpuinfo reports builds and loads: six
# `python -c "import torch ..."` children per rank, 11-12 CPU-seconds on torch 2.11's wheel, the same on every rank
# and every run. "1" trusts cpuinfo instead; the same ISA is picked (avx512_vnni here on 2.11, 2.13 and 2.15), and
# one that would not build fails the compile loudly rather than changing a result.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.training_runs import SharedRun, SharedRuns  # noqa: E402

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


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    """The session's shared training runs (the one-process references above all), each trained once."""
    return SharedRuns(tmp_path_factory.mktemp("shared-runs"))


# Saving does not change the curve (every resume test relies on it), so the debug config's reference also
# saves at steps 3 and 6, for the tests that resume from it or export it: one run serves both.
SAVING = {"checkpoint.interval": 3}


@pytest.fixture(scope="session")
def one_process_saving(shared_runs) -> SharedRun:
    """configs/debug.toml on one process for PARITY_STEPS steps, saving at steps 3 and 6: records and folder."""
    return shared_runs.run(SAVING)


@pytest.fixture(scope="session")
def one_process(one_process_saving) -> list[dict]:
    """The debug config's one-process curve, which every layout of the debug config matches."""
    return one_process_saving.records


# Compiled layouts are checked over more steps than PARITY_STEPS (issue 51's bar: 10), against this eager curve.
COMPILED_PARITY_STEPS = {"training.steps": 10}


@pytest.fixture(scope="session")
def one_process_10_steps(shared_runs) -> list[dict]:
    """The debug config's one-process eager curve over 10 steps, which every compiled layout matches."""
    return shared_runs.records(COMPILED_PARITY_STEPS)
