"""The local tensor of a possibly distributed tensor: the one definition mesh/, observers/ and models/ share.

Duck typing (``to_local``) keeps models/ free of torch.distributed: a DTensor answers with its local shard, a
plain tensor is its own local tensor."""

from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t.to_local()`` for a DTensor, ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


@torch.compiler.disable
def eager_local_tensors(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``local_tensor`` of each, run uncompiled even inside a compiled region: the compiled graph then receives
    plain tensors (whose autograd reaches back to the DTensor parameters) instead of tracing ``to_local``, which
    dynamo can hand on as a DTensor after a graph break (models/moe.py: ``GroupedExperts.forward``)."""
    return tuple(local_tensor(t) for t in tensors)
