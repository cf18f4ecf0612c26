"""Run outputs on rank 0: a console line per step, ``metrics.jsonl`` and TensorBoard events in ``tb/``."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runtime.config import ConfigError
from runtime.files import parse_json, writing

if TYPE_CHECKING:
    from runtime.process import ControlPlane


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory on CUDA; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _step_of(line: str) -> float:
    """The step of a metrics line. A line torn by a killed process, or any line that is not a record with a whole
    step (a hand edit: nested past the JSON reader's depth limit, a step of another type), counts as never written."""
    try:
        record = parse_json(line, "metrics.jsonl", "")
    except ConfigError:
        return float("inf")
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else float("inf")


class MetricsWriter:
    """Writes one JSON object per logged step; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, resume_step: int | None = None):
        self.enabled = enabled
        self.file = None
        self.tb = None
        self.run_dir = run_dir
        if not enabled:
            return
        with writing(run_dir, what="run.dir"):  # a full or read-only disk: one line (runtime/files.py)
            self._open(Path(run_dir), tensorboard, resume_step)

    def _open(self, root: Path, tensorboard: bool, resume_step: int | None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        path = root / "metrics.jsonl"
        if resume_step is not None and path.exists():
            # Resumed after `resume_step`: keep the records up to it and append. Later records came from
            # steps that are about to run again (the earlier run went on past its last checkpoint).
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resume_step]
            part = path.with_name(path.name + ".part")  # replaced whole: a full disk keeps the old records
            try:
                part.write_text("".join(line + "\n" for line in kept))
                os.replace(part, path)
            finally:
                part.unlink(missing_ok=True)
            self.file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        else:
            self.file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: it is slow to import

            if resume_step is None:  # a fresh run replacing an old one (run.overwrite): drop its events too
                for old_events in (root / "tb").glob("events.out.tfevents.*"):
                    old_events.unlink()
            # On resume, purge_step hides the old run's events from the steps about to run again.
            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(str(root / "tb"), purge_step=purge)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        data = (json.dumps(record) + "\n").encode()
        fd = self.file.fileno()
        size = os.fstat(fd).st_size
        try:
            with writing(self.run_dir, needed_bytes=len(data), what="run.dir (metrics.jsonl)"):
                view = memoryview(data)
                while view:  # unbuffered: a short write is followed by the error that explains it
                    view = view[os.write(fd, view) :]
        except BaseException:
            os.ftruncate(fd, size)  # no torn line: the file ends with the last whole record
            raise
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"  # val_loss -> val/loss
                    self.tb.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def format_step(record: dict) -> str:
    return (
        f"step {record['step']:>5} | loss {record['loss']:.4f} | grad_norm {record['grad_norm']:.3f} | "
        f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | "
        + (f"{record['tflops']:.3g} TFLOP/s | " if "tflops" in record else "")
        + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "")
        + f"peak mem {record['peak_mem_bytes'] / 2**20:,.0f} MiB"
        + (f" | compute max/min {record['compute_spread']:.2f}" if record.get("compute_spread", 1.0) != 1.0 else "")
        + (f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
    )


def open_metrics(
    run_dir: str, tensorboard: bool, control: ControlPlane, is_logger: bool, resumed_step: int | None
) -> MetricsWriter:
    """Rank 0 opens metrics.jsonl and TensorBoard; a failure there is raised on every rank, together."""
    # Every rank checked run.dir before the process group started; wait for all of them before rank 0 creates
    # files in it.
    control.barrier()
    writer, error = None, None
    try:
        writer = MetricsWriter(run_dir, enabled=is_logger, tensorboard=tensorboard, resume_step=resumed_step)
    except ConfigError as exc:  # a full or read-only disk (runtime/files.py)
        error = exc
    except OSError as exc:
        error = ConfigError(f"run.dir={run_dir!r} cannot be written ({exc}); choose a writable --run.dir.")
    control.raise_if_any_failed(error, "opening run.dir", error_type=ConfigError)
    return writer


class Progress:
    """The progress on each log line: steps, tokens, elapsed time and an ETA from this run's own pace; a bar on a
    terminal, plain words in a log file."""

    def __init__(self, total_steps: int, start_step: int, tokens_per_step: int, tty: bool | None = None):
        self.total, self.start, self.tokens_per_step = total_steps, start_step, tokens_per_step
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.began = time.perf_counter()

    def line(self, step: int, now: float | None = None) -> str:
        elapsed = (time.perf_counter() if now is None else now) - self.began
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        words = (
            f"{step:,}/{self.total:,} steps | {step * self.tokens_per_step:,} tokens | elapsed {clock(elapsed)} | "
            f"ETA {clock(eta)}"
        )
        if not self.tty:
            return words
        width = 20
        filled = int(width * step / max(1, self.total))
        return f"[{'#' * filled}{'.' * (width - filled)}] {step / max(1, self.total):4.0%} {words}"


def clock(seconds: float) -> str:
    """h:mm:ss (or m:ss under an hour)."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"
