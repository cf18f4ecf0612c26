"""Tokenize a text dataset once into a memory-mappable token file (data/token_file.py).

    python -m data.prepare --source corpus.jsonl --tokenizer tokenizer.json --out data/corpus
    python -m data.prepare --source shards/ --tokenizer tokenizer.json --out data/shards --text-field content
    python -m data.prepare --source default --tokenizer bytes --out data/stdlib-bytes
    python -m data.prepare --format chat --source chats.jsonl --tokenizer MODEL_FOLDER --seq-len 512 --out data/chat

``--format chat`` (data/chat.py) renders conversations with the model folder's chat template and writes a
loss mask beside the tokens: the assistant's turns only, or every token with ``--train-on all``.

1. **Documents.** ``--source`` is a file, a folder (every regular file below it, sorted by path; hidden
   files skipped) or ``default`` (the Python standard library's sources, data/corpus.py). Each file is read
   by its extension: ``.jsonl`` / ``.ndjson``: one JSON object per line, the text in ``--text-field``
   (default ``text``); ``.parquet``: the ``--text-field`` column (needs ``pyarrow``, the ``data`` extra);
   anything else: a UTF-8 text file that is one document, read in blocks. Empty documents are skipped. A
   line without the field, a value that is not a string, or a file that is not readable stops the run with
   the file, the line or row, and the fix. Invalid UTF-8 stops it too, naming the file and the byte
   (``--errors strict``, the default: training on mis-decoded text runs without complaint); with
   ``--errors replace`` each invalid sequence becomes U+FFFD and the number of bytes replaced is printed
   and recorded in the header (``utf8_replaced_bytes``).
2. **Tokenize in parallel.** Documents go to ``--workers`` processes in chunks of about ``CHUNK_BYTES``;
   the results come back in submission order (at most two chunks per worker in flight), so the token file
   does not depend on the number of workers. A document longer than ``LONG_CHARS`` is not sent whole: it
   is tokenized in this process in pieces of ``PIECE_CHARS``, cut with the tokenizer's own offsets
   (data/pieces.py), after the chunks before it.

3. **Pack.** Each document's ids (numpy arrays, never a Python list of a document) are followed by the
   tokenizer's EOS id (none for ``bytes``) and appended to ``tokens.bin``, and where it starts to
   ``documents.bin`` (the document masks of ``data.document_mask``); ``header.json`` is written last
   (data/token_file.py).

**Memory is bounded by the chunks and pieces in flight, not by the largest document:** about
``2 x workers`` chunks of ``CHUNK_BYTES`` of text in the workers, plus one piece of a long document and its
encoding here (a piece's encoding costs a few hundred bytes per token while it lives). A text file is
streamed; a single JSONL or Parquet record is held whole while it is tokenized in pieces (its parser needs
all of it), so a record of N bytes adds a few times N. ``python -m measure.prepare_memory`` measures the peak
for one long line against ordinary lines (default 200 MB each): with the 4,096-token BPE, one process
(``workers=1``) added 26-27 MiB to its imports for a 10, 50 or 200 MB single-line file alike, and 82 MiB
for JSONL documents (docs/data.md, section 3).

A progress line on stderr shows the files done, documents, tokens and tokens/s; the last line on stdout
is the summary. Exit status 0, or 2 with one message naming what to fix.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.pieces import LONG_CHARS, PIECE_CHARS, encode_long
from data.token_file import TokenFileWriter, dtype_for
from data.tokenizers import load_tokenizer
from runtime.config import ConfigError
from runtime.files import parse_json
from runtime.options import check_out_folder, int_option, path_option, text_option
from runtime.signals import Interrupted, interrupts_raise

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_BYTES = 1 << 20  # text per task sent to a worker
CHUNK_DOCS = 1024
ERRORS = ("strict", "replace")  # --errors: what invalid UTF-8 does


@dataclass
class LongDocument:
    """A document longer than LONG_CHARS, as its text in order, piece by piece (step 2)."""

    pieces: Iterator[str]


class Utf8:
    """Decodes the source's bytes (step 1): ``strict`` refuses invalid UTF-8 naming the file and the byte,
    ``replace`` puts U+FFFD for each invalid sequence and counts the bytes replaced."""

    def __init__(self, errors: str = "strict"):
        if errors not in ERRORS:
            raise ConfigError(f"--errors {errors!r} must be one of {', '.join(ERRORS)}.")
        self.errors, self.replaced = errors, 0
        codecs.register_error(f"meshloom-{id(self)}", self._replace)

    def _replace(self, exc: UnicodeDecodeError):
        self.replaced += exc.end - exc.start
        return "\ufffd", exc.end

    def decoder(self):
        return codecs.getincrementaldecoder("utf-8")("strict" if self.errors == "strict" else f"meshloom-{id(self)}")

    def decode(self, raw: bytes, where: str, offset: int = 0, decoder=None, final: bool = True) -> str:
        """``raw`` as text; ``offset``: where ``raw`` starts in its file (for the message)."""
        decoder = decoder or self.decoder()
        buffered = len(decoder.getstate()[0])  # bytes of a character cut by the previous block
        try:
            return decoder.decode(raw, final)
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{where}: invalid UTF-8 at byte {offset - buffered + exc.start:,} ({exc.reason}); data.prepare "
                "reads UTF-8 text: convert the file (e.g. iconv -f latin1 -t utf-8), move it out of --source, or "
                "pass --errors replace to replace each invalid sequence with U+FFFD (the count is reported)."
            ) from None


def source_files(source: str) -> list[Path]:
    """The files of ``--source`` in the order they are read."""
    if source == "default":
        from data.corpus import corpus_files  # imported here: it imports torch, which the workers never need

        return corpus_files("default")
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
        )
        if files:
            return files
        raise ConfigError(f"--source {source!r} is a folder with no files; point it at text, JSONL or Parquet files.")
    raise ConfigError(f"--source {source!r} does not exist; give a file, a folder, or 'default'.")


def file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def jsonl_documents(path: Path, field: str, progress: Progress, utf8: Utf8) -> Iterator[str]:
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            progress.bytes_done += len(raw)
            line = utf8.decode(raw, f"{path}:{lineno}", offset)
            offset += len(raw)
            if not line.strip():
                continue
            record = parse_json(line, f"{path}:{lineno}", "each line of a JSONL file must be one JSON object.")
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(map(repr, record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
                raise ConfigError(
                    f"{path}:{lineno} has no {field!r} field (it has {keys or 'no fields'}); pass --text-field with "
                    "the field that holds the text, or fix the line."
                )
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(
                    f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not a string; pass --text-field with "
                    "the field that holds the text."
                )
            yield text


def import_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(
            'Parquet sources need `pyarrow`, which is missing; install the data extra: pip install -e ".[data]" '
            "(or pip install pyarrow)."
        ) from exc
    return pq


def parquet_documents(path: Path, field: str, progress: Progress) -> Iterator[str]:
    pq = import_parquet()
    unreadable = f"{path} is not a readable Parquet file ({{}}); check or re-download it, or move it out of --source."
    try:
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for damaged files
        raise ConfigError(unreadable.format(f"{type(exc).__name__}: {exc}")) from exc
    if field not in columns:
        raise ConfigError(
            f"{path} has no {field!r} column (it has {', '.join(map(repr, columns))}); pass --text-field with the "
            "column that holds the text."
        )
    row, start, size, rows = 0, progress.bytes_done, path.stat().st_size, max(1, parquet.metadata.num_rows)
    try:
        batches = parquet.iter_batches(columns=[field], batch_size=1024)
        for batch in batches:
            progress.bytes_done = start + size * min(1.0, (row + batch.num_rows) / rows)
            for text in batch.column(0).to_pylist():
                row += 1
                if not isinstance(text, str):
                    shown = "null" if text is None else type(text).__name__
                    raise ConfigError(
                        f"{path} row {row}: column {field!r} is {shown}, not a string; pass --text-field with the "
                        "column that holds the text, or drop such rows."
                    )
                yield text
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged row group fails while reading
        raise ConfigError(unreadable.format(f"row {row + 1}: {type(exc).__name__}: {exc}")) from exc


def slices(text: str) -> Iterator[str]:
    """A long JSONL or Parquet value in pieces of PIECE_CHARS (the value itself is already in memory)."""
    for start in range(0, len(text), PIECE_CHARS):
        yield text[start : start + PIECE_CHARS]


def unreadable_file(path: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"{path} cannot be read ({exc}); fix its permissions or remove it from --source.")


def text_blocks(path: Path, progress: Progress, utf8: Utf8) -> Iterator[str]:
    """A text file's text, decoded block by block (never the whole file in memory)."""
    decoder, offset = utf8.decoder(), 0
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; an open or read error becomes a ConfigError
    except OSError as exc:
        raise unreadable_file(path, exc) from exc
    with f:
        while True:
            try:
                block = f.read(PIECE_CHARS)
            except OSError as exc:
                raise unreadable_file(path, exc) from exc
            if not block:
                break
            progress.bytes_done += len(block)
            text = utf8.decode(block, str(path), offset, decoder, final=False)
            offset += len(block)
            if text:
                yield text
    tail = utf8.decode(b"", str(path), offset, decoder, final=True)
    if tail:
        yield tail


