"""The prepared-dataset format: one flat token file plus a small JSON header, in one folder.

    DIR/tokens.bin    every token id of every document, in order, each document followed by the EOS id;
                      little-endian uint16 when the vocabulary fits in 65,536 ids, else uint32; no framing
    DIR/header.json   {"format": "meshloom-tokens", "version": 1, "dtype": "uint16", "num_tokens": N,
                       "num_documents": D, "tokenizer": {"name", "sha256", "vocab_size", "eos_id", ...},
                       "source": "...", "text_field": "text", "created_at": "..."}

``tokens.bin`` is written first (as ``tokens.bin.tmp``, renamed when complete), ``header.json`` last, so
a folder with a header is a complete dataset and a killed ``data.prepare`` leaves no header. Reading
checks the header against the file (dtype, size) before anything is mapped, and ``open_tokens`` returns
a read-only ``numpy.memmap``: pages are read from disk when a batch touches them, so a process's memory
does not grow with the dataset (bench/loader_memory.py measures it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from config import ConfigError

HEADER, TOKENS = "header.json", "tokens.bin"
FORMAT, VERSION = "meshloom-tokens", 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # little-endian on every machine


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_token_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / HEADER).is_file()


class TokenFileWriter:
    """Append token arrays to ``DIR/tokens.bin.tmp``; ``finish(header)`` publishes the file and the header.

    The folder must not already hold a dataset (or a half-written one): nothing saved is overwritten.
    """

    def __init__(self, out_dir: str | Path, dtype: str):
        self.dir = Path(out_dir)
        for name in (HEADER, TOKENS, TOKENS + ".tmp"):
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

    def append(self, ids: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(ids, dtype=DTYPES[self.dtype]).tobytes())
        self.num_tokens += len(ids)

    def finish(self, header: dict) -> Path:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.dir / TOKENS)
        header = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "num_tokens": self.num_tokens,
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


def read_header(path: str | Path, field: str = "data.source") -> dict:
    """The header of the dataset folder ``path``, checked against its token file (no tokens are read)."""
    folder = Path(path).expanduser()
    where = f"{field}={str(path)!r}"
    try:
        header = json.loads((folder / HEADER).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {HEADER} cannot be read ({exc}); prepare the dataset again.") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ConfigError(
            f"{where}: {HEADER} is not a {FORMAT} version {VERSION} header; prepare the dataset with python -m data.prepare."
        )
    if header.get("dtype") not in DTYPES or not isinstance(header.get("num_tokens"), int):
        raise ConfigError(f"{where}: {HEADER} has dtype={header.get('dtype')!r}, num_tokens={header.get('num_tokens')!r}; "
                          "expected uint16/uint32 and an integer; prepare the dataset again.")  # fmt: skip
    tokens = folder / TOKENS
    expected = header["num_tokens"] * DTYPES[header["dtype"]].itemsize
    size = tokens.stat().st_size if tokens.is_file() else None
    if size != expected:
        found = "is missing" if size is None else f"has {size:,} bytes"
        raise ConfigError(
            f"{where}: {TOKENS} {found} but {HEADER} promises {header['num_tokens']:,} {header['dtype']} tokens "
            f"({expected:,} bytes); the folder is damaged: prepare the dataset again."
        )
    return header


def open_tokens(path: str | Path, header: dict) -> np.ndarray:
    """The token file as a read-only memory map (nothing is read until it is indexed)."""
    if header["num_tokens"] == 0:
        return np.zeros(0, dtype=DTYPES[header["dtype"]])
    return np.memmap(Path(path).expanduser() / TOKENS, dtype=DTYPES[header["dtype"]], mode="r")


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
