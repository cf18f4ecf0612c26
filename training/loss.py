"""The loss every layout optimizes: the sum of token cross-entropies over the global batch, divided by the
global token count.

Each rank (each data-parallel rank, micro-batch and pipeline micro-batch) backpropagates its own
token-loss sum divided by the *global* token count, so its gradient is its exact share of the global mean:
data-parallel ranks then sum their gradients (never average them), and the scale is applied once, whatever
dp, accumulation or pipeline micro-batching is. Under TP the logits are vocab-sharded and the cross-entropy
runs inside ``loss_parallel`` (mesh/tensor_parallel.py: ``loss_context``), forward *and* backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies, in fp32 (under TP, on vocab-sharded logits via loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
