"""The loss every layout optimizes: the sum of token cross-entropies over the global batch, divided by the
global token count.

Each rank (each data-parallel rank, micro-batch and pipeline micro-batch) backpropagates its own
token-loss sum divided by the *global* token count, so its gradient is its exact share of the global mean:
data-parallel ranks then sum their gradients (never average them), and the scale is applied once, whatever
dp, accumulation or pipeline micro-batching is. Under TP the logits are vocab-sharded and the cross-entropy
runs inside ``loss_parallel`` (mesh/tensor_parallel.py: ``loss_context``), forward *and* backward.

With a loss mask (chat data) the masked targets are -100, the ignored index, so they add nothing to the sum,
and the divisor is the step's global number of *trained* targets (data/loader.py: ``trained_tokens``), not
the constant ``global_batch x seq_len``: dividing each micro-batch or rank by its own count instead weights
its tokens by how few they are (docs/00_foundations.md, "loss across ranks", measures the error). A step
with no trained target at all divides by 1: its loss and gradient are 0, never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies, in fp32 (under TP, on vocab-sharded logits via loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


class LossDivisor:
    """The divisor of the step's loss, read by the pipeline schedule's loss function (built once, before any
    step) and set by each step (training/step.py: ``forward_backward``)."""

    def __init__(self, tokens: int):
        self.tokens = tokens


def divisor(trained_tokens: int) -> int:
    """The step's loss divisor from its global count of trained targets: at least 1 (a step with none has loss 0)."""
    return max(int(trained_tokens), 1)
