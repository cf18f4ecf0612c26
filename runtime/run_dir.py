"""The run folder: refuse to mix two runs in it, and lock it while a run is alive.

1. ``check_run_dir`` (every rank, before any process group): an existing ``metrics.jsonl`` belongs to an
   earlier run; a new run may not append to it unless it resumes that run's checkpoint or
   ``run.overwrite`` says so.
2. ``RunLock``: an exclusive ``fcntl.flock`` on ``<folder>/.meshloom.lock``, on run.dir and on the
   checkpoint folder when the run uses one (another run may point its ``checkpoint.folder`` there), held for
   the whole run. The kernel releases it when its holder dies, however it dies, so a stale lock from a
   killed run is simply taken over (and said so). ``lock_run_folders`` takes the locks before any process
   group exists, so that a second run on a folder in use is refused in seconds, naming the field, the
   folder and the holder:

   a. global rank 0 takes each lock (retrying for half a second: another rank of its own job may be
      looking at the lock at that instant, step b);
   b. when every rank runs on rank 0's node (one torchrun, or one process), the other ranks look too: a
      lock held by a live process of *another* job (the lock file records the job: torchrun's run id and
      rendezvous store, the same on every worker of a job) refuses the run on every rank at once, each
      with exit 2, before any of them starts the process group;
   c. otherwise (several nodes, whose run.dir may be a node-local path; or a process group that already
      exists) rank 0's verdict reaches every rank through the control plane
      (runtime/process.py: ControlPlane.raise_if_any_failed) before the first collective on the model.

   A folder given twice (checkpoint.folder equal to run.dir, by any spelling: ``run/x/..`` or a symlink to
   it) is locked once: folders are compared by their real path.
   Before all of this, ``refuse_live_runs`` (train.check_config, every rank) refuses a folder a live run
   holds as in use, naming its pid, before any other check looks inside and would ask to remove the live
   run's checkpoints or metrics.
3. The lock holds the folder's identity: the device and inode of the folder and of its lock file, taken
   when it is locked. ``folder_lost`` compares them with what the paths name now; rank 0 calls it before
   each metrics line and (shared on the control plane) before each save. A folder removed (``rm -rf
   run.dir``) or replaced under the run stops it with ``RunFolderLost`` (exit 4, saying which), before
   anything is written: a write would re-create the folder, or land in another run's folder, whose own lock
   a second run may hold by then.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from runtime.config import ConfigError
from runtime.files import parse_json

LOCK_FILE = ".meshloom.lock"
HELD: list[RunLock] = []  # the locks this process holds, for folder_lost (step 3)


class RunFolderLost(RuntimeError):
    """The run's folder was removed or replaced while the run was alive (step 3): exit 4, nothing written."""


def symlink_loop(path: str | Path) -> bool:
    """Whether ``path`` (or a folder above it) is a symlink loop, which ``mkdir`` and ``is_dir`` fail on without naming
    the cause."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def refuse_symlink_loop(path: str | Path, field: str) -> None:
    if symlink_loop(path):
        raise ConfigError(
            f"{field}={str(path)!r} is a symlink loop (a symbolic link that leads, directly or through others, back "
            f"to itself, so it names no folder); point --{field} at a real folder, or fix the link "
            "(`ls -l` shows where each link points)."
        )


def check_run_dir(run_dir: str, overwrite: bool, resuming: bool = False) -> None:
    """Refuse to append a new run to an old run's metrics (checked on every rank before any collective)."""
    path = Path(run_dir)
    refuse_symlink_loop(path, "run.dir")
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

    def __init__(self, folder: str | Path, field: str = "run.dir"):
        self.folder, self.field = Path(folder), field
        self.path = self.folder / LOCK_FILE
        self.fd: int | None = None
        self.took_over: dict | None = None  # the record of a dead run whose lock this run took
        self.identity: tuple[int, int] | None = None  # (device, inode) of the folder when it was locked

    def acquire(self, job: str | None = None, patience_s: float = 0.5) -> RunLock:
        """Take the lock, or raise the ConfigError naming the live holder. ``patience_s``: how long to retry
        while the lock is held, which a look by another rank of this job (step 2b) does for microseconds."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + patience_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                holder = _read_record(fd)
                os.close(fd)
                raise in_use(self.field, self.folder, holder) from None
        previous = _read_record(fd)
        if previous:
            self.took_over = previous
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "job": job or job_id(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd
        folder = os.stat(self.folder)
        self.identity = (folder.st_dev, folder.st_ino)
        HELD.append(self)
        return self

    def lost(self) -> str | None:
        """Why the locked folder is no longer this run's (step 3), or None while it is."""
        if self.fd is None or self.identity is None:
            return None
        try:
            folder = os.stat(self.folder)
        except FileNotFoundError:
            return f"{self.field}={str(self.folder)!r} was removed while the run was alive"
        if (folder.st_dev, folder.st_ino) != self.identity:
            return f"{self.field}={str(self.folder)!r} was replaced by another folder while the run was alive"
        held = os.fstat(self.fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.field}={str(self.folder)!r} lost its lock file {LOCK_FILE} while the run was alive"
        if (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
            return f"{self.field}={str(self.folder)!r} has another run's lock file now"
        return None

    def release(self) -> None:
        if self in HELD:
            HELD.remove(self)
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: the last run ended cleanly
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def folder_lost() -> RunFolderLost | None:
    """Step 3: the error to stop with when a folder this process locked is gone or replaced, else None."""
    for lock in HELD:
        why = lock.lost()
        if why:
            return RunFolderLost(
                f"{why}; stopping, and writing nothing more (not the metrics, not a checkpoint): a write would "
                "re-create the folder or land in another run's. Keep run.dir in place while a run is alive; resume "
                "from a checkpoint kept elsewhere with --checkpoint.resume auto."
            )
    return None


def in_use(field: str, folder: Path, holder: dict) -> ConfigError:
    """The refusal of a folder whose lock a live run holds."""
    who = f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}" if holder else "?"
    torn = "metrics and checkpoints" if field == "run.dir" else "checkpoints"
    return ConfigError(
        f"{field}={str(folder)!r} is in use by another live run ({who}); two runs in one folder would tear each "
        f"other's {torn}. Wait for it, stop it, or pass another --{field}."
    )


