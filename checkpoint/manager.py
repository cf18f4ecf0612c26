"""Checkpoints during a run: choose and load the resume point, save atomically, verify, keep the last K.

The folder layout and the checks before training are in checkpoint/folder.py; which step to resume from
is decided before any process group exists in checkpoint/resume.py; checksums are in checkpoint/verify.py.

Starting (``start``, every rank, right after the process group exists):

1. Every rank checks that the folder is one folder shared by all ranks (``folder.check_shared``), and the
   ranks compare what ``find_resume`` saw there: every rank must have seen the same steps. (Each rank
   decided on its own, before any process group; a folder that differs between ranks would otherwise
   make them issue different collectives.)
2. Rank 0 moves aside the published steps ``find_resume`` found damaged (``step-N.damaged``: never
   deleted, never read again) and removes ``.tmp``/``.deleting`` folders left by killed runs.
3. ``choose``: the ranks hash the resume candidate's shards, each rank a share of the files, and agree on
   the result on the control plane. A damaged shard, or one this rank cannot read, is reported by name
   and reason to every rank; under ``resume auto`` the run falls back to the next good step (said loudly),
   under an explicit step every rank stops with exit 2. A step that cannot be moved aside is said so and
   left where it is.

Saving step N (every ``checkpoint.interval`` steps, at the last step, and when a signal stops the run):

1. The ranks agree that step-N does not exist, so a published checkpoint is never overwritten.
2. Rank 0 removes a stale step-N.tmp; a barrier on the control plane (runtime/process.py).
3. ``dcp.save`` (or ``dcp.async_save``: see "Asynchronous saves" below) into step-N.tmp. Each rank writes
   its shards; rank 0 writes .metadata only after every rank reported its writes, so when rank 0's save
   returns, everything is on disk.

4. Each rank hashes the files it wrote (``__<rank>_*.distcp``; rank 0 also ``.metadata``) while they are
   still in the page cache, and the digests are gathered on the checkpoint group, so no rank reads more
   than its share. Rank 0 publishes: meshloom.json (step, model config, layout, tokens consumed, versions,
   and the size and SHA-256 of every file) into the folder, then ``rename(step-N.tmp, step-N)``, atomic
   on POSIX. A reader sees the whole checkpoint or none of it. Then it deletes all but the newest
   ``keep_last`` (a failure there is a warning: the new step is already safe).
5. The ranks agree on the control plane that it worked. If any rank failed (a full disk, a read-only
   folder), rank 0 removes step-N.tmp, so the failed save keeps no disk space, and every rank raises
   ``CheckpointSaveError`` with one line naming the error, the folder, the fix for that error (free space
   for a full disk, permissions for a denied write), what became of the partial ``.tmp`` (removed, could
   not be removed, or never created) and the newest good checkpoint.
   With ``checkpoint.async``, step 5 runs when the next save starts or training ends (``wait``); the publishing itself happens
   in a thread as soon as the write finished. ``close`` drains a save in flight and stops its thread on
   every exit path, also when training failed.

DCP's own collectives run on a gloo group of their own (the checkpoint group): an async save issues them
from a background thread while the training thread uses the control plane.

Asynchronous saves (``checkpoint.async``): the training thread waits only for the copy it must:

1. ``save`` hands the state to ``dcp.async_save`` with a stager of its own (``DefaultStager``), a fresh one per
   save: torch 2.11's stager closes its copier after each copy and cannot stage twice, and a stager closed
   once the previous save was written holds no host buffers between saves. On a GPU the copies go to pinned
   host memory with non-blocking copies on a side stream, and everywhere the copying runs in a staging thread.
   On a GPU, ``save`` first waits for the work already queued on the device (the optimizer step that made the
   state): the side stream does not wait for the compute stream by itself. Then it returns: the next step's
   forward and backward run while the state is copied, since they read the weights but change only gradients.
2. ``wait_staged``, called by train.py just before the optimizer step, waits until the copy is done: from there
   on the live weights and Adam state may change. This wait, and the call to ``save``, are all the training
   thread stalls for.
3. A writing thread (DCP's) writes the staged copy, then the publishing thread hashes and publishes it
   (steps 3-4 of "Saving"); the next save or the end of training waits for that (``wait``, step 5).

measure/async_save.py measures the training thread's stall of a synchronous and an asynchronous save.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from checkpoint.folder import check_shared, checkpoint_folder, move_aside, published, remove_stale
from checkpoint.hf import import_safetensors
from checkpoint.resume import FORMAT, META_FILE, Resume, check_usable, inspect, read_meta, warn
from checkpoint.safe_pickle import planner, reader, refused_value
from checkpoint.state import apply_training_state, training_state
from checkpoint.verify import METADATA, digest_problems, file_digests, seal
from data.dataset import stream_identity
from mesh.dims import ParallelDims
from runtime.config import ConfigError
from runtime.files import disk_errno, disk_problem
from runtime.process import ControlPlane, all_gather_objects, new_cpu_group, synchronize
from runtime.run_dir import RunFolderLost, folder_lost

if TYPE_CHECKING:
    from runtime.schema import Config


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (disk full, folder gone); its ``.tmp`` was removed. Raised on every rank."""


