"""Checkpoint folders: atomic save, keep-last-K, async saves, resume discovery, validation before loading.

``checkpoint.folder`` (default ``<run.dir>/checkpoints``) holds one folder per saved step::

    step-6/        published: DCP's .metadata and __<rank>_0.distcp shards, plus meshloom.json
    step-9.tmp/    being written, or left by a killed run: never read; removed by the next save of step 9

Saving step N (every ``checkpoint.interval`` steps and at the last step):

1. Every rank checks that step-N does not exist: the same answer everywhere, before any collective, so a
   published checkpoint is never overwritten.
2. Rank 0 removes a stale step-N.tmp; a barrier on the checkpoint's own gloo group.
3. ``dcp.save`` (or ``dcp.async_save``, which copies the state to CPU memory first and writes from a
   thread while training goes on) into step-N.tmp. Each rank writes its shards; rank 0 writes .metadata
   only after every rank reported its writes, so when rank 0's save returns, everything is on disk.
4. Rank 0 publishes: meshloom.json (step, model config, layout, tokens consumed, versions) into the
   folder, then ``rename(step-N.tmp, step-N)``, atomic on POSIX. A reader sees the whole checkpoint or
   none of it. Then it deletes all but the newest ``keep_last`` (renamed away first, then removed).
5. The ranks agree (an all-reduce of an ok flag) that it worked, so a failure on rank 0 is raised on
   every rank instead of leaving the others waiting. Async: steps 4-5 run when the next save starts or
   training ends (``wait``); the publishing itself happens in a thread as soon as the write finished.

Resuming (``find_resume``, on every rank before any process group exists):

1. ``none`` starts fresh, ``auto`` takes the newest published step-N that is complete, an explicit step
   takes step-N. Complete means: meshloom.json parses, DCP's .metadata reads, and every data file it points
   to exists and is long enough.
2. The checkpoint must be of this model: every ``[model]`` field is compared (a ConfigError names each
   difference), then every tensor key and shape the model and AdamW need.
3. When this run will save, the folder must not hold checkpoints beyond its starting step: they belong to
   another history, and saving would mix the two or collide with them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from checkpoint.hf import import_safetensors, safetensors_path, safetensors_problems
from checkpoint.state import TRAIN, TRAIN_KEYS, apply_training_state, expected_entries, training_state
from config import Config, ConfigError, ModelConfig
from data.dataset import stream_identity
from mesh.runtime import barrier, new_collective_group, raise_if_any_rank_failed
from models.llama import ModelArgs, Transformer

META_FILE = "meshloom.json"
FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d+)$")
# Test hook: "STEP:SECONDS" makes rank 0 sleep after step STEP is fully written, before it is published,
# so a test can kill the process in the middle of a save (tests/test_checkpoint.py).
PAUSE_ENV = "MESHLOOM_CHECKPOINT_PAUSE_BEFORE_PUBLISH"


def meshloom_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshloom")
    except PackageNotFoundError:  # a source checkout that was not pip-installed
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.is_file() else "unknown"


def checkpoint_folder(cfg: Config) -> Path:
    return Path(cfg.checkpoint.folder or Path(cfg.run.dir) / "checkpoints")


def published(folder: Path) -> dict[int, Path]:
    """step -> folder of every published step-N (``.tmp`` and other names are ignored), oldest first."""
    if not folder.is_dir():
        return {}
    found = {int(m.group(1)): p for p in folder.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))}
    return dict(sorted(found.items()))


def inspect(path: Path):
    """(meshloom.json dict, DCP Metadata, problems): problems is empty when the checkpoint is complete.

    DCP's .metadata is a pickle: read only checkpoints you trust (docs/checkpointing.md).
    """
    meta_file = path / META_FILE
    if not meta_file.is_file():
        return None, None, [f"{META_FILE} is missing (a save that never finished, or not a meshloom checkpoint)"]
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, None, [f"{META_FILE} is not valid JSON ({exc})"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None, None, [f"{META_FILE} is not meshloom checkpoint format {FORMAT}"]
    if not (path / ".metadata").is_file():
        return meta, None, ["DCP's .metadata file is missing"]
    try:
        dcp_meta = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file can fail in many ways
        return meta, None, [f"DCP's .metadata cannot be read ({type(exc).__name__}: {exc})"]
    needed: dict[str, int] = {}
    for info in dcp_meta.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"data file {name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"data file {name} is truncated ({file.stat().st_size} of {size} bytes)")
    match = STEP_DIR.match(path.name)
    if match and meta.get("step") != int(match.group(1)):
        problems.append(f"{META_FILE} says step {meta.get('step')} but the folder is {path.name}")
    return meta, dcp_meta, problems


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def compatibility_problems(meta: dict, dcp_meta, cfg: Config, args: ModelArgs) -> list[str]:
    """What differs between the checkpoint's model and this run's (empty: it loads)."""
    saved, current = meta.get("model", {}), dataclasses.asdict(cfg.model)
    defaults = dataclasses.asdict(ModelConfig())  # a field added after the save had its default then
    diffs = [
        f"model.{key}: checkpoint {_show(saved.get(key, defaults.get(key)))}, config {_show(current.get(key))}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key, defaults.get(key)) != current.get(key)
    ]
    if diffs:
        return diffs
    with torch.device("meta"):
        expected = expected_entries(Transformer(args))
    stored = dcp_meta.state_dict_metadata
    problems = [f"{key} is missing" for key in expected if key not in stored]
    problems += [
        f"{key}: checkpoint {tuple(stored[key].size)}, model {tuple(shape)}"
        for key, shape in expected.items()
        if key in stored and getattr(stored[key], "size", None) != shape
    ]
    problems += [f"{TRAIN}{key} is missing" for key in TRAIN_KEYS if TRAIN + key not in stored]
    return problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])


def parse_resume(value: str) -> str | int:
    word = str(value).strip().lower()
    if word in ("auto", "none"):
        return word
    if word.isdigit():
        return int(word)
    raise ConfigError(f"checkpoint.resume={value!r} must be auto, none or a step number, e.g. --checkpoint.resume 100.")


_warned: set[str] = set()


def _warn(message: str) -> None:
    # Before a process group exists the launcher's RANK says who prints; find_resume runs twice (check_config
    # and CheckpointManager), so each warning is printed once.
    if os.environ.get("RANK", "0") == "0" and message not in _warned:
        _warned.add(message)
        print(f"meshloom: warning: {message}", file=sys.stderr, flush=True)


def find_resume(cfg: Config, args: ModelArgs) -> Path | None:
    """The checkpoint this run resumes from (None: a fresh start), fully validated; no process group needed.

    Raises the same ConfigError on every rank (see "Resuming" in the module docstring).
    """
    c = cfg.checkpoint
    if c.interval < 0 or c.keep_last < 0:
        raise ConfigError(
            f"checkpoint.interval={c.interval} and checkpoint.keep_last={c.keep_last} must be >= 0 (0: never / keep all)."
        )
    mode, folder = parse_resume(c.resume), checkpoint_folder(cfg)
    steps = published(folder)
    chosen, meta, dcp_meta = None, None, None
    if mode == "auto":
        for step in reversed(steps):
            meta, dcp_meta, problems = inspect(steps[step])
            if not problems:
                chosen = steps[step]
                break
            _warn(f"checkpoint.resume=auto skips {steps[step]}, which is incomplete: {'; '.join(problems)}")
        if steps and chosen is None:
            raise ConfigError(
                f"checkpoint.resume=auto: none of the checkpoints in {folder} ({', '.join(p.name for p in steps.values())}) "
                "is complete (see the warnings); remove them or pass --checkpoint.resume none with another folder."
            )
    elif isinstance(mode, int):
        if mode not in steps:
            have = ", ".join(str(s) for s in steps) or "none"
            raise ConfigError(f"checkpoint.resume={mode}: there is no {folder / f'step-{mode}'} (saved steps: {have}).")
        chosen = steps[mode]
        meta, dcp_meta, problems = inspect(chosen)
        if problems:
            raise ConfigError(f"checkpoint {chosen} is incomplete or corrupt: {'; '.join(problems)}.")
    start = 0
    if chosen is not None:
        problems = compatibility_problems(meta, dcp_meta, cfg, args)
        if problems:
            raise ConfigError(
                f"checkpoint {chosen} does not fit this model:\n  - " + "\n  - ".join(problems) + "\n"
                "Resume with the [model] settings it was saved with, or start a new --checkpoint.folder."
            )
        start = meta["step"]
        stream = meta.get("data", {})
        d = cfg.data
        for field, now in (("data.source", d.source), ("training.seq_len", cfg.training.seq_len),
                           ("data.tokenizer", d.tokenizer), ("data.val_source", d.val_source),
                           ("data.val_fraction", d.val_fraction)):  # fmt: skip
            key = field.split(".")[1]
            if key in stream and stream[key] != now:
                raise ConfigError(
                    f"checkpoint {chosen} was saved with {field}={stream[key]!r}, this run has {field}={now!r}: its "
                    f"data position (tokens_consumed) only means the same stream with the same {field}; set it back, "
                    "or start a new --checkpoint.folder."
                )
        if cfg.training.steps <= start:
            raise ConfigError(
                f"training.steps={cfg.training.steps} but checkpoint {chosen} is already at step {start}: nothing is "
                f"left to train; raise --training.steps above {start}."
            )
    newer = [s for s in steps if s > start]
    if c.interval > 0 and newer:
        fix = (
            "they are incomplete (see the warnings): remove them"
            if mode == "auto"
            else "continue that run with --checkpoint.resume auto, remove those folders"
        )
        raise ConfigError(
            f"checkpoint.folder {folder} already holds step(s) {', '.join(map(str, newer))} beyond step {start}, "
            f"where this run starts (checkpoint.resume={c.resume}); its saves would mix two runs or collide with "
            f"them. {fix[0].upper() + fix[1:]}, or pass another --checkpoint.folder (or --run.dir)."
        )
    if chosen is None and c.init_from:
        problems = safetensors_problems(c.init_from, args)
        if problems:
            raise ConfigError(
                f"checkpoint.init_from={c.init_from!r} cannot initialise this model: {'; '.join(problems)}."
            )
    return chosen


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Resume, periodic saves and the final save of one training run (see the module docstring)."""

    def __init__(self, cfg: Config, dims, args: ModelArgs):
        self.cfg, self.dims = cfg, dims
        self.folder = checkpoint_folder(cfg)
        self.resume_dir = find_resume(cfg, args)  # every check, before any collective
        self.resumed_step: int | None = None
        self.group = None
        self.pending = None  # the async save in flight: a future of its publishing
        self.executor = None

    # ---- resume ----------------------------------------------------------------------------------------
    def restore(self, parts, optimizers, loader) -> int:
        """Load the resume checkpoint (or the init_from weights); returns the number of steps already done."""
        if self.resume_dir is not None or self.cfg.checkpoint.interval > 0:
            # DCP's collectives get their own gloo group: an async save runs them from a thread while the
            # training thread runs its own collectives, and two threads must never share a group.
            self.group = new_collective_group()
        if self.resume_dir is not None and self.cfg.checkpoint.init_from:
            self._log(f"checkpoint: resuming {self.resume_dir}, so checkpoint.init_from is not used")
        if self.resume_dir is None:
            if parse_resume(self.cfg.checkpoint.resume) == "auto":
                self._log(f"checkpoint: nothing to resume in {self.folder}; starting fresh")
            if self.cfg.checkpoint.init_from:
                import_safetensors(parts, self.cfg.checkpoint.init_from)
                self._log(f"checkpoint: initial weights from {safetensors_path(self.cfg.checkpoint.init_from)}")
            return 0
        state = training_state(parts, optimizers, loader, step=0)  # what to read, sharded for this layout
        dcp.load(state, checkpoint_id=str(self.resume_dir), process_group=self.group)
        step = apply_training_state(state, parts, optimizers, loader)
        meta = json.loads((self.resume_dir / META_FILE).read_text())
        saved = meta["layout"]
        self._log(
            f"checkpoint: resumed {self.resume_dir} at step {step}, {loader.tokens_consumed:,} tokens consumed; "
            f"saved on pp={saved['pp']} dp_replicate={saved['dp_replicate']} dp_shard={saved['dp_shard']} "
            f"tp={saved['tp']}, now {self.dims.describe()}"
        )
        self.resumed_step = step
        return step

    # ---- save ------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, parts, optimizers, loader) -> None:
        """Save after ``step`` when it is a multiple of the interval or the last step (steps 1-5)."""
        c = self.cfg.checkpoint
        if c.interval <= 0 or (step % c.interval and step != self.cfg.training.steps):
            return
        self.wait()  # one save at a time: the previous async save is written and published first
        final, tmp = self.folder / f"step-{step}", self.folder / f"step-{step}.tmp"
        if final.exists():
            raise FileExistsError(f"{final} already exists; meshloom never overwrites a saved checkpoint.")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
            self.folder.mkdir(parents=True, exist_ok=True)
        barrier(self.group)
        state = training_state(parts, optimizers, loader, step)
        meta = self._metadata(step, loader.tokens_consumed)
        if not c.async_:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
            self._agree(self._publish_on_rank0(tmp, final, meta))
            return
        # async_save stages a CPU copy before it returns, so training may change the live tensors at once.
        written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        self.executor = self.executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshloom-publish")
        self.pending = self.executor.submit(self._after_write, written, tmp, final, meta)

    def _after_write(self, written, tmp: Path, final: Path, meta: dict) -> Exception | None:
        written.result()  # raises if this rank's write failed
        return self._publish_on_rank0(tmp, final, meta)

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written and published, on every rank."""
        if self.pending is None:
            return
        try:
            error = self.pending.result()
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks agreed
            error = exc
        self.pending = None
        self._agree(error)

    def finish(self) -> None:
        """End of training: wait for the last async save."""
        self.wait()
        if self.executor is not None:
            self.executor.shutdown()

    def _agree(self, error: Exception | None) -> None:
        """All ranks learn whether the save worked (step 5), so none waits for a rank that failed."""
        raise_if_any_rank_failed(error, "saving a checkpoint", self.group)

    def _publish_on_rank0(self, tmp: Path, final: Path, meta: dict) -> Exception | None:
        if dist.get_rank() != 0:
            return None
        try:
            self._publish(tmp, final, meta)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree
            return exc
        return None

    def _publish(self, tmp: Path, final: Path, meta: dict) -> None:
        """Step 4: metadata, then the atomic rename, then keep-last-K (rank 0 only)."""
        part = tmp / (META_FILE + ".part")
        with open(part, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, tmp / META_FILE)
        _fsync_dir(tmp)
        step, _, seconds = os.environ.get(PAUSE_ENV, "").partition(":")
        if step == str(meta["step"]):
            print(f"checkpoint: {tmp} written, pausing {seconds} s before publishing ({PAUSE_ENV})", flush=True)
            time.sleep(float(seconds))
        # rename() of a folder onto a non-empty folder fails (ENOTEMPTY): it cannot clobber a checkpoint.
        os.rename(tmp, final)
        _fsync_dir(self.folder)
        self._prune()
        print(f"checkpoint: saved step {meta['step']} to {final}", flush=True)

    def _prune(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        if keep <= 0:
            return
        for path in list(published(self.folder).values())[:-keep]:
            # Renamed first, so a crash during the removal never leaves a half-deleted "step-N".
            os.rename(path, path.with_name(f"{path.name}.deleting"))
        for doomed in self.folder.glob("step-*.deleting"):  # also those a killed run left behind
            shutil.rmtree(doomed)

    def _metadata(self, step: int, tokens_consumed: int) -> dict:
        d, t = self.dims, self.cfg.training
        return {
            "format": FORMAT,
            "step": step,
            "tokens_consumed": tokens_consumed,
            "model": dataclasses.asdict(self.cfg.model),
            "layout": {
                "world_size": d.world_size,
                "pp": d.pp,
                "dp_replicate": d.dp_replicate,
                "dp_shard": d.dp_shard,
                "tp": d.tp,
                "ep": d.ep,
                "pp_schedule": self.cfg.parallel.pp_schedule if d.pp > 1 else None,
            },
            "data": {**stream_identity(self.cfg), "seq_len": t.seq_len, "global_batch": t.global_batch},
            "meshloom_version": meshloom_version(),
            "torch_version": torch.__version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(message, flush=True)