def job_id() -> str:
    """The job this process belongs to: under torchrun its run id and rendezvous store (the same on every
    worker of one job, and no two live jobs share a store address); otherwise this process alone."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun {env['TORCHELASTIC_RUN_ID']} at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    return f"pid {os.getpid()} on {socket.gethostname()}"


def live_holder(folder: Path) -> dict | None:
    """The record of the live process holding ``folder``'s lock ({} if it has not written one yet), or None
    when nobody holds it. Looks with a shared lock, released at once; creates nothing."""
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_record(fd)
        return None  # free: closing the file below drops the shared lock
    finally:
        os.close(fd)


def check_not_in_use(folder: Path, field: str, job: str, patience_s: float = 2.0) -> None:
    """Step 2b on a rank other than 0: refuse a folder whose lock a live process of another job holds."""
    deadline = time.monotonic() + patience_s
    while True:
        holder = live_holder(folder)
        if holder is None or holder.get("job") == job:
            return  # free (rank 0 is about to take it), or rank 0 of this job holds it
        if holder or time.monotonic() > deadline:
            raise in_use(field, folder, holder)
        time.sleep(0.02)  # a holder between taking the lock and writing its record: likely this job's rank 0


def real_folder(folder: str | Path) -> str:
    """The folder a path names, whatever its spelling: ``..``, ``.`` and symlinks resolved (as far as it exists).
    Two fields naming one folder are locked once (step 2)."""
    return os.path.realpath(Path(folder).expanduser())


def refuse_live_runs(folders: list[tuple[str, Path]]) -> None:
    """Before anything looks inside the folders (every rank, before any process group): a folder whose lock a
    live process of another job holds is refused as in use, naming that process. Without this, the checks
    that run first (runtime/run_dir.py ``check_run_dir``, checkpoint/resume.py) would tell the second run to
    remove or overwrite the live run's metrics and checkpoints. Creates nothing."""
    job, seen = job_id(), set()
    for field, folder in folders:
        if real_folder(folder) in seen:
            continue
        seen.add(real_folder(folder))
        try:
            holder = live_holder(Path(folder))
        except OSError:
            continue  # unreadable: the lock itself says so later, naming the reason
        if holder is None or holder.get("job") == job or holder.get("pid") == os.getpid():
            continue  # free, or this job's own
        raise in_use(field, Path(folder), holder)


def all_on_one_node(world_size: int) -> bool:
    """Every rank runs on this node (one process, or one torchrun holding the whole world)."""
    return world_size == 1 or os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)


def lock_run_folders(
    folders: list[tuple[str, Path]], locks: list[RunLock], rank: int, look: bool
) -> ConfigError | None:
    """Step 2 before any process group: rank 0 locks each (field, folder) into ``locks``; with ``look`` the others check
    them. Returns None or the ConfigError to raise (after the control plane shared it: step 2c)."""
    job = job_id()
    field, folder = folders[0]
    seen: set[str] = set()
    try:
        for field, folder in folders:
            if real_folder(folder) in seen:
                continue  # checkpoint.folder is run.dir (by any spelling): one lock; a second flock would wait on the first
            seen.add(real_folder(folder))
            if rank == 0:
                lock = RunLock(folder, field).acquire(job)
                locks.append(lock)
                if lock.took_over:
                    print(
                        f"meshloom: {folder} was locked by a run that is gone ({lock.took_over}); taking it over",
                        file=sys.stderr,
                        flush=True,
                    )
            elif look:
                check_not_in_use(folder, field, job)
    except ConfigError as exc:
        return exc
    except OSError as exc:
        return ConfigError(
            f"{field}={str(folder)!r}: its lock file cannot be created ({(exc.strerror or str(exc)).lower()}); "
            f"make the folder writable, or pass another --{field}."
        )
    return None


def _read_record(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        record = parse_json(data, LOCK_FILE, "") if data.strip() else {}
    except (OSError, ConfigError):  # unreadable or not ours (a hand edit, a torn write): no holder is known
        return {}
    return record if isinstance(record, dict) else {}
