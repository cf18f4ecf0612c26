"""The training and validation token streams of a run, checked before any process group exists.

``data.source`` (and ``data.val_source``) is one of:

- a folder written by ``python -m data.prepare`` (it has a ``header.json``): memory-mapped, any size;
  its header must name the tokenizer of ``data.tokenizer`` (same file hash and EOS id);
- ``default`` (the Python standard library's sources), a text file, or a folder of text files: the first
  ``data.max_bytes`` bytes, tokenized in memory when the run starts (one document per file, each followed by
  the EOS token); meant for small runs.

The validation split is ``data.val_source`` when set, else the last ``data.val_fraction`` of the source's
tokens (the training stream is then the rest, whether or not evaluation is on, so turning ``eval.interval``
on or off never changes the training data).

``check_data`` runs on every rank in train.check_config. Every problem is a ConfigError naming the field,
the value and the fix, raised identically on every rank before the first collective: a missing or foreign
tokenizer, a header that does not match it, a vocabulary or a recorded largest id (``max_id``) beyond
``model.vocab_size``, a training stream smaller than one global batch, and an empty validation split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from data.token_file import (
    TOKENS,
    check_header_ids,
    check_header_tokenizer,
    is_token_folder,
    open_documents,
    open_tokens,
    read_header,
)
from data.tokenizers import ByteTokenizer, check_vocab, load_tokenizer
from runtime.config import ConfigError

if TYPE_CHECKING:
    from runtime.schema import Config


@dataclass
class Splits:
    tokenizer: object
    train: object  # a 1-D token array: numpy (memmap for prepared folders) or a torch uint8 tensor (bytes)
    val: object | None
    description: str
    train_documents: object = None  # where each document starts (int64 offsets), when document masks are on
    val_documents: object = None


def document_starts(source: str, mode: str, field: str):
    """(the offsets where ``source``'s documents start, or None; the banner's words) for data.document_mask
    ``mode``: auto is on for chat data (a loss mask) whose folder recorded its documents."""
    prepared = source != "default" and is_token_folder(source)
    header = read_header(source, field) if prepared else {}
    starts = open_documents(source, header, field) if prepared else None
    if mode == "off" or (mode == "auto" and "loss_mask" not in header):
        return None, "off"
    if starts is None:
        why = (
            "was prepared before data.prepare recorded document starts"
            if prepared
            else "is raw text, whose documents are not recorded"
        )
        if mode == "on":
            raise ConfigError(
                f"data.document_mask=on, but {field}={source!r} {why}; prepare it (again) with python -m "
                "data.prepare, or set --data.document_mask off."
            )
        return None, f"off ({field} {why}: prepare it again for them)"
    return starts, f"on ({len(starts):,} documents: each token attends to its own, positions restart per document)"


def split_starts(starts, n_train: int):
    """Document starts of the training part ``[0, n_train)`` and of the rest (shifted to start at 0)."""
    import numpy as np

    if starts is None:
        return None, None
    val = starts[starts >= n_train] - n_train
    if not len(val) or val[0] != 0:
        val = np.concatenate([[0], val])  # the split cuts a document: its tail starts the validation stream
    return starts[starts < n_train], val


def _length(tokens) -> int:
    return int(tokens.shape[0])


def _raw_tokens(source: str, tokenizer, max_bytes: int, field: str):
    """Tokens of a raw text source: its first max_bytes bytes, one document per file (see the docstring)."""
    from data.corpus import corpus_files, load_corpus

    files = corpus_files(source, field)
    prepare_first = [f for f in files if f.name.lower().endswith((".jsonl", ".ndjson", ".parquet"))]
    if prepare_first:
        raise ConfigError(
            f"{field}={source!r} holds JSONL/Parquet files ({prepare_first[0].name}); tokenize them first: "
            f"python -m data.prepare --source {source} --tokenizer {tokenizer.name} --out DIR, then --{field} DIR."
        )
    if isinstance(tokenizer, ByteTokenizer):
        return load_corpus(source, max_bytes)  # bytes, concatenated as they always were
    from data.prepare import encode_chunk

    texts, total = [], 0
    for file in files:
        raw = file.read_bytes()[: max_bytes - total]
        texts.append(raw.decode("utf-8", errors="replace"))
        total += len(raw)
        if total >= max_bytes:
            break
    return encode_chunk([t for t in texts if t], tokenizer)


def open_stream(source: str, tokenizer, max_bytes: int, field: str, vocab_size: int | None = None):
    """(tokens, description) of one source (a prepared folder, or raw text); a prepared folder's header is
    checked against the tokenizer and, given ``vocab_size``, its ids against the model's vocabulary."""
    path = Path(source).expanduser()
    if source != "default" and path.is_dir() and (path / (TOKENS + ".tmp")).exists() and not is_token_folder(path):
        raise ConfigError(
            f"{field}={source!r} holds an unfinished {TOKENS}.tmp and no header.json (data.prepare did not finish); "
            "run python -m data.prepare again into a new --out folder."
        )
    if source != "default" and is_token_folder(path):
        header = read_header(path, field)
        check_header_tokenizer(header, tokenizer, field, source)
        if vocab_size is not None:
            check_header_ids(header, vocab_size, field, source)
        mask = header.get("loss_mask")
        if mask is not None and mask.get("trained_tokens") == 0:
            raise ConfigError(
                f"{field}={source!r} has a loss mask with 0 trained tokens (header.json loss_mask.trained_tokens): "
                "a run on it would train nothing (loss 0, gradient 0). Prepare it again from conversations with "
                "assistant replies, or with --train-on all (python -m data.prepare --format chat)."
            )
        tokens = open_tokens(path, header)
        return (
            tokens,
            f"{header['num_tokens']:,} tokens ({header['dtype']}, memory-mapped, {header['num_documents']:,} documents)",
        )
    tokens = _raw_tokens(source, tokenizer, max_bytes, field)
    return tokens, f"{_length(tokens):,} tokens (raw text, in memory)"


