"""Tied embeddings under pipeline parallelism: two copies of one weight, kept equal (Megatron's embedding group).

With ``model.tie_embeddings`` the embedding and the output head are one [vocab, dim] weight. Without a
pipeline it is one Parameter of two modules (models/llama.py: ``tie_weights``): FSDP manages it once, so it
is sharded once, and TP gives both modules the same Shard(0) DTensor (mesh/tensor_parallel.py). Its gradient
is then already the sum of the lookup's and the head's contributions; nothing here runs.

A pipeline puts the embedding on the first stage and the head on the last, usually on two different ranks:

1. **Two copies.** The last stage holds its own Parameter ``output.weight``. It starts equal to the first
   stage's ``tok_embeddings.weight`` (both take the initial value of ``tok_embeddings.weight``), and on resume
   both read the checkpoint's one ``tok_embeddings.weight`` (checkpoint/state.py, step 3). Each copy is
   parallelized like any weight of its stage, and the two get the same placements (FSDP Shard(0) over the
   data-parallel dims; under TP Shard(0) over tp, for the embedding's vocab rows and the head's vocab
   outputs alike), so the ranks at the same (dp, cp, tp) coordinate of the two stages hold the same piece.
2. **Gradient sum.** After backward, each copy's gradient holds one half of the tied weight's gradient: the
   lookup's on the first stage, the head's on the last. One all-reduce of the local gradient pieces over the
   *embedding group* (the first and the last pp rank at one (dp, cp, tp) coordinate) gives both copies the
   sum, the gradient one process computes for the one weight.
3. **V-shaped schedules** (ZBVZeroBubble, DualPipeV) place the first and the last stage on pp rank 0: both
   copies live in two stage modules of one rank (each with its own FSDP units and AdamW), so the sum is a
   local addition and the group is not needed.
4. **They stay equal.** Equal weights, equal summed gradients, the same clipping factor and the same AdamW
   arithmetic (both 2-D, so both decayed; one LR schedule) give equal weights after every step, bit for bit.
5. **Counted once.** The global gradient norm leaves the head copies out (``counted``); clipping still scales
   them by the same factor as everything else.

Where it runs (train.py): after the last micro-batch's backward, since FSDP reduces the gradients only then
under ``grad_sync=step`` and TP's Partial gradients are summed just before; and before the gradient norm,
since clipping must see the whole weight's gradient (and the optimizer the sum, not a half).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.local_tensor import local_tensor

if TYPE_CHECKING:
    from mesh.dims import Meshes


def embedding_group_ranks(world_ranks: torch.Tensor) -> list[list[int]]:
    """Global ranks of every embedding group: for each (dp_replicate, dp_shard, cp, tp) coordinate, the rank of
    the first pp coordinate and the rank of the last (``world_ranks``: the world mesh's rank tensor, pp first)."""
    pp = world_ranks.shape[0]
    flat = world_ranks.reshape(pp, -1)
    return [[int(flat[0, c]), int(flat[pp - 1, c])] for c in range(flat.shape[1])]


def copies_of(part: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The copies of the tied weight in a pipeline stage that holds one end only (none for a whole model, which
    holds one shared Parameter, or for a middle stage)."""
    if not part.args.tie_embeddings:
        return []
    if part.tok_embeddings is not None and part.output is None:
        return [("embedding", part.tok_embeddings.weight)]
    if part.output is not None and part.tok_embeddings is None:
        return [("head", part.output.weight)]
    return []


def _local_piece(param: nn.Parameter) -> torch.Tensor:
    """The local tensor of ``param``'s gradient laid out like ``param`` (a local slice, no communication)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(device_mesh=param.device_mesh, placements=param.placements)
        param.grad = grad
    return local_tensor(grad)


class TiedEmbeddings:
    """This rank's copies of the tied weight and the group that sums their gradients (module docstring)."""

    def __init__(self, copies: list[tuple[str, nn.Parameter]], group, device_type: str):
        self.copies, self.group, self.device_type = copies, group, device_type

    @classmethod
    def build(cls, parts: list[nn.Module], meshes: Meshes, timeout_s: float) -> TiedEmbeddings:
        """Collect the local copies; with pp > 2 create the embedding groups (every rank must call this: ``new_group``
        is a collective, in the same order on every rank)."""
        copies = [copy for part in parts for copy in copies_of(part)]
        pp_mesh = meshes.pp
        if not parts[0].args.tie_embeddings or pp_mesh.size() == 1:
            return cls([], None, pp_mesh.device_type)
        kinds = {kind for kind, _ in copies}
        group = None
        if pp_mesh.size() == 2:
            group = pp_mesh.get_group()
        else:
            me = dist.get_rank()
            for ranks in embedding_group_ranks(meshes.world.mesh):
                new = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), group_desc="tied_embeddings")
                group = new if me in ranks else group
        if kinds == {"embedding", "head"}:  # V-shaped: both ends on this rank, the sum is local (step 3)
            group = None
        return cls(copies, group if copies else None, pp_mesh.device_type)

    @property
    def head_copies(self) -> set[int]:
        """ids of the head copies, which the gradient norm leaves out (step 5)."""
        return {id(p) for kind, p in self.copies if kind == "head"}

    def counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without the head copies: each element of the tied weight counted once in the norm."""
        skip = self.head_copies
        return [p for p in params if id(p) not in skip]

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Give every copy the sum of the copies' gradients (steps 2 and 3): local, then over the group."""
        if not self.copies:
            return
        grads = [_local_piece(p) for _, p in self.copies]
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if self.group is not None:
            # Offloaded (FSDP CPU offload) gradients are host tensors; the group reduces device tensors.
            total = total.to(self.device_type)
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)