def text_documents(path: Path, progress: Progress, utf8: Utf8, long_pieces: bool) -> Iterator[str | LongDocument]:
    """A text file as one document: a string, or, when it is longer than LONG_CHARS, a LongDocument of its
    blocks."""
    try:
        size = path.stat().st_size
        if long_pieces and size > LONG_CHARS:
            yield LongDocument(text_blocks(path, progress, utf8))
            return
        raw = path.read_bytes()
    except OSError as exc:
        raise unreadable_file(path, exc) from exc
    progress.bytes_done += len(raw)
    yield utf8.decode(raw, str(path))


def documents(
    files: list[Path], field: str, progress: Progress, utf8: Utf8 | None = None, long_pieces: bool = False
) -> Iterator[str | LongDocument]:
    """Every non-empty document of ``files`` in order (step 1 of the module docstring). With ``long_pieces``
    a document longer than LONG_CHARS comes as a LongDocument, to be consumed before the next is asked for."""
    utf8 = utf8 or Utf8("strict")
    for path in files:
        start = progress.bytes_done
        kind = file_kind(path)
        if kind == "jsonl":
            texts = jsonl_documents(path, field, progress, utf8)
        elif kind == "parquet":
            texts = parquet_documents(path, field, progress)
        else:
            texts = text_documents(path, progress, utf8, long_pieces)
        for text in texts:
            if isinstance(text, str) and long_pieces and len(text) > LONG_CHARS:
                text = LongDocument(slices(text))
            if text:
                yield text
        progress.files_done += 1
        progress.bytes_done = start + path.stat().st_size


