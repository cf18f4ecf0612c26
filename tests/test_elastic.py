"""Elastic training as it really runs: ``torchrun --nnodes 1:2``, one node lost, the survivor resumes alone.

Two torchrun agents on this machine play two nodes of 2 ranks each (c10d rendezvous, ``--nnodes 1:2``,
``--max-restarts 1``). Once step 2 is saved, node B goes away, in one of two ways:

- ``notice``: its launcher gets SIGTERM (a node taken away with notice). meshloom's ranks agree to stop after
  the current step, save it and exit;
- ``no-notice``: its launcher and its workers are SIGKILLed together (a node that dies). Node A's ranks fail in
  their next collective ("a peer closed its connection") and nothing is saved beyond the last interval save.

Either way node A's launcher restarts its workers; the new rendezvous finds one node (the minimum), so the
restarted run has a world of 2 instead of 4, and ``--checkpoint.resume auto`` loads the 4-rank checkpoint onto
2 ranks (``dp_shard -1`` takes the whole world: FSDP 4 becomes FSDP 2). The loss curve is the one-process
curve, before and after the change of world size, replayed steps included (docs/troubleshooting.md, Appendix B).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS, ROOT, read_metrics
from tests.training_runs import assert_same_curve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers_of(launcher: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["notice", "no-notice"])
def test_a_lost_node_leaves_a_smaller_world_that_resumes_on_the_same_curve(how, one_process, tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "elastic",
        "--max-restarts",
        "1",
        "train.py",
        "--config",
        DEBUG_CONFIG,
        "--training.steps",
        str(PARITY_STEPS),
        "--checkpoint.interval",
        "2",
        "--checkpoint.resume",
        "auto",
        "--run.dir",
        str(run_dir),
        "--run.tensorboard",
        "false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / "nodeA.log", tmp_path / "nodeB.log"]
    nodes = []
    for log in logs:  # node A first: it hosts the rendezvous store and must outlive node B
        nodes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))  # noqa: SIM115
        time.sleep(2)
    try:
        deadline = time.monotonic() + 240
        while "saved step 2" not in logs[0].read_text():  # a save to come back to
            assert time.monotonic() < deadline and nodes[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        if how == "notice":
            nodes[1].send_signal(signal.SIGTERM)  # node B is taken away
        else:
            for pid in [*workers_of(nodes[1]), nodes[1].pid]:  # node B dies
                os.kill(pid, signal.SIGKILL)
        nodes[1].wait(timeout=120)
        assert nodes[0].wait(timeout=300) == 0, logs[0].read_text()[-4000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    text = logs[0].read_text()
    assert "meshloom | world 4 |" in text and "meshloom | world 2 |" in text
    assert "dp_shard=4 cp=1 tp=1, now pp=1 dp_replicate=1 dp_shard=2" in text  # the resume reshards 4 -> 2
    if how == "notice":
        assert "stopped by SIGTERM after step" in logs[1].read_text()
    else:
        assert "a peer closed its connection" in text
    assert_same_curve(read_metrics(run_dir), one_process)
