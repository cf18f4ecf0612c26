"""The growing trainer, step 4: tensor parallelism (Megatron's column- and row-parallel MLP, f and g).

    torchrun --standalone --nproc-per-node 2 examples/trainer/step4_tensor_parallel.py --tp 2
    diff examples/trainer/step3_sharded_state.py examples/trainer/step4_tensor_parallel.py

The grid gains a second dim, tp, innermost (consecutive ranks: one node on a GPU cluster). The tp ranks of a
dp rank read the same sequences; each holds a slice of every block:

1. w1 by rows of its stored weight (output features: *column-parallel*) and w2 by the matching columns
   (input features: *row-parallel*), cut from the full weights every rank built from the seed;
2. ``f`` before w1: identity forward, all-reduce backward (every rank used all of x, and holds only its part
   of x's gradient); ``g`` after w2: all-reduce forward (the ranks' outputs are partial sums), identity
   backward. One all-reduce each way per block (docs/tensor_parallel.md, section 4);
3. the embedding and the head stay whole on every tp rank; they see the same activations and gradients on
   every tp rank, so their gradients need no reduction over tp;
4. the sharded state of step 3 runs over dp as before, on whatever this rank's model holds.

With --tp 1 this is step 3 exactly; with --tp 2 the losses equal step 3's up to fp32 round-off (w2's sum
over the hidden features is split in two and added by the all-reduce; tests/test_trainer_steps.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, LAYERS, SEQ = 64, 32, 64, 4, 16
GLOBAL_BATCH, MICRO_BATCHES, STEPS = 8, 2, 6  # sequences per optimizer step; micro-batches per step
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1


def token_stream() -> torch.Tensor:
    """STEPS x GLOBAL_BATCH windows of SEQ + 1 tokens: mostly next = (5 token + 3) mod VOCAB, 20% random."""
    gen = torch.Generator().manual_seed(1)
    n = STEPS * GLOBAL_BATCH * (SEQ + 1)
    noise, keep = torch.randint(VOCAB, (n,), generator=gen), torch.rand(n, generator=gen) < 0.8
    tokens = [0]
    for i in range(1, n):
        tokens.append((5 * tokens[-1] + 3) % VOCAB if keep[i] else int(noise[i]))
    return torch.tensor(tokens).view(STEPS, GLOBAL_BATCH, SEQ + 1)


class CopyToTensorParallel(torch.autograd.Function):  # Megatron's f
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # sum the ranks' partial input gradients
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):  # Megatron's g
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)  # sum the partial outputs
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None  # every rank already holds the full output gradient


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)  # weight (HIDDEN, DIM)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)  # weight (DIM, HIDDEN)
        self.tp_group = None  # set by shard_for_tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.w1(CopyToTensorParallel.apply(x, self.tp_group)))
        return x + ReduceFromTensorParallel.apply(self.w2(hidden), self.tp_group)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_share(logits: torch.Tensor, targets: torch.Tensor, step_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's mean loss: its token-loss sum over the step's token count."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / step_tokens


def adamw_step(params: list, grads: list, moments: list, step: int) -> None:
    """AdamW, element by element (decoupled weight decay, bias-corrected moments), in place."""
    (b1, b2), lr = BETAS, LR
    for p, g, (m, v) in zip(params, grads, moments, strict=True):
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + EPS)
        p.mul_(1 - lr * WEIGHT_DECAY).sub_(lr * update)


def rank_grid(dims: dict[str, int]) -> dict[str, tuple]:
    """This rank's (group, ranks) along each dim of a row-major grid of the world (last dim innermost).

    Every rank creates every group, in the same order: ``new_group`` is itself a collective call."""
    names, shape = list(dims), list(dims.values())
    grid = torch.arange(dist.get_world_size()).view(shape)
    mine = {}
    for i, name in enumerate(names):
        for ranks in grid.movedim(i, -1).reshape(-1, shape[i]).tolist():
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[name] = (group, ranks)
    return mine


def shard_for_tensor_parallel(model: Model, group, ranks: list[int]) -> None:
    """Keep this tp rank's rows of every w1 and the matching columns of every w2."""
    tp, t = len(ranks), ranks.index(dist.get_rank())
    for block in model.blocks:
        block.w1.weight = nn.Parameter(block.w1.weight.detach().chunk(tp, dim=0)[t].clone())
        block.w2.weight = nn.Parameter(block.w2.weight.detach().chunk(tp, dim=1)[t].clone())
        block.tp_group = group


