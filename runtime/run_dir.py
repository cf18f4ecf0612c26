"""The run folder: refuse to mix two runs in it, and lock it while a run is alive.

1. ``check_run_dir`` (every rank, before any process group): an existing ``metrics.jsonl`` belongs to an
   earlier run; a new run may not append to it unless it resumes that run's checkpoint or
   ``run.overwrite`` says so.
2. ``RunLock`` (taken by ``lock_run_folders`` on global rank 0, at start): an exclusive ``fcntl.flock`` on ``<run.dir>/.meshloom.lock``,
   held for the whole run. A second live run on the same folder cannot take it and is refused, naming the
   holder; the kernel releases the lock when its holder dies, however it dies, so a stale lock from a
   killed run is simply taken over (and said so). Rank 0's verdict reaches every rank through the control
   plane (mesh/runtime.ControlPlane.raise_if_any_failed) before the first collective on the model.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from runtime.config import ConfigError

LOCK_FILE = ".meshloom.lock"


def check_run_dir(run_dir: str, overwrite: bool, resuming: bool = False) -> None:
    """Refuse to append a new run to an old run's metrics (checked on every rank before any collective)."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.dir={run_dir!r} is a file, not a folder; choose another --run.dir.")
    metrics = path / "metrics.jsonl"
    if metrics.exists() and not (overwrite or resuming):
        raise ConfigError(
            f"run.dir={run_dir!r} already holds {metrics.name} from an earlier run; pass a new --run.dir, "
            "--run.overwrite true to replace it, or (if it has a checkpoint) --checkpoint.resume auto to continue it."
        )


class RunLock:
    """An exclusive lock on a run folder for the lifetime of this process (module docstring, step 2)."""

    def __init__(self, run_dir: str):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None
        self.took_over: dict | None = None  # the record of a dead run whose lock this run took

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            who = f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}" if holder else "?"
            raise ConfigError(
                f"run.dir={str(self.path.parent)!r} is in use by another live run ({who}); two runs in one folder "
                "would tear each other's metrics and checkpoints. Wait for it, stop it, or pass another --run.dir."
            ) from None
        previous = _read_record(fd)
        if previous:
            self.took_over = previous
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: the last run ended cleanly
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def lock_run_folders(folders: list[Path], control, locks: list[RunLock], is_rank0: bool) -> None:
    """Rank 0 locks each folder (run.dir, and the checkpoint folder when the run uses one, since another run
    may point its checkpoint.folder there) and appends the held locks to ``locks`` for the caller to release;
    every rank learns the verdict together through ``control`` (a runtime.process.ControlPlane)."""
    error = None
    if is_rank0:
        try:
            for folder in folders:
                lock = RunLock(str(folder)).acquire()
                locks.append(lock)
                if lock.took_over:
                    print(
                        f"meshloom: {folder} was locked by a run that is gone ({lock.took_over}); taking it over",
                        file=sys.stderr,
                        flush=True,
                    )
        except (ConfigError, OSError) as exc:
            error = exc if isinstance(exc, ConfigError) else ConfigError(f"run.dir={str(folders[0])!r}: {exc}")
    control.raise_if_any_failed(error, "locking run.dir", ConfigError)


def _read_record(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
