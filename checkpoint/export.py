"""Export a DCP checkpoint to safetensors with Hugging Face Llama names, on one process, no process group.

    python -m checkpoint.export --checkpoint runs/debug/checkpoints --out runs/debug/hf
    python -m checkpoint.export --checkpoint runs/debug/checkpoints/step-20 --out runs/debug/hf
    python -m checkpoint.export --checkpoint runs/debug/checkpoints --out runs/debug/hf --max-shard-size 500MB

1. Pick the checkpoint: ``--checkpoint`` is a step-N folder, or a checkpoint folder whose newest complete
   step-N is taken. Check that it is whole: every file against its checksum (checkpoint/resume.py: inspect,
   checkpoint/verify.py).
2. Rebuild the model's shapes from its meshloom.json (the [model] section it was saved with).
3. Allocate one full, plain tensor per parameter and let ``dcp.load(..., no_dist=True)`` fill them: DCP
   stitches each tensor from the shards every rank wrote, whatever the layout was. Only ``model.*`` entries
   are read; the optimizer state stays on disk.
4. Write the weights with HF names (checkpoint/hf.py): one ``model.safetensors``, or, above
   ``--max-shard-size`` (default 5GB, as ``save_pretrained``), shards plus ``model.safetensors.index.json``;
   a ``config.json`` for LlamaForCausalLM (RoPE scaling and tied embeddings included) and a
   ``generation_config.json``.
5. When the run used a tokenizer.json (meshloom.json records its path and SHA-256), copy it and write a
   tokenizer_config.json beside the weights, so that ``AutoModelForCausalLM.from_pretrained(out)`` and
   ``AutoTokenizer.from_pretrained(out)`` both work. ``--tokenizer`` points at the file when it has moved;
   its hash must still match.
6. Replace whole (``replace_whole``): everything is written into a sibling folder ``.<out>.partial-<pid>``,
   which is renamed into place only once complete. With ``--overwrite`` the earlier export is first renamed
   aside and removed after the rename, so no file of it (an old shard, an old index beside a new single file)
   survives, and a failed export leaves the earlier one as it was. SIGTERM or SIGINT removes the partial
   folder too (exit 128 + signal); what an export killed outright left is cleared by the next export
   (``clear_stale``). An ``--out`` that is a symlink has what it points to replaced; the link stays.

7. Give back the folder you brought: a run that started from a transformers folder (``checkpoint.init_from``,
   recorded in meshloom.json; else the folder of the run's tokenizer.json when it holds a config.json;
   ``--source`` names it when it moved) exports that folder's config.json field for field, changing only what
   training changed (``kept_config``): ``dtype`` after ``--dtype``, and the special-token ids when the run used
   another tokenizer than the folder's own tokenizer.json. Every other field (router_aux_loss_coef, sliding_window, max_window_layers, bos/eos ids,
   num_nextn_predict_layers, ...) stays as the folder wrote it; the changed fields are printed.
   When the run's tokenizer.json is the folder's, the special-token ids stay the folder's and its
   generation_config.json and tokenizer files (tokenizer_config.json, special_tokens_map.json,
   chat_template.jinja) are copied as they are; otherwise (a run on another tokenizer) they are meshloom's.
8. Choose the dtype: ``--dtype bf16|fp16|fp32`` casts the weights as they are written; the default is the source
   folder's ``dtype`` (``torch_dtype`` in older configs), fp32 for a run that started from scratch. The bytes
   written are printed beside what fp32 would take.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint.folder import published
from checkpoint.hf import HF_DTYPES, export_safetensors, export_tokenizer, hf_config, parse_size
from checkpoint.hf_folder import read_config
from checkpoint.resume import META_FILE, inspect, read_meta
from checkpoint.safe_pickle import planner, reader
from checkpoint.state import MODEL, split, with_tied_head
from checkpoint.verify import METADATA, digest_problems
from runtime.config import ConfigError, model_args
from runtime.files import writing
from runtime.options import check_out_folder, path_option
from runtime.schema import Config
from runtime.signals import Interrupted, interrupts_raise


def choose_checkpoint(path: str | Path) -> Path:
    """Step 1: ``path`` if it is a checkpoint, else the newest whole step-N inside it (every file verified
    against its checksum before anything is unpickled, checkpoint/verify.py)."""
    path = Path(path)
    if (path / META_FILE).is_file() or path.name.startswith("step-"):
        candidates = [path]
    else:
        candidates = list(reversed(published(path).values()))
        if not candidates:
            raise ConfigError(f"--checkpoint {path}: no step-N checkpoint folders there.")
    for candidate in candidates:
        meta, _, problems = inspect(candidate)
        if not problems:
            problems = digest_problems(candidate, meta["files"], sorted(n for n in meta["files"] if n != METADATA))
        if not problems:
            return candidate
        if len(candidates) == 1:
            raise ConfigError(f"checkpoint {candidate} is damaged or incomplete: {'; '.join(problems)}.")
        print(f"meshloom export: skipping {candidate}, damaged or incomplete: {'; '.join(problems)}", file=sys.stderr)
    raise ConfigError(f"--checkpoint {path}: no whole checkpoint among {[c.name for c in candidates]}.")


# The files an export (ours or transformers' save_pretrained) writes: what --overwrite may replace.
EXPORT_FILE = re.compile(r"[\w.-]+\.(safetensors|json|jinja|model|txt)")


def check_out(out: str | Path, overwrite: bool) -> Path:
    """The export folder must be new (or empty), unless --overwrite: an export is never replaced by accident."""
    out = Path(out)
    check_out_folder(out, "--out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out} already holds files (an earlier export?); pass another --out, or --overwrite.")
    if out.is_dir() and overwrite:  # replaced whole (step 6): only ever an earlier export's own files
        foreign = sorted(p.name for p in out.iterdir() if not p.is_file() or not EXPORT_FILE.fullmatch(p.name))
        if foreign:
            raise ConfigError(
                f"--out {out} holds more than an export ({', '.join(foreign[:5])}); --overwrite replaces an earlier "
                "export as a whole folder, so it refuses a folder with anything else in it; pass another --out."
            )
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def clear_stale(out: Path) -> list[str]:
    """Step 6's leftovers of exports that died (SIGKILL, a power cut) beside ``out``: a ``.<out>.partial-<pid>``
    whose process is gone is removed; a ``.<out>.old-<pid>`` (an earlier export set aside) is put back as ``out``
    when ``out`` is missing, else removed. A live export's folders are left alone. Returns what was done."""
    out = out.absolute()
    stale = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-([0-9]+)")
    done = []
    try:
        entries = sorted(out.parent.iterdir()) if out.parent.is_dir() else []
    except OSError:
        return done
    for entry in entries:
        match = stale.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or pid_alive(int(match.group(2))):
            continue
        if match.group(1) == "old" and not os.path.lexists(out):
            os.rename(entry, out)
            done.append(f"put back the earlier export {entry} as {out}")
        else:
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry}, left by an export that did not finish")
    return done


