"""Run meshloom on this machine's processes: the training core on N spawned gloo ranks, or the command line.

Tests and benches both start runs this way, so it lives in neither of them:

- ``train_on(n, overrides, run_dir)`` runs ``train.train`` on ``n`` ranks of ``launch/spawn.py`` and
  returns rank 0's per-step records (after checking that every rank logged the same loss);
- ``run_train_cli(n, *args)`` runs ``python train.py ARGS`` (n = 1) or ``torchrun ... train.py ARGS`` to the
  end and returns the finished process;
- ``TorchrunLaunch`` starts ``torchrun ... train.py ARGS`` in the background, with its output in a file that
  the caller watches, signals and waits on (the fault tests and measure/fault_timings.py);
- ``read_metrics(run_dir)`` reads back the per-step records a run wrote to ``run_dir/metrics.jsonl``;
- ``unprivileged(cmd)`` is ``cmd`` run the way a normal user's command runs as far as file permissions go:
  root's override of them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) dropped with ``setpriv``, so that a file
  made unreadable with ``chmod 000`` is unreadable to the run (the permission tests need that; containers and
  CI often run as root).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.spawn import device_environment, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = str(ROOT / "configs" / "debug.toml")
PARITY_STEPS = 6


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records in ``run_dir/metrics.jsonl`` (training/metrics.py writes one JSON object per line)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def refusal(overrides: dict, world_size: int, config: str = DEBUG_CONFIG) -> str | None:
    """What train.py would refuse in ``config`` with ``overrides`` on ``world_size`` ranks (the values, then the
    layout rules: planning/plan.py), as its message; None when it accepts them. A measurement asks before it
    spawns ranks, so that its options are refused in one line instead of as a rank's traceback."""
    from planning.plan import LayoutPlan
    from runtime.config import ConfigError, load_config

    try:
        LayoutPlan.resolve(load_config(path=config, overrides=overrides), world_size)
    except ConfigError as err:
        return " ".join(line.strip(" -") for line in str(err).strip().splitlines())
    return None


def run_training(overrides: dict, run_dir: str, config: str = DEBUG_CONFIG) -> list[dict]:
    """Rank body: train ``config`` with ``overrides``; returns this rank's per-step records."""
    from runtime.config import load_config
    from train import train

    base = {"training.steps": PARITY_STEPS, "run.dir": run_dir, "run.tensorboard": False}
    return train(load_config(path=config, overrides={**base, **overrides}))


def train_on(
    world_size: int, overrides: dict, run_dir, timeout: float = 180.0, config: str = DEBUG_CONFIG
) -> list[dict]:
    """Rank 0's records of a run on ``world_size`` ranks (every rank's loss is checked equal too)."""
    results = run_on_ranks(run_training, world_size, overrides, str(run_dir), config, timeout=timeout)
    for rank, records in enumerate(results[1:], start=1):
        assert [r["loss"] for r in records] == [r["loss"] for r in results[0]], f"rank {rank} logged another loss"
    return results[0]


# Every capability cleared: bounding and inheritable sets (after exec, root's permitted set is their union).
DROP_CAPABILITIES = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]


def unprivileged(cmd: list[str]) -> list[str] | None:
    """``cmd`` without the power to ignore file permissions (module docstring), or None where this process
    cannot arrange that (root without ``setpriv``, or a sandbox that refuses it)."""
    if os.geteuid() != 0:
        return cmd  # a normal user: permissions apply already
    probe = Path(tempfile.mkdtemp()) / "unreadable"
    try:
        probe.write_text("x")
        probe.chmod(0)
        try:
            denied = subprocess.run([*DROP_CAPABILITIES, "cat", str(probe)], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return [*DROP_CAPABILITIES, *cmd] if denied.returncode != 0 and b"ermission denied" in denied.stderr else None
    finally:
        shutil.rmtree(probe.parent, ignore_errors=True)


def train_command(nproc: int, *args: str) -> list[str]:
    """``python train.py ARGS`` (nproc 1) or ``torchrun --nproc-per-node N train.py ARGS``."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "train.py", *args]


def command_environment(env: dict | None = None, gpus: bool = False) -> dict[str, str]:
    """The environment of a launched command: this process's, one intra-op thread, no GPU unless ``gpus``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **device_environment(gpus), **(env or {})}


def run_train_cli(
    nproc: int,
    *args: str,
    env: dict | None = None,
    timeout: float = 300,
    prefix: list[str] | None = None,
    gpus: bool = False,
) -> subprocess.CompletedProcess:
    """``train_command(nproc, *args)`` from the repo root, to the end; ``prefix`` goes in front (``setpriv ...``)."""
    return subprocess.run(
        [*(prefix or []), *train_command(nproc, *args)],
        cwd=ROOT,
        env=command_environment(env, gpus),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class TorchrunLaunch:
    """``torchrun ... train.py ARGS`` in the background, its output in a file we can watch."""

    def __init__(
        self,
        tmp_path: Path,
        nproc: int,
        *args: str,
        restarts: int = 0,
        env: dict | None = None,
        gpus: bool = False,
        script: str = "train.py",  # or a test's wrapper that patches something, then runs train.py
    ):
        self.log = tmp_path / f"launch-{time.monotonic_ns()}.log"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}",
            script,
            "--config",
            DEBUG_CONFIG,
            "--run.tensorboard",
            "false",
            *args,
        ]
        self.out = open(self.log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=command_environment(env, gpus), stdout=self.out, stderr=subprocess.STDOUT
        )

    def text(self) -> str:
        return self.log.read_text()

    def seconds_until(self, pattern: str, timeout: float) -> float:
        """Seconds from now until ``pattern`` appears in the output (even if the launcher exits meanwhile)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if re.search(pattern, self.text()):
                return time.monotonic() - start
            time.sleep(0.1)
        return float("inf")

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            assert self.proc.poll() is None, f"exited before {pattern!r}:\n{self.text()[-4000:]}"
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"no {pattern!r} after {timeout} s:\n{self.text()[-4000:]}")

    def workers(self) -> dict[int, int]:
        """rank -> pid of the launcher's worker processes (read from /proc)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid:
                rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
                if rank is not None:
                    found[rank] = int(entry.name)
        return found

    def wait(self, timeout: float) -> tuple[int, float]:
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.text()[-4000:]}") from None
        finally:
            self.out.close()
        return code, time.monotonic() - start

    def kill(self) -> None:
        for pid in self.workers().values():
            os.kill(pid, signal.SIGKILL)
        self.proc.kill()
