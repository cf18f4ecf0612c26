"""The checkpoint folder: its layout, and the checks that run before the first step rather than at the first save.

``checkpoint.folder`` (default ``<run.dir>/checkpoints``) holds one folder per saved step::

    step-6/            published: DCP's .metadata and __<rank>_0.distcp shards, plus meshloom.json
    step-9.tmp/        being written, or left by a killed run: never read; removed at the next start
    step-4.damaged/    a published step that failed verification, moved aside by ``resume auto``
    step-3.deleting/   being removed by keep-last-K

Before training, so that a bad folder costs seconds, not an interval of training:

1. ``check_writable`` (every rank, before any process group): the folder can be created and written, and
   its filesystem has room for one checkpoint (``checkpoint_bytes``: fp32 weights + two AdamW moments).
2. ``remove_stale`` (rank 0, under the run lock): ``.tmp`` and ``.deleting`` folders left by killed runs.
3. ``check_shared`` (every rank, on the control plane): every rank writes a marker file, all wait, and each
   must see every rank's marker. A folder that is node-local (each node its own ``/tmp``, or two nodes given
   different paths) fails here with the fix, instead of a resume that finds half the shards missing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from runtime.config import ConfigError
from runtime.run_dir import refuse_symlink_loop

if TYPE_CHECKING:
    from runtime.schema import Config

STEP_DIR = re.compile(r"^step-(\d+)$")
STALE = ("step-*.tmp", "step-*.deleting")


def checkpoint_folder(cfg: Config) -> Path:
    return Path(cfg.checkpoint.folder or Path(cfg.run.dir) / "checkpoints")


def locked_folders(cfg: Config, uses_checkpoints: bool) -> list[tuple[str, Path]]:
    """The (field, folder) pairs a run locks (runtime/startup.py): run.dir, and the checkpoint folder when the run
    saves into it or resumes from it."""
    folders = [("run.dir", Path(cfg.run.dir))]
    if cfg.checkpoint.interval > 0 or uses_checkpoints:
        folders.append(("checkpoint.folder", checkpoint_folder(cfg)))
    return folders


def published(folder: Path) -> dict[int, Path]:
    """step -> folder of every published step-N (``.tmp`` and other names are ignored), oldest first."""
    if not folder.is_dir():
        return {}
    found = {int(m.group(1)): p for p in folder.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))}
    return dict(sorted(found.items()))


def checkpoint_bytes(num_params: int) -> int:
    """About what one checkpoint takes: fp32 weights (4 B) + AdamW's two fp32 moments (8 B) per parameter."""
    return 12 * num_params + (1 << 20)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_writable(folder: Path, need_bytes: int) -> None:
    """Step 1 (raises ConfigError naming the folder and the fix)."""
    refuse_symlink_loop(folder, "checkpoint.folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"meshloom")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"checkpoint.folder={str(folder)!r} cannot be written ({exc.strerror or exc}); choose a writable "
            "--checkpoint.folder (or --run.dir), or set --checkpoint.interval 0 to train without saving."
        ) from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise ConfigError(
            f"checkpoint.folder={str(folder)!r} has {_gib(free)} free, but one checkpoint of this model needs about "
            f"{_gib(need_bytes)} (weights + AdamW state); free space there or choose another --checkpoint.folder."
        )


def remove_stale(folder: Path) -> list[str]:
    """Step 2: remove what killed runs left (rank 0 only; the run lock keeps other runs out)."""
    removed = []
    for pattern in STALE:
        for path in sorted(folder.glob(pattern)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def move_aside(path: Path) -> str:
    """Rename a damaged step to ``step-N.damaged`` (``-1``, ... when taken), never read again; returns what happened.
    One that cannot be renamed stays: every rank has already ruled it out."""
    target, n = path.with_name(f"{path.name}.damaged"), 1
    try:
        while target.exists():
            target, n = path.with_name(f"{path.name}.damaged-{n}"), n + 1
        os.rename(path, target)
    except OSError as exc:
        return (
            f"could not move the damaged checkpoint {path} aside ({(exc.strerror or str(exc)).lower()}); it stays "
            "where it is and is not read: move or remove it by hand"
        )
    return f"moved the damaged checkpoint {path} aside to {target.name}; it is kept, not read"


def _missing_markers(markers: Path, world: int, patience_s: float) -> list[int]:
    """Ranks whose marker this rank cannot open, each by name (NFS may serve a listing from cache), retried for
    ``patience_s``."""
    deadline = time.monotonic() + patience_s
    while True:
        missing = []
        for r in range(world):
            try:
                with open(markers / f"rank-{r}"):
                    pass
            except OSError:
                missing.append(r)
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


def check_shared(folder: Path, control) -> None:
    """Step 3: every rank must see every rank's marker (a collective on the control plane)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    run_id = control.broadcast_object(uuid.uuid4().hex if rank == 0 else None)
    markers = folder / f".shared-check-{run_id}"
    error = None
    try:
        markers.mkdir(parents=True, exist_ok=True)
        (markers / f"rank-{rank}").write_text(socket.gethostname())
    except OSError as exc:
        error = ConfigError(f"checkpoint.folder={str(folder)!r} cannot be written on {socket.gethostname()} ({exc}).")
    control.raise_if_any_failed(error, "checking the checkpoint folder", ConfigError)
    control.barrier()  # every rank has written its marker
    missing = _missing_markers(markers, world, patience_s=min(30.0, control.timeout_s / 4))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        error = ConfigError(
            f"checkpoint.folder={str(folder)!r} is not one folder shared by every rank: on {socket.gethostname()}, "
            f"rank {rank} does not see the markers of rank(s) {shown}. Every rank writes its shards there and "
            "reads the others' on resume: put it on a filesystem every node mounts at the same path (NFS, "
            "Lustre, ...), and pass the same path to every node."
        )
    control.raise_if_any_failed(error, "checking the checkpoint folder", ConfigError)
    control.barrier()  # every rank has looked
    (markers / f"rank-{rank}").unlink(missing_ok=True)
    try:
        markers.rmdir()  # the last rank out removes the folder
    except OSError:
        pass
