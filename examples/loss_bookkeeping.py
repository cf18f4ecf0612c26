"""Loss and gradient bookkeeping across ranks: which mean, divided where, summed or averaged.

    torchrun --standalone --nproc-per-node 2 examples/loss_bookkeeping.py

The model must get the gradient of the mean token loss over the *global* batch. When ranks hold different
numbers of tokens (padding, variable lengths, uneven accumulation), two common recipes disagree:

- ``per-rank mean, averaged``: each rank backpropagates the mean over its own tokens and the gradients are
  averaged over ranks (what DDP does by default). That weights every rank equally, not every token.
- ``global count, summed``: each rank backpropagates (sum of its token losses) / (global token count) and
  the gradients are *summed* over ranks. This is meshloom's rule (train.py: forward_backward,
  mesh/data_parallel.py: sum_gradients_across_replicas): the scale is applied once, in the loss.

``run`` gives rank r a different number of valid tokens and compares both with one process on all tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def shared_setup(world: int):
    gen = torch.Generator().manual_seed(0)  # every rank builds the same weights and the same global batch
    weight = torch.randn(8, 5, generator=gen)
    inputs = [torch.randn(6, 8, generator=gen) for _ in range(world)]
    targets = [torch.randint(0, 5, (6,), generator=gen) for _ in range(world)]
    valid = [torch.arange(6) < 2 + 3 * r for r in range(world)]  # rank r has 2 + 3r valid tokens of 6
    return weight, inputs, targets, valid


def token_losses(weight, x, y, mask):
    return F.cross_entropy(x @ weight, y, reduction="none")[mask]


def run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    weight, inputs, targets, valid = shared_setup(world)

    one = weight.clone().requires_grad_()  # the reference: one process, every valid token of the batch
    torch.cat([token_losses(one, x, y, m) for x, y, m in zip(inputs, targets, valid, strict=True)]).mean().backward()

    mine = (inputs[rank], targets[rank], valid[rank])
    local_tokens = torch.tensor(float(valid[rank].sum()))
    global_tokens = local_tokens.clone()
    dist.all_reduce(global_tokens)  # a tiny all-reduce of the token count, before any backward

    averaged = weight.clone().requires_grad_()
    token_losses(averaged, *mine).mean().backward()
    dist.all_reduce(averaged.grad)
    averaged.grad /= world

    summed = weight.clone().requires_grad_()
    (token_losses(summed, *mine).sum() / global_tokens).backward()
    dist.all_reduce(summed.grad)

    return {
        "tokens on this rank / in the batch": (int(local_tokens), int(global_tokens)),
        "per-rank mean, averaged: max error": (averaged.grad - one.grad).abs().max().item(),
        "global count, summed: max error": (summed.grad - one.grad).abs().max().item(),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
