"""The growing trainer, step 11: a mixture of experts, its tokens dispatched and combined by all-to-all.

    torchrun --standalone --nproc-per-node 2 examples/trainer/step11_expert_all_to_all.py --tp 2
    diff examples/trainer/step10_ring_attention.py examples/trainer/step11_expert_all_to_all.py

Each block gains a second feed-forward sublayer, y + moe(y), with --experts small MLPs (EXPERTS = 4 unless
told) of which every token uses one (top-1). The experts are split over the tp ranks, which since step 7 hold *different* tokens (their
slices of the sequence) between the blocks: expert parallelism on the tp dim (meshloom puts it on the dp
ranks instead; docs/expert_parallel.md, sections 2 and 6). For each block and micro-batch:

1. route: a token's scores are its first `experts` features (the router has no weights, so nothing in a block
   is replicated over tp); it goes to the expert of the largest softmax score, weighted by that score;
2. sort the tokens by expert (so by the rank that owns it), exchange the counts (``all_to_all_single`` of
   a tp x experts/tp table: how many tokens each rank will receive for each of its experts);
3. dispatch: ``all_to_all_single`` with those counts as the splits; each rank runs its experts on what it
   received, grouped by sender and then by expert; combine: the reverse all-to-all brings every output home
   (the backward of each all-to-all is the other one);
4. unsort, scale by the router's weight, add to the residual stream.

Every tp rank keeps experts/tp whole experts (``shard_for_tensor_parallel``): their gradients are whole
over tp, and summed over dp and cp by the sharded state as before. With --experts 0 a block is step 10's
block again (no expert weights are drawn between one block's w2 and the next one's w1): the losses are step
10's bit for bit, with tp 1 or 2. With experts the model changes: the mixture is checked against each token
run through its expert alone, and with --tp 2 the losses equal --tp 1's within fp32 round-off (an expert's
weight gradient adds the tokens of both ranks in another order; tests/test_trainer_steps.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN, LAYERS, SEQ = 64, 32, 64, 4, 16
EXPERTS, EXPERT_HIDDEN = 4, 32  # the mixture of experts of every block (top-1 routing)
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


def slices(x: torch.Tensor, group) -> list[torch.Tensor]:
    return [s.contiguous() for s in x.chunk(dist.get_world_size(group), dim=1)]  # dim 1: the sequence


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    parts = slices(x, group)
    mine = torch.empty_like(parts[0])
    dist.reduce_scatter(mine, parts, group=group)  # my slice, summed over the tp ranks
    return mine


class GatherSequence(torch.autograd.Function):  # before w1 (reduce) and before the head (no reduce)
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.reduce = group, reduce
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce:  # every rank used the whole sequence and holds a partial gradient of it: sum my slice
            return reduce_scatter_sequence(grad, ctx.group), None, None
        return slices(grad, ctx.group)[dist.get_rank(ctx.group)], None, None  # the same on every rank: my slice


class ScatterSequence(torch.autograd.Function):  # after w2 (reduce) and after the embedding (no reduce)
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, reduce: bool) -> torch.Tensor:
        ctx.group = group
        if reduce:  # the ranks' outputs are partial sums: sum my slice of them
            return reduce_scatter_sequence(x, group)
        return slices(x, group)[dist.get_rank(group)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_sequence(grad, ctx.group), None, None  # the whole sequence's gradient


def shift(x: torch.Tensor, group, direction: int) -> torch.Tensor:
    """Send x to the ring's next rank (direction 1; -1: the previous one) and receive from the other side."""
    ranks, r = dist.get_process_group_ranks(group), dist.get_rank(group)
    out = torch.empty_like(x)
    request = dist.isend(x.contiguous(), ranks[(r + direction) % len(ranks)], group=group)
    dist.recv(out, ranks[(r - direction) % len(ranks)], group=group)
    request.wait()
    return out


class RingShift(torch.autograd.Function):  # K/V one step round the cp ring; the gradient goes back
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return shift(grad, ctx.group, -1), None