_raw_cache: dict = {}


def _cached_stream(source: str, tokenizer, max_bytes: int, field: str, vocab_size: int | None = None):
    """open_stream, tokenizing a raw source once per process (check_data and the loader both ask for it)."""
    if source != "default" and is_token_folder(source):
        return open_stream(source, tokenizer, max_bytes, field, vocab_size)  # a memory map: nothing worth caching
    from data.corpus import corpus_files

    stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in corpus_files(source, field))
    key = (source, tokenizer.sha256, tokenizer.eos_id, max_bytes, stamp)
    if key not in _raw_cache:
        _raw_cache.clear()  # one raw corpus at a time
        _raw_cache[key] = open_stream(source, tokenizer, max_bytes, field)
    return _raw_cache[key]


def load_data(cfg: Config, vocab_size: int | None = None, steps: int | None = None) -> Splits:
    """The tokenizer and the train / validation streams of ``cfg``, every rule checked (module docstring).
    ``vocab_size`` and ``steps``: the model's and the run's (planning/plan.py), when a transformers folder or
    training.epochs sets them; by default the config's."""
    d, t = cfg.data, cfg.training
    vocab_size, steps = vocab_size or cfg.model.vocab_size, steps or t.steps
    tokenizer = load_tokenizer(d.tokenizer, d.eos_token)
    check_vocab(tokenizer, vocab_size)
    train, about = _cached_stream(d.source, tokenizer, d.max_bytes, "data.source", vocab_size)
    train_docs, masks = document_starts(d.source, d.document_mask, "data.source")
    val, val_about, val_docs = None, "", None
    if d.val_source:
        val, val_about = _cached_stream(d.val_source, tokenizer, d.max_bytes, "data.val_source", vocab_size)
        val_about = f"data.val_source: {val_about}"
        if train_docs is not None:
            val_docs, _ = document_starts(d.val_source, "on", "data.val_source")
    elif d.val_fraction:
        n = _length(train)
        n_val = int(n * d.val_fraction)
        train, val = train[: n - n_val], train[n - n_val :]
        val_about = f"the last {n_val:,} tokens ({d.val_fraction:g})"
        train_docs, val_docs = split_starts(train_docs, n - n_val)

    one_batch = t.global_batch * t.seq_len + 1
    if _length(train) < one_batch:
        held = f" after holding out data.val_fraction={d.val_fraction:g}" if d.val_fraction else ""
        raise ConfigError(
            f"data.source={d.source!r} holds {_length(train):,} training tokens{held}, fewer than one global batch: "
            f"training.global_batch x training.seq_len + 1 = {t.global_batch} x {t.seq_len} + 1 = {one_batch:,}; "
            "use more data, or lower training.global_batch or training.seq_len."
        )
    if val is not None and _length(val) < one_batch:
        what = (
            f"data.val_source={d.val_source!r}"
            if d.val_source
            else f"data.val_fraction={d.val_fraction:g} of data.source"
        )
        size = "is empty" if _length(val) == 0 else f"holds only {_length(val):,} tokens"
        raise ConfigError(
            f"the validation split ({what}) {size}; an evaluation needs at least one global batch, "
            f"training.global_batch x training.seq_len + 1 = {one_batch:,} tokens: "
            + ("give a larger data.val_source." if d.val_source else "raise data.val_fraction or use more data.")
        )
    about += packing_note(d.source, t.seq_len)
    eos = f", EOS id {tokenizer.eos_id}" if tokenizer.eos_id is not None else ""
    description = f"{d.source}: {about} | tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size:,}{eos})" + (
        f" | validation: {val_about}" if val is not None else ""
    )
    passes = passes_line(_length(train), t.seq_len, t.global_batch, steps)
    if t.epochs:
        passes += f" (training.epochs={t.epochs:g} set the steps)"
    description += f" | document masks: {masks}\n  passes        {passes}"
    return Splits(tokenizer, train, val, description, train_docs, val_docs)