def meshloom_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshloom")
    except PackageNotFoundError:  # a source checkout that was not pip-installed
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.is_file() else "unknown"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What to do about a failed save, by the OS error behind it (anything else: the generic advice).
FIX_BY_ERRNO = {
    errno.ENOSPC: "Free space there or set --checkpoint.folder elsewhere",
    errno.EDQUOT: "Free space there (a disk quota) or set --checkpoint.folder elsewhere",
    errno.EACCES: "Make the folder writable for this user again or set --checkpoint.folder elsewhere",
    errno.EPERM: "Make the folder writable for this user again or set --checkpoint.folder elsewhere",
    errno.EROFS: "The filesystem is read-only: set --checkpoint.folder elsewhere",
}
OTHER_FIX = "Fix the folder or set --checkpoint.folder elsewhere"


def _describe(error: BaseException, folder: Path) -> tuple[int | None, str, int | None]:
    """(the rank where it failed, if DCP says; one line; the errno): the OS error, wherever DCP wrapped it; torch's
    own writer keeps no errno ("[enforce fail at inline_container.cc] ... file write failed"), so a full disk is
    told from the space left (runtime/files.py: ``disk_problem``)."""
    if isinstance(error, CheckpointException):
        for rank, failure in error.failures.items():  # (exception, traceback) per failed rank
            return rank, *_describe(failure[0] if isinstance(failure, tuple) else failure, folder)[1:]
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):
        reason = "the disk is full" if cause.errno == errno.ENOSPC else (cause.strerror or str(cause)).lower()
        where = f" writing {cause.filename}" if cause.filename else ""
        return None, f"{reason}{where} ({errno.errorcode.get(cause.errno, 'OSError')})", cause.errno
    problem = disk_problem(error, folder)
    if problem is not None:
        return None, problem, disk_errno(error, folder)
    return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", None


def staging_options(device: torch.device) -> StagingOptions:
    """How an async save copies the state off the live tensors: pinned memory needs a GPU; the writer is a thread, so no
    shared memory."""
    on_gpu = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=on_gpu
    )


