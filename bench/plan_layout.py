"""The layout planner's command at its first name, and the one measurement beside it.

    python -m bench.plan_layout ...        # the planner: planning/plan_layout.py (every option it takes)
    python -m bench.plan_layout --ac       # measure what activation checkpointing keeps (CPU)

The planner is arithmetic and lives in the planning room (planning/plan_layout.py, with its time model
planning/step_time.py and the check against published runs planning/published_runs.py). ``--ac`` is a
measurement, so it stays a bench: it runs one block on CPU in fp32 and prints the bytes each
``training.activation_checkpoint`` mode keeps from forward for backward (``kept_bytes``).
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING

import torch

from planning.plan_layout import main as plan

if TYPE_CHECKING:
    from models.llama import ModelArgs


def kept_bytes(args: ModelArgs, batch: int, seq: int, mode: str) -> int:
    """Bytes one block keeps alive from its forward for its backward (fp32, CPU), under AC ``mode``.

    A dispatch mode records a weak reference to the storage of every op output; after forward, the storages
    still alive are what autograd (or the checkpoint) holds. Parameters, buffers and the block's output are
    left out; the block's input is counted (every mode keeps it). This sees what ``saved_tensors_hooks`` cannot:
    selective checkpointing stores the outputs it saves in its own cache, not through autograd's hooks.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from mesh.activation_checkpoint import apply_activation_checkpointing
    from mesh.materialize import materialize_weights
    from models.llama import Transformer

    class Outputs(TorchDispatchMode):  # remembers (weak ref, bytes) of every op output's storage
        refs: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for st in (t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                self.refs.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
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


def main_ac() -> None:
    from bench.activation_memory import BATCH, BENCH_ARGS, SEQ

    a = BENCH_ARGS
    bsh = 4 * BATCH * SEQ * a.dim
    print(
        f"one TransformerBlock, fp32, CPU: b={BATCH} s={SEQ} h={a.dim} H={a.hidden_dim} heads={a.n_heads}; "
        f"4·bsh = {bsh:,} bytes"
    )
    print(f"{'training.activation_checkpoint':<31} {'bytes kept':>11} {'/ 4·bsh':>8} {'/ none':>7}")
    none = None
    for mode in ("none", "selective", "full"):
        kept = kept_bytes(a, BATCH, SEQ, mode)
        none = none or kept
        print(f"{mode:<31} {kept:>11,} {kept / bsh:>8.2f} {kept / none:>7.3f}")


def main() -> None:
    if "--ac" in sys.argv[1:]:
        main_ac()
        return
    plan()


if __name__ == "__main__":
    main()
