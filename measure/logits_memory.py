"""Bytes per logit around the loss: a bf16 output head, then train.py's fp32 cross-entropy (one process, CPU).

    python -m measure.logits_memory        # docs/combining.md, section 6: the planner's 12 bytes per logit

planning/memory_estimate.py charges the last pipeline stage 12·s·V/tp bytes for the logits on one process (16 under
TP, 2 more with pipelining: ``bytes_per_logit``). This measures what the
head and ``training/loss.py: token_loss_sum`` (``.float()`` then cross-entropy with a sum) keep alive: a dispatch mode
records the storage of every op output as it is created, and after every op sums the bytes of those still
alive. The peak in forward and the peak in backward, divided by the number of logits b·s·V, are the bytes
per logit. The hidden-state input and the head's weight (and views of them) exist before and after and are
not counted; the weight's gradient and small tensors such as the loss are, so the peaks sit a hair above
the round numbers.

Under TP the head is column-parallel and the cross-entropy runs under ``loss_parallel`` on vocab shards; its
all-reduces and fp32 temporaries happen inside DTensor's dispatch, so the meter hands DTensor ops back to DTensor
(``NotImplemented``) and sees their local ops. DTensor's sharding propagation also runs each op on meta or fake
tensors of the global shape to learn its output's metadata; those hold no memory and are not counted (counting
them read 22 and 20 bytes per logit). ``main`` measures that too, on 2 gloo ranks: 14 bytes per logit of the rank's
shard in forward and 16 in backward, against 10 and 12 on one process (planning/memory_estimate.py:
``bytes_per_logit`` derives both from the ops).
"""

from __future__ import annotations

import argparse
import contextlib

import torch


def peak_bytes_per_logit(
    batch: int = 2, seq: int = 64, dim: int = 64, vocab: int = 32768, tp: bool = False
) -> dict[str, float]:
    """Peak live bytes per logit (of this rank's shard) in forward and in backward; ``tp``: on an initialised process
    group, the head column-parallel over all its ranks and the cross-entropy under ``loss_parallel``."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
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
            if any(is_traceable_wrapper_subclass_type(t) for t in types):
                return NotImplemented  # a DTensor op: its local ops come back here (planning/sim_accounting.py, 3)
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                # DTensor's sharding propagation runs each op on meta or fake tensors of the global shape to learn
                # its output's metadata: no memory, though their storages report the global bytes
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and not isinstance(t, FakeTensor):
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
    context, shards = contextlib.nullcontext(), 1
    if tp:  # as mesh/tensor_parallel.py shards the output head and wraps the loss
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

        shards = dist.get_world_size()
        mesh = init_device_mesh("cpu", (shards,), mesh_dim_names=("tp",))
        plan = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
        head = parallelize_module(head, mesh, plan)
        targets = distribute_tensor(targets, mesh, [Replicate()])
        context = loss_parallel()
    weight = head.weight.to_local() if tp else head.weight
    with LiveBytes(exclude=(weight, h)) as live, context:  # one record across both phases: backward starts with
        loss = token_loss_sum(head(h), targets)  # what forward saved
        live.phase = "backward"
        loss.backward()
    logits = batch * seq * vocab // shards
    return {"forward": live.peak["forward"] / logits, "backward": live.peak["backward"] / logits, "logits": logits}


def on_tp_ranks() -> dict[str, float]:
    return peak_bytes_per_logit(tp=True)


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.logits_memory", description=__doc__.splitlines()[0])


def main() -> None:
    from launch.spawn import run_on_ranks

    r = peak_bytes_per_logit()
    print(f"{r['logits']:,} logits (bf16 head, fp32 cross-entropy): peak live bytes per logit")
    print(f"  forward  {r['forward']:.3f}   (bf16 logits 2 + their fp32 copy 4 + fp32 log-softmax 4 + small)")
    print(f"  backward {r['backward']:.3f}   (what forward saved, plus the fp32 and bf16 gradients of the logits)")
    r = run_on_ranks(on_tp_ranks, 2)[0]
    print(f"tp 2, loss_parallel ({r['logits']:,} logits per rank): peak live bytes per logit of the rank's shard")
    print(f"  forward  {r['forward']:.3f}   backward {r['backward']:.3f}")


if __name__ == "__main__":
    build_parser().parse_args()
    main()