def replace_whole(out: Path, write) -> list[Path]:
    """Step 6: ``write(folder)`` into a sibling folder, then that folder renamed to ``out`` (the earlier export,
    if any, renamed aside first and removed); returns the written files as paths under ``out``. When ``out`` is a
    symlink, what it points to is replaced (the link stays as it is)."""
    given = out
    out = Path(os.path.realpath(out)) if out.is_symlink() else out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, old = out.parent / f".{out.name}.partial-{os.getpid()}", out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        written = write(partial)
        if out.exists():
            os.rename(out, old)  # the earlier export as a whole, out of the way (an empty folder too)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)  # the earlier export back where it was
        raise
    shutil.rmtree(old, ignore_errors=True)
    return [given / Path(w).relative_to(partial) for w in written]


def saved_config(step_dir: Path) -> Config:
    """Step 2: a Config whose [model] is the one the checkpoint was saved with."""
    cfg = Config()
    for key, value in read_meta(step_dir)["model"].items():
        if not hasattr(cfg.model, key):
            raise ConfigError(f"{step_dir / META_FILE}: model.{key} is unknown to this meshloom version.")
        setattr(cfg.model, key, value)
    return cfg


def load_model_state(step_dir: Path) -> tuple[dict[str, torch.Tensor], object]:
    """Step 3: the full model state (meshloom names) and its ModelArgs, read on this one process."""
    from models.llama import Transformer

    args = model_args(saved_config(step_dir))
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(args).state_dict().items()}
    # A tied head is saved as the embedding (checkpoint/state.py, step 3): read it once, name it twice.
    state = {MODEL + name: torch.empty(shape) for name, shape in shapes.items() if args.stored_name(name) == name}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader(step_dir), planner=planner(), no_dist=True)  # safe_pickle.py
    return with_tied_head(args, split(state, MODEL)), args