def chunks(texts: Iterator[str | LongDocument]) -> Iterator[list[str] | LongDocument]:
    """Documents grouped for the workers; a LongDocument passes through alone, after the chunk before it."""
    chunk, size = [], 0
    for text in texts:
        if isinstance(text, LongDocument):
            if chunk:
                yield chunk
                chunk, size = [], 0
            yield text
            continue
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# ---- workers -------------------------------------------------------------------------------------------

_worker_tokenizer = None


def _init_worker(spec: str, eos_token: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the parallelism is ours: one thread per worker process
    _worker_tokenizer = load_tokenizer(spec, eos_token)


def eos_ids(tokenizer) -> np.ndarray:
    return np.zeros(0, dtype=np.uint32) if tokenizer.eos_id is None else np.array([tokenizer.eos_id], dtype=np.uint32)


def encode_chunk(texts: list[str], tokenizer=None, with_starts: bool = False):
    """The packed ids of ``texts``: each document's ids, then the EOS id (step 3), as one numpy array; with
    ``with_starts``, (ids, the offset in ids where each document starts)."""
    tokenizer = tokenizer or _worker_tokenizer
    eos = eos_ids(tokenizer)
    encoded = tokenizer.encode_arrays(texts)
    parts = [part for ids in encoded for part in (ids, eos)]
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    if not with_starts:
        return ids
    lengths = np.array([len(a) + len(eos) for a in encoded], dtype=np.int64)
    return ids, np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths


def tokenized(
    texts: Iterator[str | LongDocument], spec: str, eos_token: str, workers: int, tokenizer
) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """(documents completed, (packed ids, where documents start in them)) in document order, from ``workers`` processes (step 2); a long
    document is tokenized here, in pieces, once the chunks before it are written."""
    import multiprocessing

    with contextlib.ExitStack() as stack:
        pool = None
        if workers > 1:
            # spawn: the workers import only this module and the tokenizer (not torch), whatever the parent holds.
            pool = stack.enter_context(
                ProcessPoolExecutor(
                    workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(spec, eos_token),
                )
            )
        pending: deque = deque()
        try:
            for item in chunks(texts):
                if isinstance(item, LongDocument):
                    while pending:  # the documents before it come first
                        n, future = pending.popleft()
                        yield n, future.result()
                    first = [0]  # the document starts with its first piece
                    for ids in encode_long(tokenizer, item.pieces):
                        yield 0, (ids, first)
                        first = []
                    yield 1, (eos_ids(tokenizer), first)
                elif pool is None:
                    yield len(item), encode_chunk(item, tokenizer, with_starts=True)
                else:
                    pending.append((len(item), pool.submit(encode_chunk, item, with_starts=True)))
                    if len(pending) >= 2 * workers:
                        n, future = pending.popleft()
                        yield n, future.result()
            while pending:
                n, future = pending.popleft()
                yield n, future.result()
        except BaseException:
            if pool is not None:  # a signal or an error: end the workers now, not after their queued chunks
                stop_workers(pool)
            raise
        finally:
            for _, future in pending:
                future.cancel()


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate a pool's worker processes and drop its queued work, so that nothing outlives the command (a
    worker left running keeps multiprocessing's resource tracker alive too)."""
    pool.shutdown(wait=False, cancel_futures=True)
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # before 3.14: no public way
        process.terminate()
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.join(timeout=5)


class Progress:
    """A progress bar on stderr by bytes of the source read: rewritten in place on a terminal, otherwise a
    line every 10 s. Bytes count when a document is read, a chunk or two ahead of its tokenization."""

    def __init__(self, files: list[Path], stream=sys.stderr):
        self.n_files, self.files_done, self.stream = len(files), 0, stream
        self.bytes_total, self.bytes_done = sum(f.stat().st_size for f in files), 0
        self.tty = stream is not None and stream.isatty()
        self.start = self.last = time.perf_counter()

    def update(self, docs: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if self.stream is None or (not final and now - self.last < (0.5 if self.tty else 10.0)):
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        width, fraction = 24, min(1.0, self.bytes_done / max(1, self.bytes_total))
        filled = int(width * fraction)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%} | {self.files_done}/{self.n_files} files | "
            f"{docs:,} documents | {tokens:,} tokens | {rate:,.0f} tokens/s"
        )
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