class ShardedState:
    """This rank's slice of the flat parameters (the master copy) and its AdamW moments."""

    def __init__(self, params: list, group, ranks: list[int]):
        self.params, self.group = params, group
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        self.dp, r = len(ranks), ranks.index(dist.get_rank())
        self.size = -(-self.numel // self.dp)  # elements per shard: ceil(numel / dp), the last one padded
        flat = torch.zeros(self.size * self.dp)
        flat[: self.numel] = torch.cat([p.detach().flatten() for p in params])
        self.shard = flat[r * self.size : (r + 1) * self.size].clone()
        self.moments = [(torch.zeros_like(self.shard), torch.zeros_like(self.shard))]
        self.free_parameters()

    def gather_parameters(self) -> None:
        full = torch.empty(self.size * self.dp)
        dist.all_gather_into_tensor(full, self.shard, group=self.group)
        offset = 0
        for p, shape in zip(self.params, self.shapes, strict=True):
            p.data = full[offset : offset + shape.numel()].view(shape)  # views of the one gathered buffer
            offset += shape.numel()

    def reduce_gradients(self) -> torch.Tensor:
        flat = torch.zeros(self.size * self.dp)
        flat[: self.numel] = torch.cat([p.grad.flatten() for p in self.params])
        grad_shard = torch.empty(self.size)
        dist.reduce_scatter_tensor(grad_shard, flat, group=self.group)  # the sum of my slice only
        return grad_shard

    def free_parameters(self) -> None:
        for p in self.params:  # between steps only the shard exists
            p.data, p.grad = torch.empty(0), None


def train(model: Model, groups: dict, steps: int) -> list[float]:
    dp_group, dp_ranks = groups["dp"]
    dp, dp_rank = len(dp_ranks), dp_ranks.index(dist.get_rank())
    params = list(model.parameters())
    sharded = ShardedState(params, dp_group, dp_ranks)
    data, losses = token_stream(), []
    for step in range(1, steps + 1):
        batch = data[step - 1].chunk(dp)[dp_rank]  # this data-parallel rank's sequences
        step_tokens = GLOBAL_BATCH * SEQ
        total = torch.zeros(())
        sharded.gather_parameters()
        for micro in batch.chunk(MICRO_BATCHES):
            loss = loss_share(model(micro[:, :-1]), micro[:, 1:], step_tokens)
            loss.backward()  # gradients of the micro-batches add up in p.grad
            total += loss.detach()
        grad_shard = sharded.reduce_gradients()  # each rank holds its share of the step's gradient: sum the shares
        with torch.no_grad():
            adamw_step([sharded.shard], [grad_shard], sharded.moments, step)
        sharded.free_parameters()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item())
    return losses


def run(steps: int = STEPS, tp: int = 1) -> dict:
    torch.manual_seed(0)  # the initial weights: the same on every rank
    dims = {"dp": dist.get_world_size() // tp, "tp": tp}
    groups = rank_grid(dims)
    model = Model()
    shard_for_tensor_parallel(model, *groups["tp"])
    return {"layout": dims, "losses": train(model, groups, steps)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from torchrun
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    result = run(tp=parser.parse_args().tp)
    if dist.get_rank() == 0:
        print(result["layout"])
        for step, loss in enumerate(result["losses"], 1):
            print(f"step {step}: loss {loss:.6f}")
    dist.destroy_process_group()
