"""Where the training text comes from.

``data.source = "default"`` reads the Python standard library's own ``.py`` files, sorted by name, so
every machine with Python has the same corpus (for a given Python version) and nothing is downloaded.
Otherwise ``data.source`` is a text file, or a folder whose text files are read in sorted order: hidden
files and folders (``.git/``, ``.venv/``) and files that are not text (a NUL byte or invalid UTF-8 in their
first 8 KiB: binaries, images, archives) are skipped, and the skipped count is said once. A single file
that is not text is refused: training on bytes of a binary runs without complaint and learns nothing useful.
With the byte tokenizer the files are concatenated as bytes; data/dataset.py tokenizes them with a
tokenizer.json instead when one is configured. Large datasets go through data/prepare.py.
"""

from __future__ import annotations

import codecs
import functools
import os
import stat
import sys
import sysconfig
from pathlib import Path

import torch

from runtime.config import ConfigError

SNIFF_BYTES = 8192


def is_text(path: Path) -> bool:
    """No NUL byte and valid UTF-8 in the first 8 KiB (a multi-byte character cut at the end is fine)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


@functools.cache
def _folder_files(folder: Path) -> tuple[tuple[Path, ...], int, int]:
    """(text files in sorted order, hidden entries skipped, non-text files skipped) of a folder tree."""
    files, hidden, binary = [], 0, 0
    for root, dirs, names in os.walk(folder):
        hidden += sum(d.startswith(".") for d in dirs) + sum(n.startswith(".") for n in names)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # do not descend into .git/, .venv/ ...
        for name in names:
            path = Path(root) / name
            if name.startswith(".") or not path.is_file():
                continue
            if is_text(path):
                files.append(path)
            else:
                binary += 1
    return tuple(sorted(files)), hidden, binary


_said: set[str] = set()


def corpus_files(source: str, field: str = "data.source") -> list[Path]:
    """The files of ``source`` in the fixed order they are read."""
    if source == "default":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in stdlib.glob("*.py") if p.is_file())
    path = Path(source).expanduser()
    if path.is_file():
        if not is_text(path):
            raise ConfigError(
                f"{field}={source!r} is not a text file (a NUL byte or invalid UTF-8 in its first {SNIFF_BYTES} "
                "bytes); point it at text, or at a folder written by python -m data.prepare."
            )
        return [path]
    if path.is_dir():
        files, hidden, binary = _folder_files(path.resolve())
        if not files:
            raise ConfigError(
                f"{field}={source!r} is a folder with no text files ({hidden} hidden and {binary} non-text entries "
                "skipped); point it at text files."
            )
        if (hidden or binary) and source not in _said and os.environ.get("RANK", "0") == "0":
            _said.add(source)
            print(
                f"meshloom: {field}={source!r}: reading {len(files)} text files; skipped {hidden} hidden "
                f"entries and {binary} files that are not text",
                file=sys.stderr,
                flush=True,
            )
        return list(files)
    kind = special_file_kind(path)
    raise ConfigError(
        f"{field}={source!r} "
        + (f"is not a regular file: it is {kind}" if kind else "does not exist")
        + "; give a text file, a folder of text files, a folder written by python -m data.prepare, or 'default'."
    )


def special_file_kind(path: Path) -> str | None:
    """What ``path`` is when neither a regular file nor a folder (device, FIFO, socket): refused by name, unopened,
    since it never ends or blocks."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = [
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for test, name in kinds if test(mode)), None)


def load_corpus(source: str, max_bytes: int) -> torch.Tensor:
    """Token ids (uint8) of the first ``max_bytes`` bytes of the corpus: the byte tokenizer's ids are the bytes."""
    chunks, total = [], 0
    for file in corpus_files(source):
        raw = file.read_bytes()[: max_bytes - total]
        chunks.append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