def prepare(
    source: str,
    tokenizer_spec: str,
    out: str,
    *,
    text_field: str = "text",
    workers: int = 0,
    eos_token: str = "",
    quiet: bool = False,
    errors: str = "strict",
) -> dict:
    """Tokenize ``source`` into ``out`` (see the module docstring); returns the header written."""
    utf8 = Utf8(errors)
    tokenizer = load_tokenizer(tokenizer_spec, eos_token, field="--tokenizer")
    files = source_files(source)
    workers = workers or min(8, os.cpu_count() or 1)
    progress = Progress(files, stream=None if quiet else sys.stderr)
    writer = TokenFileWriter(out, dtype_for(tokenizer.vocab_size))
    n_docs = 0
    try:
        texts = documents(files, text_field, progress, utf8, long_pieces=True)
        for count, (ids, starts) in tokenized(texts, tokenizer_spec, eos_token, workers, tokenizer):
            writer.append(ids, starts=starts)  # and where each document starts (data/token_file.py)
            n_docs += count
            progress.update(n_docs, writer.num_tokens)
    except BaseException:
        writer.abort()
        raise
    progress.update(n_docs, writer.num_tokens, final=True)
    if writer.num_tokens == 0:
        writer.abort()
        raise ConfigError(f"--source {source!r} holds no text (no non-empty documents); point it at your data.")
    header = {
        "num_documents": n_docs,
        "tokenizer": tokenizer.describe(),
        "source": source if source == "default" else str(Path(source).expanduser().resolve()),
        "files": len(files),
        "text_field": text_field,
        "utf8_replaced_bytes": utf8.replaced,
    }
    writer.finish(header)
    seconds = time.perf_counter() - progress.start
    header.update(dtype=writer.dtype, num_tokens=writer.num_tokens, seconds=seconds)
    return header


