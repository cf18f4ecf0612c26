"""The one door for the files the project reads and the disks it writes to.

1. **JSON** (``read_json``, ``parse_json``): every JSON file meshloom reads (a transformers folder's config.json
   and index, a checkpoint's meshloom.json, a dataset's header.json, a tokenizer folder's tokenizer.json and
   tokenizer_config.json, a run's lock record, metrics.jsonl on resume) and every JSONL line goes through
   ``parse_json``. The bytes are decoded as strict UTF-8, the text is parsed, then refused when it
   nests deeper than ``MAX_DEPTH`` (Python's own parser stops with a RecursionError near a thousand levels, and
   every reader after it walks the value) or holds a lone surrogate escape (``"\\ud800"``: valid JSON, but no
   character, so the first ``encode`` of it fails far from the file). Anything wrong is one ``ConfigError``
   naming the file, the problem and the fix; the caller's typed field checks come after.
2. **A full disk** (``disk_problem``, ``writing``): ENOSPC, EDQUOT and EROFS, wherever they surface (an
   ``OSError``, or the text of torch's and safetensors' own writer errors), become one line: "the disk at PATH
   is full (needed about N MB, M MB free)" or "... is read-only", raised as ``DiskFullError`` (a ConfigError:
   the entry points print it as their one-paragraph error). The writers that use it publish by rename or
   truncate what they appended, so nothing half-written is left where a reader looks.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.config import ConfigError

MAX_DEPTH = 64  # the deepest a file meshloom reads nests is about 6 (tokenizer.json's normalizer sequences)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json(data: str | bytes, where: str, fix: str) -> object:
    """The JSON value in ``data`` (bytes: strict UTF-8), or a ConfigError "WHERE PROBLEM; FIX"."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise failure(
                where, f"is not UTF-8 (byte {exc.start} is {data[exc.start : exc.start + 1]!r})", fix
            ) from None
    else:
        text = data
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise failure(where, f"is not valid JSON ({exc})", fix) from None
    except RecursionError:
        raise failure(where, f"nests deeper than {MAX_DEPTH} levels", fix) from None
    problem = _shape_problem(value, check_strings=bool(_SURROGATE_ESCAPE.search(text)))
    if problem:
        raise failure(where, problem, fix)
    return value


def failure(where: str, problem: str, fix: str) -> ConfigError:
    """The one message shape: where, what is wrong, what to do (``fix`` may be empty: the caller adds its own)."""
    return ConfigError(f"{where} {problem}" + (f"; {fix}" if fix else ""))


def _shape_problem(value: object, check_strings: bool) -> str | None:
    """Too deep, or (when the text had a surrogate escape) a string that is not Unicode text; iterative."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                return f"nests deeper than {MAX_DEPTH} levels"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif check_strings and isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return f"holds a lone surrogate escape in the string {item[:40]!r}, which is no character"
    return None


def read_bytes(path: str | Path, fix: str, where: str = "") -> bytes:
    """``path``'s bytes, or a ConfigError "WHERE cannot be read (why); FIX" (a folder, no permission, ...)."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise failure(where or str(path), f"cannot be read ({(exc.strerror or str(exc)).lower()})", fix) from None


def read_json(path: str | Path, fix: str, where: str = "") -> object:
    """``path``'s JSON value through ``parse_json``; ``where`` (default: the path) leads the message."""
    return parse_json(read_bytes(path, fix, where), where or str(path), fix)


def read_json_object(path: str | Path, fix: str, where: str = "") -> dict:
    """``read_json``, and the value must be an object (every JSON file meshloom reads is one)."""
    value = read_json(path, fix, where)
    if not isinstance(value, dict):
        raise failure(where or str(path), f"is a JSON {type(value).__name__}, not an object", fix)
    return value


# ---- 2. a full disk --------------------------------------------------------------------------------------------
DISK_ERRNOS = {errno.ENOSPC: "full", errno.EDQUOT: "over its quota", errno.EROFS: "read-only"}
_RUST_OS_CODE = re.compile(r"\bOs \{ code: (\d+)|\(os error (\d+)\)")  # safetensors' Rust io::Error, either form
_TORCH_WRITER = re.compile(r"PytorchStreamWriter failed writing|file write failed|inline_container")
LOW_SPACE = 64 * 2**20  # a torch writer failure with less free than this was the disk filling up


class DiskFullError(ConfigError):
    """A write failed because the disk is full, over its quota or read-only: the fix is outside meshloom."""


def disk_errno(error: BaseException, folder: Path) -> int | None:
    """The errno behind ``error``: an OSError in its chain, safetensors' Rust error text, or torch's writer
    failure (no errno kept) on a disk with almost no room left."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause.errno
        found = _RUST_OS_CODE.search(str(cause))
        if found:
            return int(found.group(1) or found.group(2))
        if _TORCH_WRITER.search(str(cause)) and free_bytes(folder) < LOW_SPACE:
            return errno.ENOSPC
        cause = cause.__cause__ or cause.__context__
    return None


def free_bytes(folder: Path) -> int:
    """Bytes free at ``folder`` (its nearest existing parent); a huge number when that cannot be told."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 2**62


def disk_problem(error: BaseException, folder: str | Path, needed_bytes: int | None = None) -> str | None:
    """One line when ``error`` is a full, over-quota or read-only disk at ``folder`` (else None)."""
    folder = Path(folder)
    code = disk_errno(error, folder)
    if code not in DISK_ERRNOS:
        return None
    if code == errno.EROFS:
        return f"the disk at {folder} is read-only (EROFS)"
    needed = f"needed about {max(1, round(needed_bytes / 2**20)):,} MB, " if needed_bytes else ""
    free = f"{free_bytes(folder) / 2**20:,.1f} MB free"
    return f"the disk at {folder} is {DISK_ERRNOS[code]} ({errno.errorcode[code]}; {needed}{free})"


@contextmanager
def writing(folder: str | Path, needed_bytes: int | None = None, what: str = "") -> Iterator[None]:
    """Turns a full/read-only disk inside the block into a ``DiskFullError`` naming ``folder``; other errors pass.
    The block itself leaves nothing half-written (writes a temporary name, renamed at the end, or truncates)."""
    try:
        yield
    except Exception as exc:
        problem = disk_problem(exc, folder, needed_bytes)
        if problem is None:
            raise
        fix = (
            "remount it writable or write elsewhere"
            if "read-only" in problem
            else "free space there or write elsewhere"
        )
        raise DiskFullError((f"{what}: " if what else "") + f"{problem}; {fix}.") from None
