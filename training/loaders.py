"""The one loader factory: a split's ``GlobalBatchLoader`` for this rank of the layout (train and validation).

Each data-parallel rank reads its slice of the same global batches (data/loader.py); under context
parallelism the cp ranks of one dp rank read the same windows and each keeps its chunks of every sequence
(mesh/context_parallel.py: ``load_balanced_positions``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from data.loader import GlobalBatchLoader
from mesh.context_parallel import load_balanced_positions

if TYPE_CHECKING:
    import torch

    from mesh.dims import Meshes
    from planning.plan import LayoutPlan


def batch_loader(tokens, plan: LayoutPlan, meshes: Meshes, document_starts=None) -> GlobalBatchLoader:
    """``tokens`` (one split of data/dataset.py's ``Splits``) cut into this rank's micro-batches; with
    ``document_starts``, each micro-batch's document positions too (data/loader.py)."""
    dims = plan.dims
    positions = load_balanced_positions(plan.seq_len, meshes.cp.get_local_rank(), dims.cp) if dims.cp > 1 else None
    return GlobalBatchLoader(
        tokens,
        seq_len=plan.seq_len,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        dp_rank=meshes.dp.get_local_rank(),
        dp_size=dims.dp,
        positions=positions,
        vocab_size=plan.model.vocab_size,  # every step's ids checked on the host (data/loader.py)
        document_starts=document_starts,
    )


def run_loaders(data, plan: LayoutPlan, meshes: Meshes, allow_empty_steps: bool):
    """The training loader and the validation loader (None without a validation split) of ``data``
    (data/dataset.py: ``Splits``). A training step with no trained token stops the run unless
    ``allow_empty_steps``; a validation batch may have none (its divisor is the sum over eval.steps batches)."""
    train = batch_loader(data.train, plan, meshes, data.train_documents)
    train.allow_empty_steps = allow_empty_steps
    if data.val is None:
        return train, None
    val = batch_loader(data.val, plan, meshes, data.val_documents)
    val.allow_empty_steps = True
    return train, val


def to_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """A micro-batch's tensors on ``device`` without a host wait: on CUDA each is copied into pinned host memory
    and from there with ``non_blocking`` (the copy is queued on the stream; from pageable memory the host would
    wait for it). On CPU the same call, where the copy is the tensor itself (CPU-only torch cannot pin)."""
    pin = device.type == "cuda"
    return tuple((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in tensors)