def prepare_chat(
    source: str, tokenizer_spec: str, out: str, *, seq_len: int, eos_token: str = "", train_on: str = "assistant"
) -> dict:
    """Chat JSONL -> a masked token file packed for ``seq_len`` windows (data/chat.py); returns the header."""
    from data.chat import Packer, conversation, conversations, template_tokenizer

    start = time.perf_counter()
    if seq_len <= 0:
        raise ConfigError("--format chat packs conversations into training windows: give --seq-len (training.seq_len)")
    tokenizer = load_tokenizer(tokenizer_spec, eos_token, field="--tokenizer")
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise ConfigError("--format chat needs a model's tokenizer folder (with its chat template), not 'bytes'")
    folder = Path(tokenizer_spec).expanduser()
    tok = template_tokenizer(folder if folder.is_dir() else folder.parent)
    files = source_files(source)
    writer = TokenFileWriter(out, dtype_for(tokenizer.vocab_size), masked=True)
    packer, n_docs = Packer(writer, seq_len, tokenizer.eos_id), 0
    try:
        for file in files:
            for messages, where in conversations(file):
                packer.add(*conversation(tok, tokenizer, messages, train_on, where))
                n_docs += 1
    except BaseException:
        writer.abort()
        raise
    if n_docs == 0:
        writer.abort()
        raise ConfigError(f"--source {source!r} holds no conversation (JSONL lines with 'messages').")
    if writer.trained_tokens == 0:  # a run on it would train on nothing: loss 0, gradient 0, exit 0
        writer.abort()
        what = "no assistant turn" if train_on == "assistant" else "no token"
        raise ConfigError(
            f"--source {source!r}: its {n_docs:,} conversations have {what} to train (0 trained tokens with "
            f"--train-on {train_on}); add conversations with assistant replies"
            + (", or pass --train-on all to train every token." if train_on == "assistant" else ".")
        )
    header = {
        "num_documents": n_docs,
        "tokenizer": tokenizer.describe(),
        "source": str(Path(source).expanduser().resolve()),
        "files": len(files),
        "chat": {"train_on": train_on, "seq_len": seq_len, "split_conversations": packer.split},
    }
    writer.finish(header)
    header.update(
        dtype=writer.dtype, num_tokens=writer.num_tokens, seconds=time.perf_counter() - start, utf8_replaced_bytes=0
    )
    header["trained_tokens"] = writer.trained_tokens
    return header


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py): a bad value is refused with exit 2."""
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--source", required=True, type=path_option(), help="a text/JSONL/Parquet file, a folder of them, or 'default'"
    )
    parser.add_argument(
        "--tokenizer", required=True, type=path_option(), help="'bytes' or a tokenizer.json (or the folder holding it)"
    )
    parser.add_argument("--out", required=True, type=path_option(), help="a new folder for tokens.bin and header.json")
    parser.add_argument(
        "--text-field",
        default="text",
        type=text_option(nonempty=True),
        help="JSONL field / Parquet column with the text (default: text)",
    )
    parser.add_argument(
        "--workers",
        type=int_option(ge=0, le=1024),
        default=0,
        help="tokenizing processes (default: the CPU count, at most 8)",
    )
    parser.add_argument(
        "--eos-token",
        "--eos",
        default="",
        type=text_option(),
        help="end-of-document token (default: the tokenizer folder's eos_token, the one the model was trained with)",
    )
    parser.add_argument("--format", choices=("text", "chat"), default="text", help="text documents, or chat JSONL")
    parser.add_argument(
        "--train-on", choices=("assistant", "all"), default="assistant", help="chat: the tokens the loss trains"
    )
    parser.add_argument(
        "--seq-len", type=int_option(ge=0), default=0, help="chat: training.seq_len, the windows to pack for"
    )
    parser.add_argument(
        "--errors",
        choices=ERRORS,
        default="strict",
        help="invalid UTF-8: strict refuses it naming the file and byte (default); replace puts U+FFFD and counts",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        with interrupts_raise():  # SIGTERM/SIGINT: workers ended, the unfinished output removed, exit 128 + signal
            return _main(opts)
    except Interrupted as stop:
        print(
            f"meshloom prepare: stopped by {stop}; the worker processes were ended and the unfinished output in "
            f"{opts.out} removed. Run the same command again to prepare it.",
            file=sys.stderr,
            flush=True,
        )
        return 128 + stop.signum


def _main(opts) -> int:
    try:
        check_out_folder(opts.out, "--out")
        if opts.format == "chat":
            h = prepare_chat(
                opts.source,
                opts.tokenizer,
                opts.out,
                seq_len=opts.seq_len,
                eos_token=opts.eos_token,
                train_on=opts.train_on,
            )
            print(
                f"prepared {h['num_documents']:,} conversations, {h['num_tokens']:,} tokens, {h['trained_tokens']:,} "
                f"trained ({opts.train_on}), {h['chat']['split_conversations']} longer than a window (split) -> "
                f"{Path(opts.out) / 'tokens.bin'} + mask.bin",
                flush=True,
            )
            return 0
        h = prepare(
            opts.source,
            opts.tokenizer,
            opts.out,
            text_field=opts.text_field,
            workers=opts.workers,
            eos_token=opts.eos_token,
            errors=opts.errors,
        )
    except ConfigError as exc:
        print(f"meshloom prepare: error: {exc}", file=sys.stderr, flush=True)
        return 2
    rate = h["num_tokens"] / max(h["seconds"], 1e-9)
    print(
        f"prepared {h['num_documents']:,} documents, {h['num_tokens']:,} tokens ({h['dtype']}) in {h['seconds']:.1f} s, "
        f"{rate:,.0f} tokens/s -> {Path(opts.out) / 'tokens.bin'}",
        flush=True,
    )
    if h["utf8_replaced_bytes"]:
        print(
            f"replaced {h['utf8_replaced_bytes']:,} bytes of invalid UTF-8 with U+FFFD (--errors replace)", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
