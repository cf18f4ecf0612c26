"""The growing trainer, step 1: one process trains a tiny language model.

    python examples/trainer/step1_single_process.py

Every later step is this file plus one mechanism; read each as a diff:

    diff examples/trainer/step1_single_process.py examples/trainer/step2_data_parallel.py

The model is an embedding, LAYERS residual MLP blocks (x + w2(relu(w1(x)))) and an output head: a "bigram"
model, each token predicts the next from itself alone, which is all a trainer needs to be tested on. The data
is a fixed, learnable token stream. A step:

1. takes the step's GLOBAL_BATCH sequences and cuts them into MICRO_BATCHES micro-batches;
2. for each micro-batch: forward, the *sum* of its token losses divided by the tokens of the whole step, and
   backward, so that the gradients add up to the gradient of the step's mean loss (gradient accumulation);
3. one AdamW step, written out by hand so that later steps can run it on a shard.

The logged loss is the sum of the micro-batches' shares: the mean token loss of the step.
"""

from __future__ import annotations

import torch
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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)  # weight (HIDDEN, DIM)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)  # weight (DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


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


def train(model: Model, steps: int) -> list[float]:
    params = list(model.parameters())
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    data, losses = token_stream(), []
    for step in range(1, steps + 1):
        batch = data[step - 1]
        step_tokens = GLOBAL_BATCH * SEQ
        total = torch.zeros(())
        for micro in batch.chunk(MICRO_BATCHES):
            loss = loss_share(model(micro[:, :-1]), micro[:, 1:], step_tokens)
            loss.backward()  # gradients of the micro-batches add up in p.grad
            total += loss.detach()
        with torch.no_grad():
            adamw_step([p.data for p in params], [p.grad for p in params], moments, step)
        for p in params:
            p.grad = None
        losses.append(total.item())
    return losses


def run(steps: int = STEPS) -> dict:
    torch.manual_seed(0)  # the initial weights
    return {"layout": "one process", "losses": train(Model(), steps)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    result = run()
    print(result["layout"])
    for step, loss in enumerate(result["losses"], 1):
        print(f"step {step}: loss {loss:.6f}")
