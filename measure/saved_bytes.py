"""What a block's forward keeps alive for its backward, counted two ways.

1. ``SavedBytes``: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an op saves for backward;
   the bytes of their distinct storages are added up:

   - a tensor saved several times, or through views of one storage, counts once (keyed by the storage's
     data_ptr) and with its whole storage, since that is what stays alive;
   - a DTensor counts by its local tensor (this rank's bytes);
   - the storages named in ``exclude`` (parameters and buffers: model state, not activations) are left out.

2. ``kept_bytes``: under activation checkpointing the hooks do not see everything (selective checkpointing
   keeps the outputs it saves in its own cache), so a dispatch mode records a weak reference to every op
   output's storage, and after forward the storages still alive are what is kept.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.llama import ModelArgs


class SavedBytes:
    """Count the bytes of the distinct storages that autograd saves inside the ``with`` block."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude  # storage data_ptrs of parameters and buffers
        self.storages: dict[int, tuple[tuple[int, ...], int]] = {}  # data_ptr -> (shape first seen, nbytes)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # to_local() outside autograd: no graph node, nothing saved
            local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr not in self.storages:
            self.storages[ptr] = (tuple(local.shape), storage.nbytes())
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes in self.storages.values())


def storage_ptr(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()


def remember(refs: dict, storage) -> None:
    """Record ``storage`` under its address, unless a live storage is recorded there already. The allocator
    reuses the address of a freed storage, so a dead entry must give way: keeping it would leave the new storage
    uncounted (a count that moved from run to run with the allocator's choices)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    known = refs.get(storage._cdata)
    if known is None or known[0].expired():
        refs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())


def kept_bytes(args: ModelArgs, batch: int, seq: int, mode: str) -> int:
    """Bytes one block keeps alive from its forward for its backward (fp32, CPU), under AC ``mode``.

    A dispatch mode records a weak reference to the storage of every op output; after forward, the storages
    still alive are what autograd (or the checkpoint) holds. Parameters, buffers and the block's output are
    left out; the block's input is counted (every mode keeps it). This sees what ``saved_tensors_hooks`` cannot:
    selective checkpointing stores the outputs it saves in its own cache, not through autograd's hooks.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from mesh.activation_checkpoint import apply_activation_checkpointing
    from mesh.materialize import materialize_weights
    from models.llama import Transformer

    class Outputs(TorchDispatchMode):  # remembers (weak ref, bytes) of every op output's storage
        def __init__(self):
            super().__init__()
            self.refs = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for st in (t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                remember(self.refs, st)
            return out

    with torch.device("meta"):
        model = Transformer(args)
    apply_activation_checkpointing(model, mode)
    materialize_weights(model, torch.device("cpu"), seed=0)
    x = torch.randn(batch, seq, args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with Outputs() as rec:
        out = model.layers["0"](x, model.rope_cos, model.rope_sin)
    gc.collect()
    skip = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), out)}
    kept = sum(n for key, (ref, n) in rec.refs.items() if not ref.expired() and key not in skip)
    out.sum().backward()  # what was kept really was enough for backward
    return kept + x.untyped_storage().nbytes()
