"""Where the training text comes from.

``data.source = "default"`` reads the Python standard library's own ``.py`` files, sorted by name, so
every machine with Python has the same corpus (for a given Python version) and nothing is downloaded.
Otherwise ``data.source`` is a text file, or a folder whose regular files are read in sorted order.
With the byte tokenizer the files are concatenated as bytes; data/dataset.py tokenizes them with a
tokenizer.json instead when one is configured. Large datasets go through data/prepare.py.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from config import ConfigError
from data.tokenizer import encode


def corpus_files(source: str, field: str = "data.source") -> list[Path]:
    """The files of ``source`` in the fixed order they are read."""
    if source == "default":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in stdlib.glob("*.py") if p.is_file())
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ConfigError(f"{field}={source!r} is a folder with no files; point it at text files.")
        return files
    raise ConfigError(
        f"{field}={source!r} does not exist; give a text file, a folder of text files, a folder written by "
        "python -m data.prepare, or 'default'."
    )


def load_corpus(source: str, max_bytes: int) -> torch.Tensor:
    """Token ids (uint8) of the first ``max_bytes`` bytes of the corpus."""
    chunks, total = [], 0
    for file in corpus_files(source):
        raw = file.read_bytes()[: max_bytes - total]
        chunks.append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    return encode(b"".join(chunks))