def checkpoint_tokenizer(step_dir: Path, override: str = ""):
    """Step 5: the tokenizer a checkpoint was trained with (bytes for checkpoints that predate tokenizers)."""
    from data.tokenizers import load_tokenizer

    stream = read_meta(step_dir).get("data", {})
    spec = stream.get("tokenizer", "bytes")
    if spec == "bytes" and not override:
        return load_tokenizer("bytes")
    path = override or stream.get("tokenizer_file") or spec
    recorded = stream.get("tokenizer_sha256")
    try:
        tokenizer = load_tokenizer(path, stream.get("eos_token") or "", field="--tokenizer")
    except ConfigError as exc:
        raise ConfigError(
            f"checkpoint {step_dir} was trained with the tokenizer {spec!r} ({path}), which cannot be loaded: {exc} "
            "Pass --tokenizer with the tokenizer.json it was trained with."
        ) from exc
    if recorded and tokenizer.sha256 != recorded:
        raise ConfigError(
            f"--tokenizer {path}: its SHA-256 {tokenizer.sha256[:12]} is not the {recorded[:12]} that checkpoint "
            f"{step_dir} was trained with; pass the tokenizer.json the run used."
        )
    return tokenizer


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # config.json's spelling -> --dtype
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "added_tokens.json")


def source_folder(step_dir: Path, override: str = "") -> Path | None:
    """Step 7: the transformers folder the run started from (its config.json is kept), or None."""
    from checkpoint.hf_folder import folder_of

    if override:
        folder = folder_of(override)
        if folder is None:
            raise ConfigError(f"--source {override}: no config.json there; give the transformers folder the run used.")
        return folder
    meta = read_meta(step_dir)
    candidates = [meta.get("init_from") or "", (meta.get("data") or {}).get("tokenizer_file") or ""]
    for candidate in filter(None, candidates):
        folder = folder_of(candidate)
        if folder is not None:
            return folder
    return None


def default_dtype(source: dict | None) -> str:
    """Step 8: the source config's dtype (``dtype``, or ``torch_dtype`` before transformers 4.56), else fp32."""
    spelled = (source or {}).get("dtype") or (source or {}).get("torch_dtype") or "float32"
    return CONFIG_DTYPES.get(str(spelled), "fp32")


# What training changes that a config.json describes (step 7): the weights' dtype, and the special-token ids when the
# run's tokenizer is not the folder's. Every other field is the source folder's, as it was written.
TRAINED_FIELDS = ("dtype",)
TOKENIZER_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def kept_config(source: dict, ours: dict, keep_ids: bool = True) -> tuple[dict, list[str]]:
    """Step 7: ``source`` as it was, but for what training changed: ``dtype`` (``--dtype``), and, unless ``keep_ids``
    (the run's tokenizer is the folder's), the special-token ids of meshloom's config.json ``ours``. Returns the
    config and the changed fields, as ``key: old -> new``."""
    out = dict(source)
    for key in TRAINED_FIELDS + (() if keep_ids else TOKENIZER_IDS):
        if key in ours and not (key in source and _same(source[key], ours[key])):
            out[key] = ours[key]
    if "torch_dtype" in out:  # an older config that spells it so: both say the same
        out["torch_dtype"] = out.get("dtype", out["torch_dtype"])
    missing = object()
    changed = [
        f"{key}: {json.dumps(source.get(key)) if key in source else '(absent)'} -> {json.dumps(out.get(key))}"
        for key in sorted(set(out) | set(source))
        if source.get(key, missing) != out.get(key, missing)
    ]
    return out, changed


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return a == b


def same_tokenizer(source: Path, tokenizer) -> bool:
    """Whether the run's tokenizer.json is the source folder's (then its ids and tokenizer files describe the
    export; otherwise meshloom's, from the run's tokenizer)."""
    if tokenizer.file is None or not (source / "tokenizer.json").is_file():
        return False
    return hashlib.sha256((source / "tokenizer.json").read_bytes()).hexdigest() == tokenizer.sha256


