"""Checksums of a checkpoint's files: recorded when it is published, verified before anything is unpickled.

DCP's ``.metadata`` is a Python pickle, and its shards hold ``torch.save`` records: a damaged file can fail
with a 180-line unpickler traceback, silently load wrong numbers (a flipped bit inside a tensor), or, if
crafted, run code when unpickled. So:

1. At save time every rank hashes the files it wrote (``file_digests``), and rank 0 records the size and
   SHA-256 of every file of the step folder in the JSON manifest ``meshloom.json``, before the atomic
   rename that makes the step visible.
2. Before a step is used, ``manifest_problems`` checks that every listed file exists with its size and that
   ``.metadata``'s digest matches (cheap: it is small), *before* ``.metadata`` is unpickled.
3. The manifest is checksummed too: ``seal`` adds ``manifest_sha256``, the SHA-256 of the rest of the
   manifest written canonically (sorted keys, no spaces), and ``manifest_changed`` recomputes it after the
   JSON parsed. A manifest that still parses but whose fields were changed (a flipped digit in
   ``n_layers``) is damaged like a shard, not read as a model that contradicts the config. A manifest
   without the field (an older meshloom) is accepted, with a warning.
4. ``digest_problems`` hashes the shards themselves. For a resume the ranks split the files between them
   and agree on the result (checkpoint/manager.py), so no rank reads more than its share.

What this protects against is damage (a bad disk, a truncated copy, a half-synced folder), not an attacker
who can write to the folder: such a person can rewrite the manifest too. That is why the pickles themselves
are read as data only (checkpoint/safe_pickle.py). Load only checkpoints from folders you control
(docs/troubleshooting.md, "What is safe to load").
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHUNK = 1 << 20
METADATA = ".metadata"
MANIFEST_DIGEST = "manifest_sha256"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(folder: Path, prefix: str = "") -> dict[str, dict]:
    """{file name: {"bytes": size, "sha256": hex}} of the regular files directly in ``folder`` whose names
    start with ``prefix``."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name.startswith(prefix)
    }


def _canonical_digest(meta: dict) -> str:
    rest = {key: value for key, value in meta.items() if key != MANIFEST_DIGEST}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(meta: dict) -> dict:
    """Step 3: the manifest with its own checksum (``manifest_sha256``) added."""
    return {**meta, MANIFEST_DIGEST: _canonical_digest(meta)}


def manifest_changed(meta: dict) -> bool | None:
    """Step 3: True when the manifest's fields do not match its checksum (edited after sealing); None when it has none."""
    recorded = meta.get(MANIFEST_DIGEST)
    return None if recorded is None else recorded != _canonical_digest(meta)


def manifest_problems(folder: Path, files: dict) -> list[str]:
    """Step 2: every listed file present with its size, and ``.metadata``'s digest right."""
    if not isinstance(files, dict) or METADATA not in files:
        return ["its manifest lists no checksums (written by an older meshloom, or not by meshloom)"]
    problems = []
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry.get("bytes"):
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {entry.get('bytes')}")
    if not problems and sha256_of(folder / METADATA) != files[METADATA].get("sha256"):
        problems.append(f"{METADATA} does not match its checksum (damaged or replaced)")
    return problems


def digest_problems(folder: Path, files: dict, names: list[str]) -> list[str]:
    """Step 4: the files ``names`` hashed and compared. An unreadable file is a problem, never an exception, so one
    rank's bad shard reaches the others as a verdict they agree on."""
    problems = []
    for name in names:
        try:
            if sha256_of(folder / name) != files[name].get("sha256"):
                problems.append(f"{name} does not match its checksum (damaged)")
        except OSError as exc:
            problems.append(f"{name} cannot be read ({(exc.strerror or type(exc).__name__).lower()})")
    return problems
