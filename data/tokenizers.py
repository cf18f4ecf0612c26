"""Tokenizers: raw bytes (the default) or a Hugging Face ``tokenizer.json``.

``data.tokenizer = "bytes"``: token id = byte value, 256 ids, no end-of-document token; files are
concatenated byte for byte, so a corpus needs no preparation and no tokenizer file.

``data.tokenizer = "path/to/tokenizer.json"`` (or the folder holding it): loaded with the ``tokenizers``
library (the ``data`` extra: ``pip install -e ".[data]"``). Every document is followed by the tokenizer's
end-of-document token (EOS), so the model sees where one text stops and the next begins. The EOS is taken
from ``data.eos_token`` when set, else from a ``tokenizer_config.json`` beside the file (its
``eos_token``), else from the first special token named like an end of text (``EOS_NAMES``).

A tokenizer is identified by the SHA-256 of its ``tokenizer.json``: token files (data/token_file.py) and
checkpoints record it, so a mismatch is caught before training, not discovered in the loss curve.

This module does not import torch: data.prepare's tokenizing worker processes start in a fraction of a
second.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from runtime.config import ConfigError
from runtime.files import parse_json, read_bytes, read_json_object

# Special tokens that end a text in common tokenizers (GPT-2 / Llama 3 base / Llama 2, Mistral / Gemma).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
INSTALL_HINT = 'install the data extra: pip install -e ".[data]" (or pip install tokenizers)'


def import_tokenizers():
    """The ``tokenizers`` module, or a ConfigError that names the extra to install."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError(
            f"a tokenizer.json needs the `tokenizers` library, which is missing; {INSTALL_HINT}."
        ) from exc
    return tokenizers


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255). No EOS: documents are concatenated as they are."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None
    eos_token: str | None = None
    sha256 = "bytes"
    file: Path | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as a numpy array, without a Python int per byte."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": None}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (BPE, Unigram, WordPiece: whatever ``tokenizers`` reads)."""

    def __init__(self, file: Path, eos_token: str = "", field: str = "data.tokenizer"):
        tokenizers = import_tokenizers()
        self.file = file.resolve()
        self.name = str(file)
        raw = read_tokenizer_json(file, field)
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self.tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for malformed files
            raise ConfigError(
                f"{field}={str(file)!r} is not a readable tokenizer.json ({exc}); point it at a Hugging Face "
                "tokenizer.json (or use 'bytes')."
            ) from exc
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # the longest added token, in characters: data/pieces.py never cuts closer than this to a piece's end
        self.added_chars = max((len(t.content) for t in self.tok.get_added_tokens_decoder().values()), default=0)
        self._untrimmed = None  # built when a long document is first cut (encode_with_offsets)
        self.eos_token = eos_token or self._find_eos()
        if not self.eos_token:
            raise ConfigError(
                f"{field}={str(file)!r} has no end-of-document token: no tokenizer_config.json eos_token beside it "
                f"and none of the special tokens {', '.join(EOS_NAMES)}; name one with --data.eos_token "
                "(data.prepare: --eos-token)."
            )
        self.eos_id = self.tok.token_to_id(self.eos_token)
        if self.eos_id is None:
            raise ConfigError(
                f"data.eos_token={self.eos_token!r} is not in the vocabulary of {file}; name a token it has."
            )

    def _find_eos(self) -> str:
        config = self.file.parent / "tokenizer_config.json"
        if config.is_file():
            try:  # a broken tokenizer_config.json only loses the hint: the special tokens are looked at next
                eos = read_json_object(config, "").get("eos_token")
            except ConfigError:
                eos = None
            if isinstance(eos, dict):  # the long form {"content": "</s>", ...}
                eos = eos.get("content")
            if isinstance(eos, str) and self.tok.token_to_id(eos) is not None:
                return eos
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        return next((name for name in EOS_NAMES if name in special), "")

    def encode(self, text: str) -> list[int]:
        # No special tokens from the post-processor (BOS etc.): the packing adds exactly one EOS per document.
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str):
        """The ``tokenizers`` Encoding of ``text`` with offsets as the pre-tokenizer cut them: a copy of the
        tokenizer without its post-processor, which may trim spaces off the offsets (GPT-2's ``ByteLevel``
        with ``trim_offsets``) but, without special tokens, never changes the ids. data/pieces.py cuts there."""
        if self._untrimmed is None:
            self._untrimmed = import_tokenizers().Tokenizer.from_str(self.tok.to_str())
            self._untrimmed.post_processor = None
        return self._untrimmed.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "file": str(self.file),
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }


# The JSON files of a Hugging Face tokenizer folder; transformers' AutoTokenizer reads those present (a chat template).
TOKENIZER_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "config.json",  # read by AutoTokenizer when tokenizer_config.json names no tokenizer_class
)
TOKENIZER_FIX = "point it at a Hugging Face tokenizer.json (or use 'bytes')"


def read_tokenizer_json(file: Path, field: str = "data.tokenizer") -> bytes:
    """A tokenizer.json's bytes, once runtime/files.py's JSON reader has passed them (strict UTF-8, nesting depth,
    no lone surrogate, an object): the ``tokenizers`` library then parses the same text."""
    where = f"{field}={str(file)!r}"
    raw = read_bytes(file, TOKENIZER_FIX, where)
    if not isinstance(parse_json(raw, where, TOKENIZER_FIX), dict):
        raise ConfigError(f"{where} is not a JSON object; {TOKENIZER_FIX}.")
    return raw


def check_tokenizer_folder(folder: Path, field: str) -> None:
    """Every JSON file of the tokenizer folder through runtime/files.py's reader, before transformers parses them
    with its own (which stops with a RecursionError on deep nesting and a TypeError on a file of another shape)."""
    for name in TOKENIZER_JSON_FILES:
        if (folder / name).is_file():
            read_json_object(folder / name, "fix or remove the file.", where=f"{field} {folder}: {name}")


def tokenizer_file(spec: str, field: str = "data.tokenizer") -> Path:
    """The tokenizer.json that ``spec`` names (the file, or a folder holding one)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"{field}={spec!r}: no such tokenizer.json; give 'bytes' or the path of a Hugging Face tokenizer.json "
            "(or of the folder holding it)."
        )
    return path


def load_tokenizer(spec: str, eos_token: str = "", field: str = "data.tokenizer"):
    """``"bytes"`` or a path to a tokenizer.json (or its folder) -> a tokenizer object (see the module docstring)."""
    if spec == "bytes":
        if eos_token:
            raise ConfigError(
                f"data.eos_token={eos_token!r} but {field}='bytes' has no special tokens; leave data.eos_token empty."
            )
        return ByteTokenizer()
    file = tokenizer_file(spec, field)
    stat = file.stat()
    key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size, spec, eos_token)
    if key not in _loaded:  # parsed once per process: a checkpoint save records it, a run loads it several times
        _loaded[key] = HFTokenizer(file, eos_token, field)
    return _loaded[key]


_loaded: dict = {}


def check_vocab(tokenizer, vocab_size: int) -> None:
    """``model.vocab_size`` must hold every id the tokenizer can produce."""
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary of {tokenizer.vocab_size} "
            f"(data.tokenizer={tokenizer.name!r}); set --model.vocab_size {tokenizer.vocab_size} or more "
            "(a multiple of parallel.tp; round up to a multiple of 64 for fast matmuls)."
        )
