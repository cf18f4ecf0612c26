"""A checkpoint folder is data, not code: DCP's pickles read with an unpickler that can build only DCP's own types.

DCP writes two kinds of pickle: ``.metadata`` (one ``Metadata`` object: which tensor chunk lies where) and, in
the ``.distcp`` shards, ``torch.save`` records of tensors and of small Python values (the optimizer's
``lr``, ``betas``, ...). Its reader unpickles ``.metadata`` with plain ``pickle.load`` and the small values with
``torch.load(weights_only=False)``: a crafted file runs whatever it names, and the manifest's SHA-256
(checkpoint/verify.py) has no key, so whoever can write the folder can re-seal it. So:

1. ``SafeReader`` (a ``FileSystemReader``) reads ``.metadata`` with ``MetadataUnpickler``, which admits only
   the classes DCP defines for it, found by capability in the installed torch (every class of
   ``torch.distributed.checkpoint.metadata``, the dataclasses of its ``filesystem`` module such as
   ``_StorageInfo``), plus ``torch.Size``, torch's dtypes, layouts and memory formats, and ``pathlib`` paths.
   Anything else (``os.system``, ``builtins.eval``, ...) is an ``UnpicklingError`` naming the global.
2. ``SafeLoadPlanner`` (a ``DefaultLoadPlanner``) loads each small value with ``torch.load(weights_only=True)``
   (meshloom stores only ints, floats, bools, None, strings, tuples and tensors there) and hands DCP a fresh
   pickle of the result, so the bytes DCP's own loader unpickles are ones meshloom wrote from plain values.
   Tensors DCP already reads with ``weights_only=True``.

Every ``dcp.load`` and every read of ``.metadata`` in meshloom goes through ``reader`` and ``planner``
(checkpoint/manager.py, checkpoint/resume.py, checkpoint/export.py; generate.py through export).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def _admitted() -> set[tuple[str, str]]:
    """(module, name) of every global ``.metadata`` may name (step 1), read off the installed torch."""
    allowed = {
        (dcp_metadata.__name__, name)
        for name, obj in vars(dcp_metadata).items()
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
    }
    allowed |= {
        (dcp_filesystem.__name__, name)
        for name, obj in vars(dcp_filesystem).items()
        if isinstance(obj, type) and obj.__module__ == dcp_filesystem.__name__ and dataclasses.is_dataclass(obj)
    }
    allowed |= {
        ("torch", name)
        for name, obj in vars(torch).items()
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    }
    allowed |= {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    allowed |= {("builtins", name) for name in ("set", "frozenset")}
    allowed |= {("pathlib", name) for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    return allowed


ADMITTED = frozenset(_admitted())


class MetadataUnpickler(pickle.Unpickler):
    """Step 1: builds DCP's metadata types and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ADMITTED:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not one of DCP's metadata types: a .metadata that names it is not a checkpoint "
                "meshloom wrote, and it is not run"
            )
        return super().find_class(module, name)


def load_metadata(file) -> dcp_metadata.Metadata:
    """A ``Metadata`` from the open ``.metadata`` file ``file`` (step 1)."""
    metadata = MetadataUnpickler(file).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """A local DCP reader whose ``.metadata`` is read by ``load_metadata`` (step 1)."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")  # newer torch: per-rank metadata files, __<rank>.metadata
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(str(self.path)) / name, "rb") as file:
            metadata = load_metadata(file)
        if hasattr(dcp_metadata, "StorageMeta") and getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Step 2: small values loaded with ``weights_only=True``; DCP then unpickles meshloom's own pickle of them."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's own text is a page of advice to use weights_only=False; keep the line naming the global
            words = next((line for line in str(exc).splitlines() if "GLOBAL" in line), str(exc).splitlines()[0])
            raise pickle.UnpicklingError(
                f"the checkpoint's value {read_item.dest_index.fqn} is not plain data ({words.strip()}); it is not run"
            ) from None
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)


REFUSED = re.compile(r"the checkpoint's value \S+ is not plain data \(.*?\); it is not run")


def refused_value(exc: BaseException) -> str | None:
    """``SafeLoadPlanner``'s refusal inside a failed ``dcp.load`` (DCP wraps each rank's error), or None."""
    found = REFUSED.search(str(exc))
    return found.group(0) if found else None


def reader(path: str | Path) -> SafeReader:
    return SafeReader(str(path))


def planner() -> SafeLoadPlanner:
    return SafeLoadPlanner()