def packing_note(source: str, seq_len: int) -> str:
    """For chat data (data/chat.py): the loss mask, and a warning when it was packed for another seq_len (its
    conversations then straddle the training windows; still a correct loss, on fewer whole conversations)."""
    if source == "default" or not is_token_folder(source):
        return ""
    header = read_header(source)
    mask, chat = header.get("loss_mask"), header.get("chat") or {}
    if not mask:
        return ""
    note = f", loss mask: {mask.get('trained_tokens', 0):,} trained tokens"
    packed = chat.get("seq_len")
    if packed and packed != seq_len:
        note += (
            f"; WARNING: packed for seq_len {packed}, not training.seq_len={seq_len}: prepare again with "
            f"--seq-len {seq_len} to keep conversations whole in a window"
        )
    return note


def stream_span(train_tokens: int, seq_len: int) -> int:
    """The tokens one pass over the training stream covers: the loader wraps its window offsets at this many
    (data/loader.py), so that every window has seq_len + 1 tokens."""
    return max(1, train_tokens - seq_len)


def passes_done(step: int, span: int, seq_len: int, global_batch: int) -> int:
    """How many times the stream has wrapped by the end of ``step``: its last window starts at step x
    global_batch x seq_len - seq_len tokens into the run."""
    return max(0, (step * global_batch * seq_len - seq_len) // span)


def wrap_notice(step: int, span: int, seq_len: int, global_batch: int, steps: int) -> str | None:
    """The line the loop prints on the step whose windows wrap the training stream (None on every other step)."""
    wraps = passes_done(step, span, seq_len, global_batch)
    if wraps == passes_done(step - 1, span, seq_len, global_batch):
        return None
    total = steps * global_batch * seq_len / span
    return f"data: step {step} wrapped the training stream: pass {wraps + 1} begins (the run makes {total:.2f})"


def passes_line(train_tokens: int, seq_len: int, global_batch: int, steps: int) -> str:
    """The banner's words on passes: how many the run makes and the step where the stream first wraps."""
    span, per_step = stream_span(train_tokens, seq_len), global_batch * seq_len
    passes = steps * per_step / span
    wrap = -(-(span + seq_len) // per_step)  # the first step whose last window starts at or past the span
    when = f"first wraps at step {wrap:,}" if wrap <= steps else "never wraps"
    return (
        f"{steps:,} steps x {per_step:,} tokens = {passes:.2f} passes over {span:,} training tokens; the stream {when}"
    )


def epoch_steps(cfg: Config, vocab_size: int | None = None) -> int:
    """The run's optimizer steps: ``training.steps``, or with ``training.epochs`` > 0 the steps that many passes
    over the training stream take (the same on every rank; the banner's passes line says so). The config is not
    changed: the plan holds the result (planning/plan.py: ``LayoutPlan.steps``)."""
    t = cfg.training
    if not t.epochs:
        return t.steps
    train = load_data(cfg, vocab_size).train
    span, per_step = stream_span(_length(train), t.seq_len), t.global_batch * t.seq_len
    return max(1, -(-int(round(t.epochs * span)) // per_step))


def check_data(cfg: Config, vocab_size: int | None = None, steps: int | None = None) -> None:
    """Every data rule, before any process group (raises the same ConfigError on every rank)."""
    load_data(cfg, vocab_size, steps)


def stream_digest(source: str) -> str | None:
    """The content digest of a prepared folder's tokens (its header's ``tokens_sha256``); None for raw text
    and for token files written before the digest existed (those are identified by path only). A masked
    folder's digest names its mask's SHA-256 too."""
    if not source or source == "default" or not is_token_folder(source):
        return None
    header = read_header(source)
    digest, mask = header.get("tokens_sha256"), header.get("loss_mask")
    if digest and mask:  # the same tokens under another mask (--train-on all) are another stream to train on
        return f"{digest}+mask {mask.get('sha256')}"
    return digest


def is_raw_text(source: str) -> bool:
    """A source read as raw text (``default``, a text file or folder): its first ``data.max_bytes`` bytes."""
    return bool(source) and (source == "default" or not is_token_folder(source))


def raw_digest(source: str, max_bytes: int, field: str = "data.source") -> str | None:
    """The SHA-256 of the bytes a raw text source gives a run (the first ``max_bytes``, file by file in the
    order ``_raw_tokens`` reads them, each file's length first so that a moved boundary counts); None for a
    prepared folder, whose header's ``tokens_sha256`` identifies it (``stream_digest``)."""
    if not is_raw_text(source):
        return None
    from data.corpus import corpus_files

    digest, total = hashlib.sha256(), 0
    for file in corpus_files(source, field):
        raw = file.read_bytes()[: max_bytes - total]
        digest.update(len(raw).to_bytes(8, "little") + raw)
        total += len(raw)
        if total >= max_bytes:
            break
    return digest.hexdigest()


def split_sizes(cfg: Config, vocab_size: int | None = None, steps: int | None = None) -> tuple[int, int]:
    """(training tokens, validation tokens) of ``cfg``'s streams (raw text is tokenized once per process)."""
    splits = load_data(cfg, vocab_size, steps)
    return _length(splits.train), _length(splits.val) if splits.val is not None else 0


def stream_identity(cfg: Config, vocab_size: int | None = None, steps: int | None = None) -> dict:
    """What a checkpoint records about its token stream (checkpoint.manager); resuming compares it
    (checkpoint/resume.py): the sources by path and by content (a prepared folder's ``tokens_sha256``, a raw
    text source's ``raw_sha256`` of the bytes read), ``max_bytes`` and the size of each split, so that a
    validation split that moved (another ``data.max_bytes``, other text) is seen."""
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer, d.eos_token)
    train_tokens, val_tokens = split_sizes(cfg, vocab_size, steps)
    return {
        "source": d.source,
        "tokenizer": d.tokenizer,
        "tokenizer_file": str(tokenizer.file) if tokenizer.file else None,
        "tokenizer_sha256": tokenizer.sha256,
        "eos_token": tokenizer.eos_token,
        "val_source": d.val_source,
        "val_fraction": d.val_fraction,
        "tokens_sha256": stream_digest(d.source),
        "val_tokens_sha256": stream_digest(d.val_source),
        "max_bytes": d.max_bytes,
        "raw_sha256": raw_digest(d.source, d.max_bytes, "data.source"),
        "val_raw_sha256": raw_digest(d.val_source, d.max_bytes, "data.val_source"),
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
    }
