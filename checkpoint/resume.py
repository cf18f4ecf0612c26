"""Which checkpoint a run resumes from, decided before any process group exists and before any unpickling.

``find_resume`` runs on every rank and gives every rank the same answer (or the same ConfigError):

1. ``none`` starts fresh; ``auto`` considers every published step-N, newest first; an explicit step only
   step-N.
2. Each is inspected (``inspect``) in an order that never unpickles an unverified byte: meshloom.json (plain
   JSON) must parse, match its own checksum (a changed field is damage, not a contradicting config) and
   list the checksums of every file (checkpoint/verify.py); every listed file must
   exist with its size and DCP's pickled ``.metadata`` must match its checksum; only then is ``.metadata``
   read, and every data file it points to must be long enough.
3. A step that fails, or cannot be read at all (a folder or file without read permission, an I/O error:
   the problem names the path and the reason), is skipped with a loud warning under ``auto`` (and moved
   aside as ``step-N.damaged`` once the run starts, checkpoint/manager.py), and refused under an explicit
   step.
4. The newest good step must be of this model: every ``[model]`` field is compared (a ConfigError names each
   difference), then every tensor key and shape the model and AdamW need; the data stream (source,
   seq_len, the tokenizer by path *and* by the SHA-256 of its content, a prepared folder's tokens by the
   SHA-256 its header records, a raw text source by the SHA-256 of the bytes read up to ``data.max_bytes``, and
   the size of the training and validation splits) must be the same, and steps must be left to train.
5. When this run will save, the folder must not hold good checkpoints beyond its starting step: they belong
   to another history, and saving would mix the two or collide with them.

The shards themselves are hashed after the process group exists, each rank a share of the files
(``CheckpointManager.choose``); a damaged or unreadable shard makes ``auto`` fall back to the next good
candidate, on every rank together.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from checkpoint.folder import STEP_DIR, checkpoint_folder, published
from checkpoint.hf import safetensors_problems
from checkpoint.safe_pickle import reader
from checkpoint.state import TRAIN, TRAIN_KEYS, expected_entries
from checkpoint.verify import manifest_changed, manifest_problems
from data.dataset import is_raw_text, raw_digest, split_sizes, stream_digest
from data.tokenizers import load_tokenizer
from models.llama import Transformer
from runtime.config import ConfigError
from runtime.files import read_json, read_json_object
from runtime.schema import Config, ModelConfig

if TYPE_CHECKING:
    from planning.plan import LayoutPlan

META_FILE = "meshloom.json"
# 2: meshloom.json lists the size and SHA-256 of every file. ``inspect`` refuses a folder of any other
# format: without checksums nothing in it could be verified before it is unpickled.
FORMAT = 2


@dataclass
class Resume:
    """What ``find_resume`` decided: the good candidates (newest first) and the damaged steps to move aside."""

    mode: str | int
    candidates: list[Path] = field(default_factory=list)
    damaged: list[Path] = field(default_factory=list)

    @property
    def newest(self) -> Path | None:
        return self.candidates[0] if self.candidates else None


def unreadable(exc: OSError) -> str:
    """One line for a file or folder that cannot be read (permissions, I/O error): the reason and the path."""
    reason = (exc.strerror or type(exc).__name__).lower()
    return f"{exc.filename or 'a file'} cannot be read ({reason})"


def read_meta(step_dir: Path) -> dict:
    """A step folder's meshloom.json (already verified by ``inspect`` when the step was chosen)."""
    return read_json_object(Path(step_dir) / META_FILE, "the checkpoint is damaged: resume or export another step.")


def inspect(path: Path):
    """(meshloom.json dict, DCP Metadata, problems), problems empty when whole; ``.metadata`` (a pickle) is read only
    after its checksum matched, and an unreadable step is damaged too."""
    try:
        return _inspect(path)
    except OSError as exc:
        return None, None, [unreadable(exc)]


