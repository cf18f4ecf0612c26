"""The prepared-dataset format: one flat token file plus a small JSON header, in one folder.

    DIR/tokens.bin    every token id of every document, in order, each document followed by the EOS id;
                      little-endian uint16 when the vocabulary fits in 65,536 ids, else uint32; no framing
    DIR/header.json   {"format": "meshloom-tokens", "version": 1, "dtype": "uint16", "num_tokens": N,
                       "max_id": M, "tokens_sha256": "...", "num_documents": D, "tokenizer": {"name", "sha256", "vocab_size", "eos_id", ...},
                       "source": "...", "text_field": "text", "created_at": "..."}

Chat data (``data.prepare --format chat``) adds a loss mask beside the tokens:

    DIR/mask.bin      one uint8 per token of tokens.bin: 1 if the loss counts that token *as a target* (the
                      prediction of it from the tokens before it), 0 if not (a user turn, the template's
                      framing); the header then has "loss_mask": {"file": "mask.bin", "trained_tokens": K,
                      "sha256": "..."}

Every folder written since document masks exist also records where each document starts:

    DIR/documents.bin one little-endian uint64 per document: the offset in tokens.bin of its first token, in
                      increasing order, the first 0; the header then has "documents": {"file": "documents.bin",
                      "count": D}. Chat data records each conversation, and each run of padding between
                      conversations, as a document. A folder without it (prepared before) still loads; its
                      documents are then not known (``open_documents`` returns None).

``open_tokens`` then returns a ``MaskedTokens`` (the tokens and the mask, sliced together), and the loader
turns masked targets into the ignored index and counts the step's trained tokens (data/loader.py).

``max_id`` (the largest id written) is computed while writing; a header without it (from an older
meshloom) still loads, and its ids are then only checked window by window as a run reads them
(data/loader.py).

``tokens_sha256`` is the SHA-256 of ``tokens.bin``'s bytes, updated with each chunk as it is written (no
second pass over the file). It identifies the stream by content: a checkpoint records it, and a resume into
another stream under the same path is refused (checkpoint/resume.py), because ``tokens_consumed`` would
then point at other tokens. A header without it (from an older meshloom) is identified by path only.

``tokens.bin`` is written first (as ``tokens.bin.tmp``, renamed when complete), ``header.json`` last, so
a folder with a header is a complete dataset and a killed ``data.prepare`` leaves no header. Reading
checks the header against the file (dtype, size) before anything is mapped, and ``open_tokens`` returns
a ``TokenMap``: a read-only memory map whose pages are read from disk when a batch touches them and given
back right after, so a process's memory does not grow with the dataset, nor with how much of it a run
has read (measure/loader_memory.py measures it).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np

from runtime.config import ConfigError
from runtime.files import read_json

HEADER, TOKENS, MASK, DOCUMENTS = "header.json", "tokens.bin", "mask.bin", "documents.bin"
FORMAT, VERSION = "meshloom-tokens", 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # little-endian on every machine


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_token_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / HEADER).is_file()


class TokenFileWriter:
    """Append token arrays to ``DIR/tokens.bin.tmp``; ``finish(header)`` publishes them. Never over an existing
    dataset."""

    def __init__(self, out_dir: str | Path, dtype: str, masked: bool = False):
        self.dir = Path(out_dir)
        for name in (HEADER, TOKENS, TOKENS + ".tmp", MASK, MASK + ".tmp", DOCUMENTS, DOCUMENTS + ".tmp"):
            if (self.dir / name).exists():
                raise ConfigError(
                    f"--out {self.dir} already holds {name}; meshloom never overwrites a prepared dataset: "
                    "choose a new --out folder (or remove the old one yourself)."
                )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.tmp = self.dir / (TOKENS + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish() / abort()
        self.num_tokens = 0
        self.max_id = -1  # the largest id written (-1: none yet)
        self.digest = hashlib.sha256()  # of the bytes written, chunk by chunk: the header's tokens_sha256
        self.mask_file = open(self.dir / (MASK + ".tmp"), "wb") if masked else None  # noqa: SIM115 - as above
        self.mask_digest, self.trained_tokens = hashlib.sha256(), 0
        self.doc_file = open(self.dir / (DOCUMENTS + ".tmp"), "wb")  # noqa: SIM115 - as above
        self.num_documents = 0

    def append(self, ids: np.ndarray, mask: np.ndarray | None = None, starts=()) -> None:
        """Append ``ids`` (and, for a masked writer, their loss mask: one 0/1 per id); ``starts``: the offsets in
        ``ids`` where a document begins (increasing)."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts):
            self.doc_file.write((starts + self.num_tokens).astype("<u8").tobytes())
            self.num_documents += len(starts)
        if (mask is None) != (self.mask_file is None) or (mask is not None and len(mask) != len(ids)):
            raise ValueError("a masked TokenFileWriter needs one mask value per id; an unmasked one takes none")
        if mask is not None:
            raw_mask = np.ascontiguousarray(mask, dtype=np.uint8).tobytes()
            self.mask_file.write(raw_mask)
            self.mask_digest.update(raw_mask)
            self.trained_tokens += int(np.count_nonzero(mask))
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        raw = np.ascontiguousarray(ids, dtype=DTYPES[self.dtype]).tobytes()
        self.file.write(raw)
        self.digest.update(raw)
        self.num_tokens += len(ids)

    def finish(self, header: dict) -> Path:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.dir / TOKENS)
        if self.mask_file is not None:
            self.mask_file.flush()
            os.fsync(self.mask_file.fileno())
            self.mask_file.close()
            os.replace(self.dir / (MASK + ".tmp"), self.dir / MASK)
            mask = {"file": MASK, "trained_tokens": self.trained_tokens, "sha256": self.mask_digest.hexdigest()}
            header = {**header, "loss_mask": mask}
        self.doc_file.flush()
        os.fsync(self.doc_file.fileno())
        self.doc_file.close()
        os.replace(self.dir / (DOCUMENTS + ".tmp"), self.dir / DOCUMENTS)
        header = {**header, "documents": {"file": DOCUMENTS, "count": self.num_documents}}
        header = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "num_tokens": self.num_tokens,
            "max_id": self.max_id,
            "tokens_sha256": self.digest.hexdigest(),
            **header,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        part = self.dir / (HEADER + ".tmp")
        part.write_text(json.dumps(header, indent=1) + "\n")
        os.replace(part, self.dir / HEADER)
        return self.dir / HEADER

    def abort(self) -> None:
        """Remove the partial file (a failed prepare leaves nothing that looks like a dataset)."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)
        self.doc_file.close()
        (self.dir / (DOCUMENTS + ".tmp")).unlink(missing_ok=True)
        if self.mask_file is not None:
            self.mask_file.close()
            (self.dir / (MASK + ".tmp")).unlink(missing_ok=True)


def read_header(path: str | Path, field: str = "data.source") -> dict:
    """The header of the dataset folder ``path``, checked against its token file (no tokens are read)."""
    folder = Path(path).expanduser()
    where = f"{field}={str(path)!r}"
    header = read_json(folder / HEADER, "prepare the dataset again.", where=f"{where}: {HEADER}")
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ConfigError(
            f"{where}: {HEADER} is not a {FORMAT} version {VERSION} header; prepare the dataset with python -m data.prepare."
        )
    if (
        not isinstance(header.get("dtype"), str)
        or header["dtype"] not in DTYPES
        or not is_count(header.get("num_tokens"))
    ):
        raise ConfigError(
            f"{where}: {HEADER} has dtype={header.get('dtype')!r}, num_tokens={header.get('num_tokens')!r}; "
            "expected uint16/uint32 and an integer; prepare the dataset again."
        )
    wrong = [
        f"{name}={value!r} (expected {kind})"
        for name, kind, value in _typed_fields(header)
        if not HEADER_KINDS[kind](value)
    ]
    if wrong:
        raise ConfigError(
            f"{where}: {HEADER} has {', '.join(wrong)}; the header is damaged: prepare the dataset again."
        )
    tokens = folder / TOKENS
    expected = header["num_tokens"] * DTYPES[header["dtype"]].itemsize
    size = tokens.stat().st_size if tokens.is_file() else None
    if size != expected:
        found = "is missing" if size is None else f"has {size:,} bytes"
        raise ConfigError(
            f"{where}: {TOKENS} {found} but {HEADER} promises {header['num_tokens']:,} {header['dtype']} tokens "
            f"({expected:,} bytes); the folder is damaged: prepare the dataset again."
        )
    if "loss_mask" in header:
        mask = folder / MASK
        size = mask.stat().st_size if mask.is_file() else None
        if size != header["num_tokens"]:
            found = "is missing" if size is None else f"has {size:,} bytes"
            raise ConfigError(
                f"{where}: {MASK} {found} but {HEADER} promises a loss mask of {header['num_tokens']:,} bytes (one "
                "per token); the folder is damaged: prepare the dataset again."
            )
    documents = header.get("documents")
    if documents is not None:
        file = folder / DOCUMENTS
        size = file.stat().st_size if file.is_file() else None
        if not isinstance(documents.get("count"), int) or size != 8 * documents["count"]:
            found = "is missing" if size is None else f"has {size:,} bytes"
            raise ConfigError(
                f"{where}: {DOCUMENTS} {found} but {HEADER} promises {documents.get('count')!r} document starts (8 "
                "bytes each); the folder is damaged: prepare the dataset again."
            )
    return header


# header.json's optional fields and their types: (path, kind); the required ones are checked above
HEADER_KINDS = {
    "an object": lambda value: isinstance(value, dict),
    "a string": lambda value: isinstance(value, str),
    "a count": lambda value: is_count(value),
    "a count or null": lambda value: value is None or is_count(value),
}
HEADER_FIELDS = (
    ("max_id", "a count"),
    ("num_documents", "a count"),
    ("tokens_sha256", "a string"),
    ("trained_tokens", "a count"),
    ("tokenizer", "an object"),
    ("tokenizer.vocab_size", "a count"),
    ("tokenizer.eos_id", "a count or null"),
    ("tokenizer.sha256", "a string"),
    ("tokenizer.name", "a string"),
    ("loss_mask", "an object"),
    ("loss_mask.trained_tokens", "a count"),
    ("documents", "an object"),
    ("documents.count", "a count"),
    ("chat", "an object"),
    ("chat.seq_len", "a count"),
)


def is_count(value: object) -> bool:
    """An int >= 0 (JSON's true is a Python bool, an int: not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _typed_fields(header: dict):
    """(dotted name, kind, value) for each of ``HEADER_FIELDS`` the header has (below an object only)."""
    for name, kind in HEADER_FIELDS:
        value, found = header, True
        for part in name.split("."):
            if not isinstance(value, dict) or part not in value:
                found = False
                break
            value = value[part]
        if found:
            yield name, kind, value


def open_documents(path: str | Path, header: dict, field: str = "data.source") -> np.ndarray | None:
    """The offsets where each document starts (int64), or None for a folder prepared before they were recorded.
    Read whole: 8 bytes per document, and checked: the first is 0, each is at least the one before, none is past
    the last token (a wrong offset would be an IndexError mid-run, or a silently wrong document mask)."""
    if "documents" not in header:
        return None
    starts = np.fromfile(Path(path).expanduser() / DOCUMENTS, dtype="<u8")
    where = f"{field}={str(path)!r}: {DOCUMENTS}"
    fix = "the folder is damaged: prepare the dataset again."
    if len(starts) and int(starts[0]) != 0:
        raise ConfigError(f"{where} starts its first document at token {int(starts[0]):,}, not 0; {fix}")
    if len(starts) > 1 and bool((np.diff(starts.astype(np.int64)) < 0).any()):
        at = int(np.argmax(np.diff(starts.astype(np.int64)) < 0)) + 1
        raise ConfigError(
            f"{where}: document {at} starts at token {int(starts[at]):,}, before document {at - 1} "
            f"({int(starts[at - 1]):,}); the starts must not decrease; {fix}"
        )
    if len(starts) and int(starts.max()) > header["num_tokens"]:
        raise ConfigError(
            f"{where} has a document starting at token {int(starts.max()):,}, past the {header['num_tokens']:,} "
            f"tokens of {TOKENS}; {fix}"
        )
    starts = starts.astype(np.int64)
    return starts if len(starts) else np.zeros(1, dtype=np.int64)


class TokenMap:
    """A read-only memory map of a token file (or part) that gives pages back: an integer-array read copies out, then
    ``madvise(MADV_DONTNEED)``s the span, so a run's resident memory does not grow to the whole file."""

    def __init__(self, file: Path, dtype: np.dtype, start: int = 0, length: int | None = None, _map=None):
        if _map is None:
            with open(file, "rb") as f:
                _map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the descriptor
        self._map, self.dtype, self.file = _map, dtype, file
        self._array = np.frombuffer(_map, dtype=dtype)
        self.start = start
        self.length = len(self._array) - start if length is None else length

    @property
    def shape(self) -> tuple[int]:
        return (self.length,)

    def __len__(self) -> int:
        return self.length

    def __array__(self, dtype=None, copy=None):
        view = self._array[self.start : self.start + self.length]
        return view if dtype is None else view.astype(dtype)

    def __getitem__(self, key):
        if isinstance(key, slice):
            first, stop, step = key.indices(self.length)
            if step != 1:
                raise IndexError("a TokenMap slice must be contiguous")
            return TokenMap(self.file, self.dtype, self.start + first, max(0, stop - first), _map=self._map)
        index = np.asarray(key)
        if index.size and (index.min() < 0 or index.max() >= self.length):
            raise IndexError(f"token index out of range [0, {self.length})")
        values = self._array[self.start + index]  # fancy indexing: a copy
        if index.size:
            self._give_back(self.start + int(index.min()), self.start + int(index.max()) + 1)
        return values

    def first_at_least(self, limit: int, first: int, stop: int) -> int | None:
        """The offset (in this map) of the first id >= ``limit`` in ``[first, stop)``, or None: one max over a
        view of the map (no copy), whose pages are then given back like a batch's."""
        view = self._array[self.start + first : self.start + stop]
        found = None
        if len(view) and int(view.max()) >= limit:
            found = first + int(np.argmax(view >= limit))
        if stop > first:
            self._give_back(self.start + first, self.start + stop)
        return found

    def _give_back(self, first: int, stop: int) -> None:
        if not hasattr(mmap, "MADV_DONTNEED"):  # not every platform has it; the map still works
            return
        begin = first * self.dtype.itemsize // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants page alignment
        self._map.madvise(mmap.MADV_DONTNEED, begin, stop * self.dtype.itemsize - begin)


class MaskedTokens:
    """Token ids and their 0/1 loss mask, sliced together (TokenMaps, numpy arrays or tensors of equal length)."""

    def __init__(self, tokens, mask):
        if len(tokens) != len(mask):
            raise ValueError(f"{len(tokens)} tokens but {len(mask)} mask values")
        self.tokens, self.mask = tokens, mask

    @property
    def shape(self) -> tuple[int]:
        return (len(self.tokens),)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise TypeError("index the tokens and the mask of a MaskedTokens separately")
        return MaskedTokens(self.tokens[key], self.mask[key])


def open_tokens(path: str | Path, header: dict):
    """The token file as a TokenMap (nothing is read until it is indexed); an empty array for no tokens; with a
    loss mask, a MaskedTokens of both maps."""
    if header["num_tokens"] == 0:
        return np.zeros(0, dtype=DTYPES[header["dtype"]])
    tokens = TokenMap(Path(path).expanduser() / TOKENS, DTYPES[header["dtype"]])
    if "loss_mask" not in header:
        return tokens
    return MaskedTokens(tokens, TokenMap(Path(path).expanduser() / MASK, np.dtype(np.uint8)))


def check_header_ids(header: dict, vocab_size: int, field: str = "data.source", path: str = "") -> None:
    """Every id of the dataset must be below ``model.vocab_size``: the header's vocabulary and ``max_id`` (older headers
    lack it: the loader checks the windows)."""
    vocab, max_id = header.get("tokenizer", {}).get("vocab_size"), header.get("max_id")
    if isinstance(vocab, int) and vocab > vocab_size:
        raise ConfigError(
            f"{field}={path!r} was prepared with a vocabulary of {vocab:,} ids (header.json tokenizer.vocab_size), "
            f"more than model.vocab_size={vocab_size:,}: its ids would index past the embedding; set "
            f"--model.vocab_size {vocab} or more, or prepare the data with a tokenizer of at most {vocab_size:,} ids."
        )
    if isinstance(max_id, int) and max_id >= vocab_size:
        raise ConfigError(
            f"{field}={path!r} holds token ids up to {max_id:,} (header.json max_id), but model.vocab_size="
            f"{vocab_size:,} only has ids 0..{vocab_size - 1:,}; set --model.vocab_size {max_id + 1} or more, or "
            "prepare the dataset again with the tokenizer of this model (python -m data.prepare)."
        )


def check_header_tokenizer(header: dict, tokenizer, field: str = "data.source", path: str = "") -> None:
    """The dataset must have been tokenized by ``tokenizer`` (same file hash, same EOS id)."""
    saved = header.get("tokenizer", {})
    if saved.get("sha256") != tokenizer.sha256 or saved.get("eos_id") != tokenizer.eos_id:
        raise ConfigError(
            f"{field}={path!r} was tokenized with {saved.get('name')!r} (sha256 {str(saved.get('sha256'))[:12]}, "
            f"vocab {saved.get('vocab_size')}, eos id {saved.get('eos_id')}), but data.tokenizer={tokenizer.name!r} is "
            f"another tokenizer (sha256 {tokenizer.sha256[:12]}, vocab {tokenizer.vocab_size}, eos id {tokenizer.eos_id}); "
            f"set --data.tokenizer to the one the dataset was prepared with, or prepare it again with this one."
        )
