"""Where the training text comes from.

``data.source = "default"`` reads the Python standard library's own ``.py`` files, sorted by name, so
every machine with Python has the same corpus (for a given Python version) and nothing is downloaded.
Otherwise ``data.source`` is a text file, or a folder whose regular files are read in sorted order.
Files are concatenated as bytes; the byte tokenizer turns them into token ids.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from config import ConfigError
from data.tokenizer import encode


def corpus_files(source: str) -> list[Path]:
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
            raise ConfigError(f"data.source={source!r} is a folder with no files; point it at text files.")
        return files
    raise ConfigError(f"data.source={source!r} does not exist; give a text file, a folder of text files, or 'default'.")


def check_corpus(source: str, seq_len: int) -> None:
    """Fail before any process group if the corpus is missing or shorter than one training window."""
    size = sum(f.stat().st_size for f in corpus_files(source))
    if size < seq_len + 2:
        raise ConfigError(
            f"data.source={source!r} holds {size} bytes, fewer than training.seq_len + 2 = {seq_len + 2}; "
            "use more text or a smaller training.seq_len."
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