def ring_attention(h: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this cp rank's positions (q = k = v = h) over the sequence's positions up to them."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q, kv, out, lse = h / DIM**0.5, h, None, None
    for i in range(n):
        source = (r - i) % n  # the cp rank whose positions kv holds now
        if source <= r:  # a later chunk is masked entirely
            scores = q @ kv.transpose(1, 2)
            if source == r:  # the diagonal block: causal inside
                scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            block_lse, block_out = scores.logsumexp(-1, keepdim=True), torch.softmax(scores, -1) @ kv
            if out is None:
                out, lse = block_out, block_lse
            else:  # merge by the log-sum-exp: the softmax over every key seen so far
                merged = torch.logaddexp(lse, block_lse)
                out = (lse - merged).exp() * out + (block_lse - merged).exp() * block_out
                lse = merged
        if i < n - 1:
            kv = RingShift.apply(kv, group)  # every rank passes its chunk on, used or not
    # Rank c never reads the chunks of later ranks, but each shift's backward is a send and a receive that the
    # neighbours wait for: tying the last chunk in with a zero weight makes every rank run all of them.
    return out + 0.0 * kv.sum()


class AllToAll(torch.autograd.Function):  # rows to the ranks by the given counts; backward: the reverse
    @staticmethod
    def forward(ctx, x: torch.Tensor, received: list, sent: list, group) -> torch.Tensor:
        ctx.splits, ctx.group = (received, sent), group
        out = x.new_empty(sum(received), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received, sent = ctx.splits
        return AllToAll.forward(ctx, grad, sent, received, ctx.group), None, None, None


def moe(y: torch.Tensor, block: Block) -> torch.Tensor:
    """Top-1 mixture of experts over this rank's tokens, the experts split over the ranks of block.tp_group."""
    group, tokens = block.tp_group, y.flatten(0, 1)
    ranks, local = dist.get_world_size(group), block.experts_in.shape[0]  # local: the experts I keep
    experts = ranks * local
    weight, expert = torch.softmax(tokens[:, :experts], -1).max(-1)  # route: top-1 of the first `experts` features
    order = expert.argsort(stable=True)  # grouped by expert, so by the rank that keeps it
    counts = torch.bincount(expert, minlength=experts).view(ranks, local)  # rows: the ranks I send to
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)  # row j: what rank j sends to each of my experts
    sent, received = counts.sum(1).tolist(), incoming.sum(1).tolist()
    mine = AllToAll.apply(tokens[order], received, sent, group)  # dispatch
    outputs = [  # by sender, then by expert: run expert e on its rows
        torch.relu(rows @ block.experts_in[e]) @ block.experts_out[e]
        for rows, e in zip(mine.split(incoming.flatten().tolist()), list(range(local)) * ranks, strict=True)
    ]
    back = AllToAll.apply(torch.cat(outputs), sent, received, group)  # combine
    out = torch.empty_like(back).index_copy(0, order, back)  # unsort
    return (weight.unsqueeze(-1) * out).view_as(y)


class Block(nn.Module):
    def __init__(self, experts: int = EXPERTS):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)  # weight (HIDDEN, DIM)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)  # weight (DIM, HIDDEN)
        self.experts = experts  # 0: no mixture, step 10's block (and step 10's draws from the generator)
        if experts:
            self.experts_in = nn.Parameter(torch.randn(experts, DIM, EXPERT_HIDDEN) / DIM**0.5)
            self.experts_out = nn.Parameter(torch.randn(experts, EXPERT_HIDDEN, DIM) / EXPERT_HIDDEN**0.5)
        self.tp_group, self.cp_group, self.attention = None, None, True  # set by shard_for_tensor_parallel and run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.compute, x, use_reentrant=False)  # keep x only; compute again in backward

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        h = GatherSequence.apply(x, self.tp_group, True)  # this cp rank's positions, whole over tp
        if self.attention:
            h = h + ring_attention(h, self.cp_group)
        hidden = torch.relu(self.w1(h))
        y = x + ScatterSequence.apply(self.w2(hidden), self.tp_group, True)
        return y + moe(y, self) if self.experts else y


class Model(nn.Module):
    def __init__(self, experts: int = EXPERTS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(experts) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tp_group = None  # set by shard_for_tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:  # first stage: tokens in
            x = ScatterSequence.apply(self.embed(x), self.tp_group, False)  # keep my slice of the sequence
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        return self.head(GatherSequence.apply(x, self.tp_group, False))  # last stage: the whole sequence's logits


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


def keep_my_stage(model: Model, group, ranks: list[int]) -> None:
    """Keep this pipeline rank's LAYERS/pp consecutive blocks; the embedding on the first, the head on the last."""
    pp, s = len(ranks), ranks.index(dist.get_rank())
    per_stage = LAYERS // pp
    model.blocks = nn.ModuleList(list(model.blocks)[s * per_stage : (s + 1) * per_stage])
    if s > 0:
        model.embed = None
    if s < pp - 1:
        model.head = None


def one_f_one_b(model: Model, micro_batches: tuple, step_tokens: int, group, ranks: list[int]) -> torch.Tensor:
    """One 1F1B step of this rank's stage: the sum of the micro-batch loss shares (last stage; 0 elsewhere)."""
    s, p, m = ranks.index(dist.get_rank()), len(ranks), len(micro_batches)
    positions = SEQ // (dist.get_world_size(model.tp_group) * dist.get_world_size(model.blocks[0].cp_group))
    first, last = s == 0, s == p - 1
    saved, sends, total = {}, [], torch.zeros(())

    def forward(i: int) -> None:
        inputs, targets = micro_batches[i]
        if first:
            x = inputs
        else:
            x = torch.empty(len(inputs), positions, DIM)  # my slice of my cp chunk
            dist.recv(x, ranks[s - 1])  # the previous stage's output
            x.requires_grad_()
        y = model(x)
        if last:
            y = loss_share(y, targets, step_tokens)
            total.add_(y.detach())
        else:
            sends.append(dist.isend(y.detach(), ranks[s + 1]))
        saved[i] = (x, y)

    def backward(i: int) -> None:
        x, y = saved.pop(i)  # this micro-batch's activations are freed after its backward
        if last:
            y.backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, ranks[s + 1])  # the gradient of my output, from the next stage
            y.backward(grad)
        if not first:
            sends.append(dist.isend(x.grad, ranks[s - 1]))

    warmup = min(p - 1 - s, m)
    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    for request in sends:
        request.wait()
    return total