def _inspect(path: Path):
    meta_file = path / META_FILE
    if not meta_file.is_file():
        return None, None, [f"{META_FILE} is missing (a save that never finished, or not a meshloom checkpoint)"]
    try:
        meta = read_json(meta_file, "", where=META_FILE)  # runtime/files.py: UTF-8, depth, surrogates
    except ConfigError as exc:
        return None, None, [str(exc)]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        return None, None, [f"{META_FILE} is format {found}, not meshloom checkpoint format {FORMAT} (with checksums)"]
    changed = manifest_changed(meta)
    if changed:
        return None, None, [f"{META_FILE} does not match its checksum (damaged: its fields changed after the save)"]
    if changed is None:
        warn(f"{path / META_FILE} carries no checksum of its own (saved by an older meshloom); its fields are trusted")
    problems = manifest_problems(path, meta.get("files"))
    if problems:
        return meta, None, problems
    try:
        dcp_meta = reader(path).read_metadata()  # only DCP's metadata types (checkpoint/safe_pickle.py)
    except Exception as exc:  # noqa: BLE001 - verified bytes, but a foreign writer can still surprise
        return meta, None, [f"DCP's .metadata cannot be read ({type(exc).__name__}: {exc})"]
    needed: dict[str, int] = {}
    for info in dcp_meta.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
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


def compatibility_problems(meta: dict, dcp_meta, cfg: Config, plan: LayoutPlan) -> list[str]:
    """What differs between the checkpoint's model and this run's (empty: it loads)."""
    args = plan.model
    saved, current = dict(meta.get("model", {})), dataclasses.asdict(plan.model_config)
    defaults = dataclasses.asdict(ModelConfig())  # a field added after the save had its default then
    for model in (saved, current):  # a preset only names keys, which are compared one by one
        model.pop("preset", None)
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
    if re.fullmatch(r"[0-9]+", word):  # str.isdigit() also takes '١٢' and '²' (which int() refuses)
        return int(word)
    raise ConfigError(f"checkpoint.resume={value!r} must be auto, none or a step number, e.g. --checkpoint.resume 100.")


_warned: set[str] = set()


def warn(message: str) -> None:
    # Before a process group exists the launcher's RANK says who prints; each warning is printed once.
    if os.environ.get("RANK", "0") == "0" and message not in _warned:
        _warned.add(message)
        print(f"meshloom: WARNING: {message}", file=sys.stderr, flush=True)


def changed_tokenizer(stream: dict, spec: str, eos_token: str, field: str) -> str | None:
    """Why the tokenizer ``spec`` is not the one a checkpoint's stream (meshloom.json ``data``) recorded, by
    content: the same path may hold another tokenizer.json now, which gives the same text other token ids.
    None when it is the same (or the checkpoint recorded no hash)."""
    recorded = stream.get("tokenizer_sha256")
    if not recorded:
        return None
    tokenizer = load_tokenizer(spec, eos_token, field=field)
    if tokenizer.sha256 != recorded:
        return (
            f"was trained with a tokenizer whose SHA-256 is {recorded}, but {field}={spec!r} is now "
            f"{tokenizer.file or spec} with SHA-256 {tokenizer.sha256}: the same text would become other token ids."
        )
    if "eos_token" in stream and stream["eos_token"] != tokenizer.eos_token:
        return (
            f"was trained with the end-of-document token {stream['eos_token']!r}, but this run's is "
            f"{tokenizer.eos_token!r} (data.eos_token): the packed stream would differ."
        )
    return None


def check_stream_content(path: Path, stream: dict, cfg: Config, tokens_consumed) -> None:
    """Refuse token streams other than the checkpoint's, by content (the header's SHA-256), unless
    data.allow_stream_change; without a digest, by path only."""
    d = cfg.data
    for key, name, source in (
        ("tokens_sha256", "data.source", d.source),
        ("val_tokens_sha256", "data.val_source", d.val_source),
    ):
        saved, now = stream.get(key), stream_digest(source)
        if saved is None:
            if now is not None and key == "tokens_sha256":
                warn(
                    f"checkpoint {path} recorded no content digest of its token stream (saved by an older meshloom): "
                    f"{name}={source!r} is taken to be the same stream by its path alone."
                )
            continue
        if saved == now:
            continue
        what = f"tokens_sha256 {now}" if now else "no tokens_sha256 (a header written without one)"
        change = (
            f"checkpoint {path} was trained on {name}={source!r} with tokens_sha256 {saved}, but that folder now "
            f"holds another token stream ({what}): its data position (tokens_consumed={tokens_consumed:,}) would "
            "point at other tokens."
        )
        if d.allow_stream_change:
            warn(f"{change} data.allow_stream_change=true: the position is reinterpreted in the new stream.")
            continue
        raise ConfigError(
            f"{change} Put back the dataset the run was trained on, start a new --run.dir (or "
            "--checkpoint.folder), or pass --data.allow_stream_change true to continue from that position in the "
            "new stream."
        )


