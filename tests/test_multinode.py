"""More than one machine, played by two torchrun agents on this one (``--nnodes 2`` with c10d rendezvous).

Each agent stands for a node with one GPU. The multi-node run trains the same model as one process, and a
checkpoint folder that is not one folder shared by every rank (here: each "node" given its own path, as a
node-local /tmp would be) is refused at start, naming the fix, before any training.
"""

import os
import socket
import subprocess
import sys
import time

from launch.local_runs import DEBUG_CONFIG, PARITY_STEPS, ROOT, read_metrics
from tests.training_runs import assert_same_curve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp_path, per_node_args, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Launch one torchrun agent per element of ``per_node_args`` (list of arg lists); wait for both."""
    port, procs = free_port(), []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for node, extra in enumerate(per_node_args):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "meshloom-test",
            "train.py",
            "--config",
            DEBUG_CONFIG,
            "--training.steps",
            str(PARITY_STEPS),
            *extra,
        ]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    deadline, done = time.monotonic() + timeout, []
    for node, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise AssertionError(f"node {node} still running after {timeout} s") from None
        log.close()
        done.append(subprocess.CompletedProcess(proc.args, code, (tmp_path / f"node{node}.log").read_text(), ""))
    return done


def test_two_nodes_train_the_same_model_as_one_process(one_process, tmp_path):
    shared = ["--run.dir", str(tmp_path / "run"), "--checkpoint.interval", "3"]
    for node in two_nodes(tmp_path, [shared, shared]):
        assert node.returncode == 0, node.stdout[-3000:]
    assert_same_curve(read_metrics(tmp_path / "run"), one_process)


def test_a_checkpoint_folder_that_is_not_shared_is_refused_at_start(tmp_path):
    # A rank waits min(30 s, collective_timeout_s / 4) for the others' markers before it declares them missing
    # (checkpoint/folder.py: check_shared); a 20 s collective timeout makes that 5 s instead of the default 30.
    start = time.monotonic()
    nodes = two_nodes(
        tmp_path,
        [
            [
                "--run.dir",
                str(tmp_path / "run"),
                "--checkpoint.interval",
                "2",
                "--checkpoint.folder",
                str(tmp_path / f"local{n}"),
                "--parallel.collective_timeout_s",
                "20",
            ]
            for n in range(2)
        ],
        timeout=120,
    )
    assert time.monotonic() - start < 60
    for n, node in enumerate(nodes):
        assert node.returncode != 0
        assert f"checkpoint.folder='{tmp_path / f'local{n}'}' is not one folder shared by every rank" in node.stdout
        assert "put it on a filesystem every node mounts at the same path" in node.stdout
        assert "exitcode  : 2" in node.stdout
        assert "step     1 |" not in node.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before training"