def shard_for_tensor_parallel(model: Model, group, ranks: list[int]) -> None:
    """Keep this tp rank's rows of every w1, the matching columns of every w2, and experts/tp experts."""
    tp, t = len(ranks), ranks.index(dist.get_rank())
    for block in model.blocks:
        block.w1.weight = nn.Parameter(block.w1.weight.detach().chunk(tp, dim=0)[t].clone())
        block.w2.weight = nn.Parameter(block.w2.weight.detach().chunk(tp, dim=1)[t].clone())
        if block.experts:
            block.experts_in = nn.Parameter(block.experts_in.detach().chunk(tp)[t].clone())
            block.experts_out = nn.Parameter(block.experts_out.detach().chunk(tp)[t].clone())
        block.tp_group = group
    model.tp_group = group


class ShardedState:
    """One unit's slice of its flat parameters (the master copy), its AdamW moments and its flat gradient."""

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
        self.gathered, self.gathering, self.reducing = False, None, None
        self.grad, self.pending, self.backwards = torch.zeros(self.size * self.dp), len(params), 0
        self.free_parameters()

    def gather_parameters(self) -> None:  # issue the all-gather; wait_parameters installs it
        if not self.gathered and self.gathering is None:
            self.full = torch.empty(self.size * self.dp)
            self.gathering = dist.all_gather_into_tensor(self.full, self.shard, group=self.group, async_op=True)

    def wait_parameters(self) -> None:
        self.gather_parameters()  # nobody prefetched it: issue it now
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering, self.gathered, offset = None, True, 0
            for p, shape in zip(self.params, self.shapes, strict=True):
                p.data = self.full[offset : offset + shape.numel()].view(shape)  # views of the gathered buffer
                offset += shape.numel()

    def add_gradient(self, p: torch.Tensor) -> None:  # a post-accumulate-grad hook of each of my parameters
        i = next(i for i, q in enumerate(self.params) if q is p)
        offset = sum(shape.numel() for shape in self.shapes[:i])
        self.grad[offset : offset + p.numel()] += p.grad.flatten()  # the micro-batches add up in step 5's order
        p.grad, self.pending = None, self.pending - 1
        if self.pending == 0:  # the unit's backward is done
            self.free_parameters()
            self.pending, self.backwards = len(self.params), self.backwards + 1
            if self.backwards == MICRO_BATCHES:  # the step's last micro-batch: sum over dp while backward goes on
                self.grad_shard = torch.empty(self.size)
                self.reducing = dist.reduce_scatter_tensor(self.grad_shard, self.grad, group=self.group, async_op=True)
                self.grad, self.backwards = torch.zeros(self.size * self.dp), 0  # the next step's (the old one is sent)

    def wait_gradient(self) -> torch.Tensor:
        self.reducing.wait()
        return self.grad_shard

    def free_parameters(self) -> None:
        for p in self.params:  # outside its forward and backward only the shard exists
            p.data = torch.empty(0)
        self.gathered = False


def shard_per_unit(model: Model, group, ranks: list[int]) -> list[ShardedState]:
    """One ShardedState per unit, and the hooks that gather each unit only while it runs."""
    units = [u for u in (model.embed, *model.blocks, model.head) if u is not None]
    states = [ShardedState(list(u.parameters()), group, ranks) for u in units]

    def before_forward(i: int) -> None:
        states[i].wait_parameters()
        if i + 1 < len(states):
            states[i + 1].gather_parameters()  # prefetch: the next unit's all-gather runs while this one computes

    def after_forward(i: int, output: torch.Tensor) -> None:
        states[i].free_parameters()
        if output.requires_grad:
            output.register_hook(lambda grad: before_backward(i))

    def before_backward(i: int) -> None:
        states[i].wait_parameters()
        if i > 0:
            states[i - 1].gather_parameters()  # prefetch: backward reaches the unit before next

    for i, (unit, state) in enumerate(zip(units, states, strict=True)):
        state.split_over_tp = isinstance(unit, Block)  # the embedding and the head are whole on every tp rank
        unit.register_forward_pre_hook(lambda module, args, i=i: before_forward(i))
        unit.register_forward_hook(lambda module, args, output, i=i: after_forward(i, output))
        for p in unit.parameters():
            p.register_post_accumulate_grad_hook(state.add_gradient)
    return states