def check_raw_text(path: Path, stream: dict, cfg: Config, tokens_consumed) -> None:
    """Refuse raw text sources other than the checkpoint's, by the SHA-256 of the bytes read (``raw_sha256``):
    another ``data.max_bytes`` or other text under the same path moves the token stream and, with
    ``data.val_fraction``, the validation split (tokens held out would become training data). The same bytes
    under another ``data.max_bytes`` (a source smaller than both) are the same stream. data.allow_stream_change
    resumes anyway; a checkpoint without the digest (an older meshloom) is compared by path only."""
    d = cfg.data
    saved_max = stream.get("max_bytes")
    for key, name, source in (
        ("raw_sha256", "data.source", d.source),
        ("val_raw_sha256", "data.val_source", d.val_source),
    ):
        if not is_raw_text(source) or stream.get(key) is None:
            continue
        saved, now = stream[key], raw_digest(source, d.max_bytes, name)
        if saved == now:
            continue
        split = (
            f" and the validation split (the last data.val_fraction={d.val_fraction:g} of it) with it: tokens held out "
            "for evaluation would become training data"
            if name == "data.source" and d.val_fraction and not d.val_source
            else ""
        )
        if saved_max is not None and saved_max != d.max_bytes:
            change = (
                f"checkpoint {path} was saved with data.max_bytes={saved_max}, this run has data.max_bytes="
                f"{d.max_bytes}: {name}={source!r} is raw text read up to data.max_bytes bytes, so its token stream "
                f"moves{split}, and its data position (tokens_consumed={tokens_consumed:,}) would point at other tokens."
            )
            fix = f"Pass --data.max_bytes {saved_max} as the run was trained, start a new --run.dir (or --checkpoint.folder)"
        else:
            change = (
                f"checkpoint {path} was trained on {name}={source!r}, raw text whose first data.max_bytes="
                f"{d.max_bytes} bytes had SHA-256 {saved}, but they now have SHA-256 {now} (the text under that path "
                f"changed): its token stream moves{split}, and its data position (tokens_consumed="
                f"{tokens_consumed:,}) would point at other tokens."
            )
            fix = "Put back the text the run was trained on, start a new --run.dir (or --checkpoint.folder)"
        if d.allow_stream_change:
            warn(f"{change} data.allow_stream_change=true: the position is reinterpreted in the new stream.")
            continue
        raise ConfigError(
            f"{change} {fix}, or pass --data.allow_stream_change true to continue from that position in the new stream."
        )


def check_split_sizes(path: Path, stream: dict, cfg: Config, plan: LayoutPlan) -> None:
    """The last line of defence: the training and validation splits hold as many tokens as when the checkpoint
    was saved (a prepared folder without a digest changed, say). Unless data.allow_stream_change."""
    if "val_tokens" not in stream:
        return  # an older meshloom did not record the sizes
    train_tokens, val_tokens = split_sizes(cfg, plan.model.vocab_size, plan.steps)
    for key, what, now in (
        ("train_tokens", "training split", train_tokens),
        ("val_tokens", "validation split", val_tokens),
    ):
        saved = stream.get(key)
        if saved is None or saved == now:
            continue
        d = cfg.data
        where = (
            f"data.val_source={d.val_source!r}"
            if d.val_source
            else f"data.val_fraction={d.val_fraction:g} of data.source={d.source!r}"
        )
        change = (
            f"checkpoint {path} was saved with a {what} of {saved:,} tokens, this run's holds {now:,} ({where}, "
            f"data.max_bytes={d.max_bytes}): the split moved, so validation and training tokens would mix."
        )
        if d.allow_stream_change:
            warn(f"{change} data.allow_stream_change=true: the run continues on the new split.")
            continue
        raise ConfigError(
            f"{change} Put back the data and the data.* settings the run was saved with, start a new --run.dir "
            "(or --checkpoint.folder), or pass --data.allow_stream_change true to continue on the new split."
        )


