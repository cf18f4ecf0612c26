"""Bytes per logit around the loss: a bf16 output head, then train.py's fp32 cross-entropy (one process, CPU).

    python -m measure.logits_memory        # docs/combining.md, section 6: the planner's 12 bytes per logit

planning/memory_estimate.py charges the last pipeline stage 12·s·V/tp bytes for the logits. This measures what the
head and ``training/loss.py: token_loss_sum`` (``.float()`` then cross-entropy with a sum) keep alive: a dispatch mode
records the storage of every op output as it is created, and after every op sums the bytes of those still
alive. The peak in forward and the peak in backward, divided by the number of logits b·s·V, are the bytes
per logit. The hidden-state input and the head's weight (and views of them) exist before and after and are
not counted; the weight's gradient and small tensors such as the loss are, so the peaks sit a hair above
the round numbers.
"""

from __future__ import annotations

import torch


def peak_bytes_per_logit(batch: int = 2, seq: int = 64, dim: int = 64, vocab: int = 32768) -> dict[str, float]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from measure.saved_bytes import remember
    from training.loss import token_loss_sum

    class LiveBytes(TorchDispatchMode):
        def __init__(self, exclude):
            super().__init__()
            self.exclude = {t.untyped_storage()._cdata for t in exclude}  # the weight and input (and their views)
            self.storages: dict[int, tuple] = {}
            self.peak = {"forward": 0, "backward": 0}
            self.phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st._cdata not in self.exclude:
                        remember(self.storages, st)
            live = sum(n for ref, n in self.storages.values() if not ref.expired())
            self.peak[self.phase] = max(self.peak[self.phase], live)
            return out

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(dim, vocab, bias=False).to(torch.bfloat16)
    h = torch.randn(batch, seq, dim, generator=gen).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    with LiveBytes(
        exclude=(head.weight, h)
    ) as live:  # one record across both phases: backward starts with what forward saved
        loss = token_loss_sum(head(h), targets)
        live.phase = "backward"
        loss.backward()
    logits = batch * seq * vocab
    return {"forward": live.peak["forward"] / logits, "backward": live.peak["backward"] / logits, "logits": logits}


def main() -> None:
    r = peak_bytes_per_logit()
    print(f"{r['logits']:,} logits (bf16 head, fp32 cross-entropy): peak live bytes per logit")
    print(f"  forward  {r['forward']:.3f}   (bf16 logits 2 + their fp32 copy 4 + fp32 log-softmax 4 + small)")
    print(f"  backward {r['backward']:.3f}   (what forward saved, plus the fp32 and bf16 gradients of the logits)")


if __name__ == "__main__":
    main()
