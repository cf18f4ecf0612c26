"""The local tensor of a possibly distributed tensor: the one definition mesh/, observers/ and models/ share.

Duck typing (``to_local``) keeps models/ free of torch.distributed: a DTensor answers with its local shard, a
plain tensor is its own local tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t.to_local()`` for a DTensor, ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