def check_usable(path: Path, meta: dict, dcp_meta, cfg: Config, plan: LayoutPlan) -> None:
    """Step 4 for one checkpoint; raises a ConfigError naming the difference and the fix."""
    problems = compatibility_problems(meta, dcp_meta, cfg, plan)
    if problems:
        raise ConfigError(
            f"checkpoint {path} does not fit this model:\n  - " + "\n  - ".join(problems) + "\n"
            "Resume with the [model] settings it was saved with, or start a new --checkpoint.folder."
        )
    stream, d = meta.get("data", {}), cfg.data
    for name, now in (
        ("data.source", d.source),
        ("training.seq_len", cfg.training.seq_len),
        ("data.tokenizer", d.tokenizer),
        ("data.val_source", d.val_source),
        ("data.val_fraction", d.val_fraction),
    ):
        key = name.split(".")[1]
        if key in stream and stream[key] != now:
            raise ConfigError(
                f"checkpoint {path} was saved with {name}={stream[key]!r}, this run has {name}={now!r}: its "
                f"data position (tokens_consumed) only means the same stream with the same {name}; set it back, "
                "or start a new --checkpoint.folder."
            )
    tokenizer_problem = changed_tokenizer(stream, d.tokenizer, d.eos_token, "data.tokenizer")
    if tokenizer_problem:
        raise ConfigError(
            f"checkpoint {path} {tokenizer_problem} Put back the tokenizer the run was trained with, or start a "
            "new --checkpoint.folder."
        )
    check_stream_content(path, stream, cfg, meta.get("tokens_consumed"))
    check_raw_text(path, stream, cfg, meta.get("tokens_consumed") or 0)
    check_split_sizes(path, stream, cfg, plan)
    if plan.steps <= meta["step"]:
        raise ConfigError(
            f"training.steps={plan.steps} but checkpoint {path} is already at step {meta['step']}: nothing "
            f"is left to train; raise --training.steps above {meta['step']}."
        )


def find_resume(cfg: Config, plan: LayoutPlan) -> Resume:
    """Steps 1-5 of the module docstring; no process group needed, the same answer on every rank."""
    c = cfg.checkpoint
    mode, folder = parse_resume(c.resume), checkpoint_folder(cfg)
    try:
        steps = published(folder)
    except OSError as exc:
        if mode == "none" and c.interval == 0:
            return Resume(mode)  # this run neither reads nor writes the folder
        raise ConfigError(
            f"checkpoint.folder={str(folder)!r} cannot be listed ({(exc.strerror or str(exc)).lower()}); make it "
            "readable by this user, or pass another --checkpoint.folder (or --run.dir)."
        ) from None
    resume = Resume(mode)
    if mode == "auto":
        for step in reversed(steps):
            meta, dcp_meta, problems = inspect(steps[step])
            if problems:
                warn(
                    f"checkpoint.resume=auto skips {steps[step]}, which is damaged or incomplete: {'; '.join(problems)}"
                )
                resume.damaged.append(steps[step])
                continue
            if not resume.candidates:
                check_usable(steps[step], meta, dcp_meta, cfg, plan)
            resume.candidates.append(steps[step])
        if steps and not resume.candidates:
            raise ConfigError(
                f"checkpoint.resume=auto: none of the checkpoints in {folder} ({', '.join(p.name for p in steps.values())}) "
                "is whole (see the warnings); move them away or pass --checkpoint.resume none with another folder."
            )
    elif isinstance(mode, int):
        if mode not in steps:
            have = ", ".join(str(s) for s in steps) or "none"
            raise ConfigError(f"checkpoint.resume={mode}: there is no {folder / f'step-{mode}'} (saved steps: {have}).")
        meta, dcp_meta, problems = inspect(steps[mode])
        if problems:
            raise ConfigError(f"checkpoint {steps[mode]} is damaged or incomplete: {'; '.join(problems)}.")
        check_usable(steps[mode], meta, dcp_meta, cfg, plan)
        resume.candidates.append(steps[mode])
    start = int(STEP_DIR.match(resume.newest.name).group(1)) if resume.newest else 0
    damaged = set(resume.damaged)
    newer = [s for s, path in steps.items() if s > start and path not in damaged]
    if c.interval > 0 and newer:
        raise ConfigError(
            f"checkpoint.folder {folder} already holds step(s) {', '.join(map(str, newer))} beyond step {start}, "
            f"where this run starts (checkpoint.resume={c.resume}); its saves would mix two runs or collide with "
            "them. Continue that run with --checkpoint.resume auto, remove those folders, or pass another "
            "--checkpoint.folder (or --run.dir)."
        )
    if resume.newest is None and c.init_from:
        problems = safetensors_problems(c.init_from, plan.model)
        if problems:
            raise ConfigError(
                f"checkpoint.init_from={c.init_from!r} cannot initialise this model: {'; '.join(problems)}."
            )
    return resume
