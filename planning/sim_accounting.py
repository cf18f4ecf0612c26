"""The simulation's two meters: live bytes by category at the peak, and the collectives of a step by mesh dim.

1. ``LiveBytes`` (a TorchDispatchMode) records every op output's storage once, with its bytes, and follows it
   until it dies (a ``weakref.finalize`` on the storage; torch keeps one Python object per storage, for real and
   fake tensors alike). FSDP2 frees and re-allocates its gathered weights by resizing their storages in place
   (``free_storage``/``alloc_storage``), so ``UntypedStorage.resize_`` is followed too. The running total is the
   live bytes; its maximum is the peak. When the total first drops after a new maximum, the storages alive at that
   maximum are classified: the parameters' local shards, their gradients, the optimizer's states, logits and
   everything else (activations and temporaries: saved activations, gathered weights, communication buffers). No
   allocator rounding, CUDA context or NCCL buffers: CPU-style memory.

   Logits are found by what the model returns, not by their width (a hidden state is as wide as a logits shard
   when dim = vocab / tp): ``watch_head`` tags the tensor the output head returns, and an op that reads a tagged
   tensor tags its outputs of the same shape, unless it is a matmul (which mixes the vocabulary away: the head's
   own backward). That follows the loss's copies of the logits, forward and backward (the fp32 copy, the
   log-softmax, their gradients), the bytes planning/memory_estimate.py's ``logits_bytes`` counts.

   On a CPU (``cpu_casts``) a pointwise op whose inputs differ in dtype also holds, while it runs, a copy of each
   input in the common dtype: CPU's TensorIterator casts them into temporaries before the kernel (CUDA casts inside
   it). Mixed precision makes such ops (an fp32 gradient accumulating a bf16 one); the copy can be the peak's top.
2. ``Collectives`` counts the c10d ops a step issues (they reach the dispatcher with their process group), per
   mesh dim: count, bytes this rank sends or receives (the tensor handed to the collective), and on-the-wire bytes
   for a ring (all-gather and reduce-scatter move (n-1)/n of the full buffer per rank, all-reduce twice that,
   all-to-all (n-1)/n of its input, send/recv the tensor).
3. Both meters see what a DTensor op runs, not the DTensor op: a mode runs before tensor subclasses, and while it
   handles an op it is off, so the local ops and collectives DTensor issues inside its dispatch (sharding
   propagation's redistributions, the gradient norm's reductions, the loss-parallel cross-entropy's all-reduces and
   fp32 temporaries) would pass unseen. For an op with a DTensor argument each meter returns ``NotImplemented``, as
   torch's ``CommDebugMode`` does: DTensor then runs it, and every op it issues comes back through the meters.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations_and_temporaries", "logits")


def _key(storage) -> int:
    return storage._cdata


class LiveBytes(TorchDispatchMode):
    """Live storage bytes under this mode, their peak, and the peak's split by category (module docstring, 1)."""

    def __init__(self, fake_mode=None, cpu_casts: bool = False):
        super().__init__()
        self.fake_mode = fake_mode  # the simulation's fake mode (None: real tensors)
        self.cpu_casts = cpu_casts  # count the CPU's dtype-cast temporaries (module docstring, 1)
        self.sizes: dict[int, int] = {}
        self.logits: set[int] = set()
        self.live = 0
        self.peak = 0
        self._rising = False
        self._at_peak: tuple[dict[int, int], set[int]] | None = None  # the storages at the peak, not yet classified
        self.owners = lambda: ({}, {}, {})  # () -> (param keys, grad keys, optimizer-state keys) at this moment
        self.peak_categories: dict[str, int] = dict.fromkeys(CATEGORIES, 0)

    # -- bookkeeping --
    def _add(self, t: torch.Tensor, logits: bool = False) -> None:
        if is_traceable_wrapper_subclass(t):
            # A DTensor holds no bytes of its own, its local tensor does; and that local tensor was made inside
            # DTensor's own dispatch, where this mode does not see it (a mode is off while it handles an op).
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._add(inner, logits)
            return
        if t.device.type == "meta":
            return  # the meta-device model before its weights exist, or a fake mode's inner computation
        if _is_fake(t) and t.fake_mode is not self.fake_mode:
            return  # another fake mode's tensor: DTensor's sharding propagation (global shapes), not memory
        storage = t.untyped_storage()
        key = _key(storage)
        if key in self.sizes:
            return
        nbytes = storage.nbytes()
        self.sizes[key] = nbytes
        if logits:
            self.logits.add(key)
        weakref.finalize(storage, self._free, key)
        self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak, self._rising = self.live, True

    def _shrink(self, nbytes: int) -> None:
        if self._rising and nbytes:
            # The storages alive at the peak, this one included; classified at the next op (``_classify``): a
            # storage dies inside a tensor's deallocation, where reading other tensors (the owners) corrupts memory.
            self._rising = False
            self._at_peak = (dict(self.sizes), set(self.logits))
        self.live -= nbytes

    def _free(self, key: int) -> None:
        self._shrink(self.sizes.get(key, 0))  # first: a snapshot at the peak still holds this storage
        self.sizes.pop(key, None)
        self.logits.discard(key)

    def resized(self, storage, new_nbytes: int) -> None:
        key = _key(storage)
        if key not in self.sizes:
            return
        old = self.sizes[key]
        if new_nbytes > old:
            self.sizes[key] = new_nbytes
            self._grow(new_nbytes - old)
        else:
            self._shrink(old - new_nbytes)  # first: a snapshot at the peak still holds the old size
            self.sizes[key] = new_nbytes

    def _snapshot(self) -> None:
        self._rising = False
        self._at_peak = (dict(self.sizes), set(self.logits))
        self._classify()

    def _classify(self) -> None:
        """Split the storages alive at the last peak by category (module docstring, 1), if not done yet."""
        if self._at_peak is None:
            return
        sizes, logits = self._at_peak
        self._at_peak = None
        params, grads, states = self.owners()
        split = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in sizes.items():
            if key in params:
                split["parameters"] += nbytes
            elif key in grads:
                split["gradients"] += nbytes
            elif key in states:
                split["optimizer_states"] += nbytes
            elif key in logits:
                split["logits"] += nbytes
            else:
                split["activations_and_temporaries"] += nbytes
        self.peak_categories = split

    def reset_peak(self) -> int:
        """Start a new peak from the live bytes now; returns the old peak (the build's: materialising the weights
        holds the largest parameter in full, once, at start-up)."""
        self._classify()
        old, self.peak, self._rising = self.peak, self.live, False
        return old

    def finish(self) -> dict[str, int]:
        """The peak's split by category (taken now if the peak is the current state)."""
        if self._rising:
            self._snapshot()
        self._classify()
        return self.peak_categories

    def track(self, tensors) -> None:
        """Count tensors made before the mode was entered (none in a simulation: everything is built under it)."""
        for t in tensors:
            self._add(_local(t))

    def watch_head(self, head: torch.nn.Module):
        """Tag what ``head`` (the model's output layer) returns as logits (module docstring, 1); the hook's handle."""
        return head.register_forward_hook(lambda module, args, out: self._tag(out))

    def _tag(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not _is_meta(t):
                key = _key(_local(t).untyped_storage())
                if key in self.sizes:
                    self.logits.add(key)

    def _logit_shapes(self, func, args, kwargs) -> set[tuple]:
        """The shapes of the tagged logits ``func`` reads (none for a matmul: module docstring, 1)."""
        if not self.logits or func in _MIXING:
            return set()
        return {
            tuple(a.shape)
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and not _is_meta(a) and _key(_local(a).untyped_storage()) in self.logits
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _desugars(types):
            return NotImplemented  # the subclass's own ops come back here (module docstring, 3)
        self._classify()
        out = func(*args, **(kwargs or {}))
        shapes = self._logit_shapes(func, args, kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, tuple(t.shape) in shapes)
        if self.cpu_casts and torch.Tag.pointwise in func.tags:
            self._cast_temporaries(args, kwargs)
        return out

    def _cast_temporaries(self, args, kwargs) -> None:
        """A moment's peak: the copies CPU's TensorIterator makes of the inputs not in the common dtype (module
        docstring, 1; zero-dim tensors, a few bytes, and the category rules that keep them out are left out)."""
        tensors = [
            _local(a)
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.dim() > 0 and not _is_meta(a)
        ]
        if len({t.dtype for t in tensors}) < 2:
            return
        common = tensors[0].dtype
        for t in tensors[1:]:
            common = torch.promote_types(common, t.dtype)
        nbytes = sum(t.numel() * common.itemsize for t in tensors if t.dtype != common)
        key = -1  # no storage has a negative key: the temporaries, alive for the op only
        self.sizes[key] = nbytes
        self._grow(nbytes)
        self._free(key)

    @contextlib.contextmanager
    def following_resizes(self):
        """Follow ``UntypedStorage.resize_`` (FSDP2's free and re-allocation of gathered weights) while active."""
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = original(storage, size)
            self.resized(storage, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        try:
            yield self
        finally:
            torch.UntypedStorage.resize_ = original


_aten = torch.ops.aten
# ops that mix the vocabulary dim away: what they compute from the logits is no longer logits, whatever its shape
_MIXING = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.matmul.default}


def _desugars(types) -> bool:
    """Whether an op has a tensor subclass among its arguments (a DTensor) that runs its own ops for it."""
    return any(is_traceable_wrapper_subclass_type(t) for t in types)


def _is_meta(t: torch.Tensor) -> bool:
    return _local(t).device.type == "meta"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storage_keys(tensors) -> set[int]:
    """The storage identities of ``tensors`` (DTensors by their local shard)."""
    return {_key(_local(t).untyped_storage()) for t in tensors if t is not None}


# ---- 2. collectives ----------------------------------------------------------------------------------------
# c10d op -> (kind, index of the argument holding this rank's send buffer)
_C10D = {
    "allgather_": ("all_gather", 1),
    "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
}
# functional collectives (DTensor's redistributions, EP's exchanges): the input first, the group by name last
_FUNCTIONAL = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
# on-the-wire bytes per rank for a ring, as a multiple of the send buffer, for a group of n
_WIRE = {
    "all_gather": lambda n: n - 1,  # the shard goes round: (n-1)/n of the gathered buffer
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter then all-gather
    "all_to_all": lambda n: (n - 1) / n,  # all but the own block leave the rank
    "broadcast": lambda n: 1,
    "send": lambda n: 1,
    "recv": lambda n: 1,
}


class Collectives(TorchDispatchMode):
    """Per (mesh dim, kind): count, bytes this rank hands to the collective (its send buffer; a recv: what it
    receives) and ring on-the-wire bytes, of the collectives seen while ``counting`` (module docstring, 2)."""

    def __init__(self, dim_of_group: dict[str, str]):
        super().__init__()
        self.dim_of_group = dim_of_group  # process group name -> mesh dim name
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _desugars(types):
            return NotImplemented  # the subclass's own collectives come back here (module docstring, 3)
        if self.counting:
            if func.namespace == "c10d" and func._opname in _C10D:
                kind, index = _C10D[func._opname]
                group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
                self._count(kind, _group_name(group), _group_size(group), args[index])
            elif func.namespace in ("_c10d_functional", "_c10d_functional_autograd") and func._opname in _FUNCTIONAL:
                name = args[-1] if isinstance(args[-1], str) else ""
                self._count(_FUNCTIONAL[func._opname], name, _size_of(name), args[0])
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, group_name: str, size: int, buffer) -> None:
        moved = sum(t.numel() * t.element_size() for t in tree_leaves(buffer) if isinstance(t, torch.Tensor))
        row = self.rows[(self.dim_of_group.get(group_name, "other"), kind)]
        row[0] += 1
        row[1] += moved
        row[2] += moved * _WIRE[kind](max(1, size))

    def table(self) -> list[dict]:
        return [
            {"dim": dim, "kind": kind, "count": int(c), "bytes": int(b), "wire_bytes": int(w)}
            for (dim, kind), (c, b, w) in sorted(self.rows.items())
        ]


def _process_group(group):
    """The ProcessGroup behind a c10d op's argument (the op sees it boxed as a TorchScript object)."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        return dist.ProcessGroup.unbox(group)
    return group


def _group_name(group) -> str:
    with contextlib.suppress(Exception):
        return _process_group(group).group_name
    return ""


def _group_size(group) -> int:
    with contextlib.suppress(Exception):
        return _process_group(group).size()
    return 1


def _size_of(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    with contextlib.suppress(Exception):
        return _resolve_process_group(group_name).size()
    return 1


# The flight recorder's names for element types (the process group's own record of a collective).
_RECORDED_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2, "Char": 1}
_RECORDED_BYTES |= {"Byte": 1, "Bool": 1}


def recorded_collectives(entries: list[dict], dim_of_group: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per mesh dim: count and bytes handed to the collectives of flight-recorder ``entries`` (a real run's record,
    mesh/private_api.py: flight_recorder_dump), barriers left out. By dim, not by kind: gloo runs a reduce-scatter as
    an all-reduce of the same full buffer, and records it so (``by_dim`` folds the meter's table the same way)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for e in entries:
        if e["profiling_name"].endswith("barrier"):
            continue
        moved = sum(
            math.prod(shape) * _RECORDED_BYTES[dtype]
            for shape, dtype in zip(e["input_sizes"], e["input_dtypes"], strict=True)
        )
        row = out[dim_of_group.get(e["process_group"][0], "other")]
        row["count"] += 1
        row["bytes"] += moved
    return dict(out)


def by_dim(table: list[dict]) -> dict[str, dict[str, int]]:
    """``Collectives.table()`` summed over kinds, per mesh dim (as ``recorded_collectives`` gives a real run's)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for row in table:
        out[row["dim"]]["count"] += row["count"]
        out[row["dim"]]["bytes"] += row["bytes"]
    return dict(out)