def copy_source_files(source: Path, out: Path, tokenizer) -> list[Path]:
    """Step 7: generation_config.json and the tokenizer files, when the run's tokenizer.json is the folder's."""
    written = []
    if not same_tokenizer(source, tokenizer):
        return written
    for name in ("generation_config.json", *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            written.append(out / name)
    return written


def size_option(text: str) -> str:
    """--max-shard-size checked where it is parsed (exit 2 naming the option); main reads it again."""
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--max-shard-size ")) from None
    return text


size_option.rules = {"kind": "a size"}


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py): a bad value is refused with exit 2."""
    parser = argparse.ArgumentParser(prog="python -m checkpoint.export", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint", required=True, type=path_option(), help="a step-N folder, or a checkpoint folder (newest)"
    )
    parser.add_argument(
        "--out",
        required=True,
        type=path_option(),
        help="output folder: safetensors, config.json, generation_config.json, tokenizer",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing export in --out")
    parser.add_argument(
        "--tokenizer",
        default="",
        type=path_option(required=False),
        help="the run's tokenizer.json, if it moved since training",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        type=size_option,
        help="largest safetensors file (5GB, 500MB, 2GiB); above it: shards + index",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="",
        help="weights' dtype (default: the source folder's config.json dtype; fp32 for runs from scratch)",
    )
    parser.add_argument(
        "--source",
        default="",
        type=path_option(required=False),
        help="the transformers folder the run started from, if it moved",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        with interrupts_raise():  # SIGTERM/SIGINT: the partial folder removed (step 6), exit 128 + signal
            return _main(opts)
    except Interrupted as stop:
        print(
            f"meshloom export: stopped by {stop}; nothing was written to --out {opts.out} (an earlier export there "
            "is as it was). Run the same command again to export.",
            file=sys.stderr,
            flush=True,
        )
        return 128 + stop.signum


def _main(opts) -> int:
    try:
        max_shard_bytes = parse_size(opts.max_shard_size)
        for note in clear_stale(Path(opts.out)):
            print(f"meshloom export: {note}", file=sys.stderr, flush=True)
        out = check_out(opts.out, opts.overwrite)
        step_dir = choose_checkpoint(opts.checkpoint)
        tokenizer = checkpoint_tokenizer(step_dir, opts.tokenizer)
        source = source_folder(step_dir, opts.source)
        source_config = read_config(source) if source is not None else None
        dtype = opts.dtype or default_dtype(source_config)
        state, args = load_model_state(step_dir)
        state = {name: t.to(DTYPES[dtype]) for name, t in state.items()}
        pad = int(read_meta(step_dir)["model"].get("pad_token_id", -1))
        config = hf_config(args, tokenizer.eos_id, HF_DTYPES[DTYPES[dtype]], pad)
        changed = None
        if source_config is not None:
            check_same_shape(source_config, config, source)
            # the ids are the run's only where the folder has a tokenizer of its own that the run did not use
            keep_ids = same_tokenizer(source, tokenizer) or not (source / "tokenizer.json").is_file()
            config, changed = kept_config(source_config, config, keep_ids)

        def write(folder: Path) -> list[Path]:
            files = export_safetensors(state, args, folder, tokenizer.eos_id, max_shard_bytes, config=config)
            if tokenizer.file is not None:
                files += export_tokenizer(tokenizer, folder, args.max_seq_len)
            if source is not None:
                files += copy_source_files(source, folder, tokenizer)
            return files

        needed = sum(t.numel() * t.element_size() for t in state.values())
        with writing(Path(out).absolute().parent, needed_bytes=needed, what=f"--out {out}"):
            written = replace_whole(out, write)  # a full disk: the partial folder is removed (step 6)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"meshloom export: error: {exc}", file=sys.stderr, flush=True)
        return 2
    stored = [t for name, t in state.items() if args.stored_name(name) == name]
    size, nbytes = sum(t.numel() for t in stored), sum(t.numel() * t.element_size() for t in stored)
    print(f"exported {step_dir} ({size:,} parameters) to {', '.join(str(w) for w in dict.fromkeys(written))}")
    print(f"weights: {nbytes:,} bytes in {dtype} (fp32 would be {size * 4:,} bytes)")
    if changed is not None:
        print(f"config.json: {source / 'config.json'} kept; changed: {'; '.join(changed) or 'nothing'}")
    return 0


def check_same_shape(source: dict, ours: dict, folder: Path) -> None:
    """The source folder must describe the checkpoint's model (else its config would describe another)."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    differ = [f"{k}: folder {source.get(k)!r}, checkpoint {ours.get(k)!r}" for k in keys if source.get(k) != ours[k]]
    if differ:
        raise ConfigError(
            f"{folder / 'config.json'} describes another model than the checkpoint ({'; '.join(differ)}); pass "
            "--source with the folder the run started from."
        )


if __name__ == "__main__":
    sys.exit(main())
