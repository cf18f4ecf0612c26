"""Count the operations that make the host wait for the device (host syncs), and say where each one came from.

A GPU runs ahead of Python: the host queues kernels and moves on, and the GPU works through the queue. An
operation whose *result the host needs* (a number to print or branch on, a size to allocate) stops the host
until the queue has drained, so the host has nothing queued while it waits, and the GPU idles while the host
catches up. Those operations, which this counter sees:

- ``aten._local_scalar_dense``: a tensor read as a Python number: ``.item()``, ``int(t)``, ``float(t)``,
  ``bool(t)``, ``if t:``;
- ops whose *output size* is decided by the data: ``nonzero``, ``masked_select``, ``unique``, indexing with a
  boolean mask (a ``nonzero`` inside), ``bincount`` (its length is max + 1), ``repeat_interleave`` with tensor
  repeats and no ``output_size``;
- copies to the host: ``.tolist()``, ``.numpy()``, ``.cpu()``.

``HostSyncCounter`` is a ``TorchDispatchMode`` (every aten op, autograd's backward included) with a
``TorchFunctionMode`` beside it (``.tolist()`` and ``.numpy()`` read a CPU tensor's memory without any aten
op). Each sync is recorded with the innermost frame of meshloom's own code on the stack, so a count says
where it is: ``train.py:train``, ``mesh/expert_parallel.py:_dispatch``; a sync inside torch is charged to
the meshloom line that called into torch.

What a CPU run cannot tell: on a CPU every tensor is a host tensor, so the counter counts an op even where, on
a GPU, its tensor would live on the host and cost no device sync (torch's AdamW keeps its step counter on the
host, for example). The table that reads the counts (bench/host_syncs.py) says which is which. And a copy to
the host written as ``.to(device)`` with a CPU device is invisible here; meshloom's step has none.
"""

from __future__ import annotations

import collections
import inspect
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
_aten = torch.ops.aten

# aten ops that always need a value from the device on the host
SCALAR_READS = {_aten._local_scalar_dense.default}
# aten ops whose output size the data decides
DATA_SIZED = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
# Python-level tensor methods that copy to the host (no aten op shows it on a CPU tensor)
HOST_COPIES = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}


def meshloom_site() -> str:
    """``path:function`` of the innermost frame of meshloom's own code (not this file, not tests)."""
    frame = inspect.currentframe()
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and path.name != "host_syncs.py" and "tests" not in path.parts:
            return f"{path.relative_to(ROOT).as_posix()}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside meshloom"


def sync_name(func, args, kwargs) -> str | None:
    """The name under which aten op ``func`` counts as a host sync, or None if it does not wait for the device."""
    if func in SCALAR_READS or func in DATA_SIZED:
        return func.__name__.split(".")[0]
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return "boolean index"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_name(func, args, kwargs)
        if name is not None:
            self.counts[(meshloom_site(), name)] += 1
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES:
            self.counts[(meshloom_site(), HOST_COPIES[func])] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.counts``: {(site, op): count} (module docstring)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._modes = (_Function(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def total(self) -> int:
        return sum(self.counts.values())