def clip_gradients(states: list, grads: list, groups: dict, max_norm: float) -> torch.Tensor:
    """Scale every gradient shard by min(1, max_norm / norm), norm over the whole model's gradient; return it."""
    split = sum((g.square().sum() for s, g in zip(states, grads, strict=True) if s.split_over_tp), torch.zeros(()))
    dist.all_reduce(split, group=groups["tp"][0])  # the tp ranks hold different slices of the blocks
    whole = sum((g.square().sum() for s, g in zip(states, grads, strict=True) if not s.split_over_tp), split)
    dist.all_reduce(whole, group=groups["dp_cp"][0])  # different shards
    dist.all_reduce(whole, group=groups["pp"][0])  # different stages
    norm = whole.sqrt()
    for g in grads:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))  # factor 1 when the norm is under the limit
    return norm


def train(model: Model, groups: dict, steps: int, max_norm: float) -> tuple[list[float], list[float]]:
    dp_group, dp_ranks = groups["dp"]
    dp, dp_rank = len(dp_ranks), dp_ranks.index(dist.get_rank())
    cp_ranks = groups["cp"][1]
    cp, c = len(cp_ranks), cp_ranks.index(dist.get_rank())
    states = shard_per_unit(model, *groups["dp_cp"])  # over cp the gradients are partial too: shard over both
    data, losses, norms = token_stream(), [], []
    for step in range(1, steps + 1):
        batch = data[step - 1].chunk(dp)[dp_rank]  # this data-parallel rank's sequences
        step_tokens = GLOBAL_BATCH * SEQ
        total = torch.zeros(())
        inputs, targets = batch[:, :-1].chunk(cp, dim=1)[c], batch[:, 1:].chunk(cp, dim=1)[c]  # my positions
        micro_batches = list(zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True))
        total += one_f_one_b(model, micro_batches, step_tokens, *groups["pp"])
        grad_shards = [state.wait_gradient() for state in states]  # reduce-scattered during the backward
        norms.append(clip_gradients(states, grad_shards, groups, max_norm).item())
        with torch.no_grad():
            adamw_step([s.shard for s in states], grad_shards, [m for s in states for m in s.moments], step)
        dist.all_reduce(total, group=groups["dp_cp"][0])
        dist.all_reduce(total, group=groups["pp"][0])  # only the last stage has a loss; the others add 0
        losses.append(total.item())
    return losses, norms


def run(
    steps: int = STEPS,
    tp: int = 1,
    pp: int = 1,
    max_norm: float = float("inf"),
    cp: int = 1,
    attention: bool = True,
    experts: int = EXPERTS,
) -> dict:
    if experts % tp or experts > DIM:  # each tp rank keeps experts/tp; a token's scores are its first features
        raise ValueError(f"experts={experts}: give a multiple of tp={tp} no larger than DIM={DIM}, or 0")
    torch.manual_seed(0)  # the initial weights: the same on every rank
    dims = {"pp": pp, "dp": dist.get_world_size() // (pp * cp * tp), "cp": cp, "tp": tp}
    groups = rank_grid(dims)
    groups["dp_cp"] = rank_grid({"pp": pp, "dp_cp": dims["dp"] * cp, "tp": tp})["dp_cp"]  # dp and cp as one dim
    model = Model(experts)
    keep_my_stage(model, *groups["pp"])
    shard_for_tensor_parallel(model, *groups["tp"])
    for block in model.blocks:
        block.cp_group, block.attention = groups["cp"][0], attention
    losses, norms = train(model, groups, steps, max_norm)
    return {"layout": dims, "losses": losses, "grad_norms": norms}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from torchrun
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--max-norm", type=float, default=float("inf"))
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--attention", choices=["on", "off"], default="on", help="off: step 9's model")
    parser.add_argument("--experts", type=int, default=EXPERTS, help="0: step 10's model")
    args = parser.parse_args()
    result = run(STEPS, args.tp, args.pp, args.max_norm, args.cp, args.attention == "on", args.experts)
    if dist.get_rank() == 0:
        print(result["layout"])
        for step, (loss, norm) in enumerate(zip(result["losses"], result["grad_norms"], strict=True), 1):
            print(f"step {step}: loss {loss:.6f}, gradient norm {norm:.6f}")
    dist.destroy_process_group()