class CheckpointManager:
    """Resume, periodic saves and the final save of one training run (see the module docstring)."""

    def __init__(self, cfg: Config, plan, resume: Resume, control: ControlPlane, device: torch.device | None = None):
        self.cfg, self.plan, self.control, self.resume = cfg, plan, control, resume
        self.device = device or torch.device("cpu")  # the compute device: where the state to save lives
        self.folder = checkpoint_folder(cfg)
        self.resume_dir: Path | None = None
        self.resumed_step: int | None = None
        self.last_saved: int | None = None
        # Agreed: every rank must create the same groups, whatever its own view of the folder (see start).
        local = bool(resume.candidates) or bool(resume.damaged) or cfg.checkpoint.interval > 0
        self.enabled = control.any_true(local)
        self.group = None
        if self.enabled:
            # DCP's collectives get their own gloo group: an async save runs them from a thread while the
            # training thread runs its own collectives, and two threads must never share a group.
            self.group = new_cpu_group(control.timeout_s, "meshloom_checkpoint")
        self.pending = None  # the async save in flight: a future of its publishing
        self.staging = None  # ... and the future of its copy off the live tensors, until wait_staged
        self.stager: DefaultStager | None = None  # the last async save's; a new one per save (docstring)
        self.new_stager = lambda: DefaultStager(staging_options(self.device))
        self.executor = None

    # ---- start -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Steps 1-3 of "Starting" (module docstring)."""
        if not self.enabled:
            return
        rank = dist.get_rank()
        check_shared(self.folder, self.control)
        seen = [([p.name for p in self.resume.candidates], [p.name for p in self.resume.damaged])]
        views = self.control.all_gather_object(seen[0])
        if any(view != views[0] for view in views):
            other = next(r for r, view in enumerate(views) if view != views[0])
            raise ConfigError(
                f"the ranks see different checkpoints in {self.folder}: rank 0 {views[0][0]} (damaged: {views[0][1]}), "
                f"rank {other} {views[other][0]} (damaged: {views[other][1]}). It must be one folder, the same for "
                "every rank, and nothing else may write to it while a run starts."
            )
        if rank == 0:
            for path in self.resume.damaged:
                warn(move_aside(path))  # a step that cannot be moved stays, ruled out anyway
            removed = remove_stale(self.folder) if self.folder.is_dir() else []
            if removed:
                self._log(f"checkpoint: removed {len(removed)} unfinished save(s) left by an earlier run: {removed}")
        self.control.barrier()
        self.resume_dir = self.choose()

    def choose(self) -> Path | None:
        """Hash the candidates' shards (each rank a share) until one is whole; every rank gets the same one."""
        rank, world = dist.get_rank(), dist.get_world_size()
        for path in self.resume.candidates:
            meta, dcp_meta, problems = inspect(path)
            if not problems:
                names = sorted(name for name in meta["files"] if name != METADATA)
                problems = digest_problems(path, meta["files"], names[rank::world])
            found = [p for ps in self.control.all_gather_object(problems) for p in ps]
            if not found:
                if path != self.resume.newest:
                    check_usable(path, meta, dcp_meta, self.cfg, self.plan)
                return path
            message = f"checkpoint {path} is damaged: {'; '.join(found[:4])}"
            if self.resume.mode != "auto":
                raise ConfigError(
                    f"{message}. Resume from another step, or --checkpoint.resume auto to take the newest good one."
                )
            warn(f"checkpoint.resume=auto skips it: {message}")
            if rank == 0:
                warn(move_aside(path))  # a step that cannot be moved stays, ruled out anyway
            self.control.barrier()
        if self.resume.candidates:
            raise ConfigError(
                f"checkpoint.resume=auto: every checkpoint in {self.folder} is damaged (see the warnings); "
                "restore them from a copy, or start fresh with --checkpoint.resume none and another folder."
            )
        return None

    # ---- resume ----------------------------------------------------------------------------------------
    def restore(self, parts, optimizers, loader) -> int:
        """Load the resume checkpoint (or the init_from weights); returns the number of steps already done."""
        if self.resume_dir is not None and self.cfg.checkpoint.init_from:
            self._log(f"checkpoint: resuming {self.resume_dir}, so checkpoint.init_from is not used")
        if self.resume_dir is None:
            if self.resume.mode == "auto":
                self._log(f"checkpoint: nothing to resume in {self.folder}; starting fresh")
            if self.cfg.checkpoint.init_from:
                error = None
                try:  # a NaN in one rank's slice is refused on every rank
                    import_safetensors(parts, self.cfg.checkpoint.init_from)
                except ConfigError as exc:
                    error = exc
                self.control.raise_if_any_failed(error, "reading checkpoint.init_from", ConfigError)
                self._log(f"checkpoint: initial weights from {self.cfg.checkpoint.init_from}")
            return 0
        state = training_state(parts, optimizers, loader, step=0)  # what to read, sharded for this layout
        # the folder is data, not code: DCP's pickles read by checkpoint/safe_pickle.py
        try:
            dcp.load(state, storage_reader=reader(self.resume_dir), planner=planner(), process_group=self.group)
        except CheckpointException as exc:
            refusal = refused_value(exc)
            if refusal is None:
                raise
            raise ConfigError(
                f"checkpoint {self.resume_dir}: {refusal}. meshloom never writes such a value, so this folder was "
                "written or changed by someone else; load only checkpoints from folders you control "
                "(docs/troubleshooting.md, 'What is safe to load')."
            ) from None
        step = apply_training_state(state, parts, optimizers, loader)
        meta = read_meta(self.resume_dir)
        # the degrees it was saved on, as a ParallelDims (checkpoints older than cp and ep lack those keys)
        saved = ParallelDims(**{f.name: meta["layout"].get(f.name, 1) for f in dataclasses.fields(ParallelDims)})
        self._log(
            f"checkpoint: resumed {self.resume_dir} at step {step}, {loader.tokens_consumed:,} tokens consumed; "
            f"saved on {saved.describe()}, now {self.plan.dims.describe()}"
        )
        self.resumed_step = self.last_saved = step
        return step

    # ---- save ------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return c.interval > 0 and (step % c.interval == 0 or step == self.plan.steps)

    def maybe_save(self, step: int, parts, optimizers, loader) -> None:
        """Save after ``step`` when it is a multiple of the interval or the last step."""
        if self.due(step):
            self.save(step, parts, optimizers, loader)

    def save(self, step: int, parts, optimizers, loader) -> None:
        """Steps 1-5 of "Saving" (module docstring)."""
        self.wait()  # one save at a time: the previous async save is written and published first
        if self.last_saved == step:
            return  # that save was this step's (an async save, then a stop signal after the same step)
        final, tmp = self.folder / f"step-{step}", self.folder / f"step-{step}.tmp"
        # the run's folders still the ones it locked: a save must not re-create a removed run.dir
        self.control.raise_if_any_failed(folder_lost(), "checking the run folders", RunFolderLost)
        if self.control.any_true(final.exists()):
            raise FileExistsError(f"{final} already exists; meshloom never overwrites a saved checkpoint.")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
            self.folder.mkdir(parents=True, exist_ok=True)
        self.control.barrier()
        state = training_state(parts, optimizers, loader, step)
        meta = self._metadata(step, loader.tokens_consumed)
        if not self.cfg.checkpoint.async_:
            self._agree(
                self._write_and_publish(
                    lambda: dcp.save(state, checkpoint_id=str(tmp), process_group=self.group), tmp, final, meta
                ),
                step,
                tmp,
            )
            return
        # Steps 1-3 of "Asynchronous saves": the copy runs in the stager's thread; wait_staged waits for it.
        self._close_stager()  # the previous save is written (self.wait() above): nothing reads its copy again
        self.stager = self.new_stager()
        synchronize(self.device)  # the state the side stream copies is the one the queued optimizer step wrote
        response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group, async_stager=self.stager)
        self.staging = response.staging_completion
        self.executor = self.executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshloom-publish")
        future = self.executor.submit(self._write_and_publish, response.upload_completion.result, tmp, final, meta)
        self.pending = (future, step, tmp)

    def wait_staged(self) -> None:
        """Block until the async save in flight has copied the state; call before anything changes it (a failed copy
        fails the write, agreed on in ``wait``)."""
        if self.staging is None:
            return
        staging, self.staging = self.staging, None
        try:
            staging.result()
        except Exception:  # noqa: BLE001 - reported by the write's future, agreed on in wait()
            pass

    def _write_and_publish(self, write, tmp: Path, final: Path, meta: dict) -> BaseException | None:
        """Steps 3-4 on this rank. Every rank reaches the digest gather exactly once, written or not, so it never hangs;
        publish only when every rank wrote and hashed."""
        mine, error = None, None
        try:
            write()  # raises if a rank's write failed (DCP reports it on every rank)
            mine = file_digests(tmp, prefix=f"__{dist.get_rank()}_")
            if dist.get_rank() == 0:
                mine.update(file_digests(tmp, prefix=METADATA))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on in _agree
            error = exc
        gathered = all_gather_objects(mine, self.group)  # the checkpoint group: this thread's own
        if error is not None or any(d is None for d in gathered):
            return error  # a rank without digests failed, and reports it itself
        files = {name: entry for digests in gathered for name, entry in digests.items()}
        return self._publish_on_rank0(tmp, final, {**meta, "files": files})

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written and published, on every rank."""
        if self.pending is None:
            return
        future, step, tmp = self.pending
        self.pending, self.staging = None, None  # written implies staged
        try:
            error = future.result()
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks agreed
            error = exc
        self._agree(error, step, tmp)

    def finish(self) -> None:
        """End of training: wait for the last async save (written, published and agreed on every rank)."""
        self.wait()

    def close(self) -> None:
        """Every exit path: finish this rank's write in flight, then stop the thread. No collective (peers may be gone);
        an unfinished save stays a ``.tmp`` folder, never read."""
        if self.pending is not None:
            try:
                self.pending[0].result()
            except Exception:  # noqa: BLE001 - the failure that ended training is the one to report
                pass
            self.pending, self.staging = None, None
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        self._close_stager()

    def _close_stager(self) -> None:
        """Stop the last save's staging thread and drop its buffers (torch leaves them to the stager's owner)."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _agree(self, error: BaseException | None, step: int, tmp: Path) -> None:
        """Step 5: all ranks learn whether the save worked, and a failed save leaves nothing behind."""
        reports = self.control.all_gather_object(None if error is None else _describe(error, self.folder))
        failures = []  # (the rank where it failed, one line, errno)
        for reporter, report in enumerate(reports):
            if report is not None:
                origin, text, code = report
                failures.append((reporter if origin is None else origin, text, code))
        if not failures:
            self.last_saved = step
            return
        partial = None  # what rank 0 found of the partial step-N.tmp, said as it is (it may never have existed)
        if dist.get_rank() == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            partial = f"removed the partial {tmp.name}" if not tmp.exists() else f"could not remove {tmp}"
        partial = self.control.broadcast_object(partial)
        rank, text, code = min(failures, key=lambda failure: failure[0])
        newest = max(published(self.folder), default=None)
        keep = f"the newest good checkpoint is step-{newest}" if newest else "no checkpoint was saved yet"
        raise CheckpointSaveError(
            f"saving step {step} to {self.folder} failed on rank {rank}: {text}"
            + (f"; {partial}" if partial else "")
            + f". {FIX_BY_ERRNO.get(code, OTHER_FIX)}, then resume with --checkpoint.resume auto ({keep})."
        )

    def _publish_on_rank0(self, tmp: Path, final: Path, meta: dict) -> BaseException | None:
        if dist.get_rank() != 0:
            return None
        try:
            self._publish(tmp, final, meta)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
            return exc
        return None

    def _publish(self, tmp: Path, final: Path, meta: dict) -> None:
        """Step 4 on rank 0: the manifest with every file's checksum, the atomic rename, then keep-last-K."""
        part = tmp / (META_FILE + ".part")
        with open(part, "w") as f:
            json.dump(seal(meta), f, indent=1)  # its own checksum too (checkpoint/verify.py, step 3)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / META_FILE)
        _fsync_dir(tmp)
        # rename() of a folder onto a non-empty folder fails (ENOTEMPTY): it cannot clobber a checkpoint.
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        print(f"checkpoint: saved step {meta['step']} to {final}", flush=True)
        try:
            self._prune()
        except OSError as exc:  # the new step is published and safe; an old one was not removed
            warn(f"checkpoint: could not remove an old checkpoint ({exc}); remove it by hand if disk is short")

    def _prune(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        if keep <= 0:
            return
        for path in list(published(self.folder).values())[:-keep]:
            # Renamed first, so a crash during the removal never leaves a half-deleted "step-N".
            os.rename(path, path.with_name(f"{path.name}.deleting"))
        for doomed in self.folder.glob("step-*.deleting"):  # also those a killed run left behind
            shutil.rmtree(doomed)

    @functools.cached_property
    def stream(self) -> dict:
        """The token stream's identity (data/dataset.py ``stream_identity``), worked out once, at the first save."""
        return stream_identity(self.cfg, self.plan.model.vocab_size, self.plan.steps)

    def _metadata(self, step: int, tokens_consumed: int) -> dict:
        d, t = self.plan.dims, self.cfg.training
        return {
            "format": FORMAT,
            "step": step,
            "tokens_consumed": tokens_consumed,
            "model": dataclasses.asdict(self.plan.model_config),  # the [model] trained (a transformers folder's too)
            "layout": {**dataclasses.asdict(d), "pp_schedule": self.plan.layout.pp_schedule},  # ParallelDims' fields
            "run_layout": self.plan.layout.record(),  # how each step ran: schedule, AC, precision, ...
            "data": {**self.stream, "seq_len": t.seq_len, "global_batch": t.global_batch},
            "init_from": self.cfg.checkpoint.init_from,  # the export keeps that folder's config (checkpoint/export.py)
            "meshloom_version": meshloom_version(),
            "torch_version": torch.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(message, flush=True)
