"""The vocabulary matrices as their own FSDP units: peak gathered bytes per rank, before and after.

    .venv/bin/python -m measure.vocab_units        # from the repository root, about a minute on 2 cores

A wide-vocabulary model (dim 64, 2 layers, vocabulary 32,768: the embedding and the head are 2.1M
parameters each, the two blocks 0.1M) is sharded over dp_shard = 4 gloo ranks as train.py shards it
(mesh/data_parallel.py: ``apply_fsdp``), once with the embedding, the final norm and the head left in the
root unit (``before``: ``vocabulary_units`` patched to return no groups) and once as it ships (``after``: the
embedding one unit, the norm and head another). Each runs one forward and backward on 4 sequences of 32
tokens per rank, fp32.

What is measured, per rank: the sharded state (parameters, gradients; the same in both), and the peak of the
*gathered* parameter bytes over every aten op of the step. A parameter is gathered while its module holds
the plain tensor FSDP2 all-gathered instead of its sharded DTensor (FSDP2 swaps them at unshard and reshard),
so a ``TorchDispatchMode`` sums, at each op, the bytes of the modules' non-DTensor parameters. Activations are
the same in both runs and are left out.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 4
OVERRIDES = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.vocab_size": 32768}


class GatheredPeak(TorchDispatchMode):
    """At every aten op, the bytes of the parameters ``model`` holds gathered (not DTensors); keeps the peak."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.modules = list(model.modules())
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        now = sum(
            p.untyped_storage().nbytes()
            for m in self.modules
            for p in m._parameters.values()
            if p is not None and not hasattr(p, "to_local")
        )
        self.peak = max(self.peak, now)
        return func(*args, **(kwargs or {}))


def measure(vocab_units: bool) -> dict[str, int]:
    """Rank body: build the model under FSDP over all ranks, one forward and backward; this rank's bytes."""
    import mesh.data_parallel
    from launch.local_runs import DEBUG_CONFIG
    from mesh.private_api import fsdp_units
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from training.build import build_meshes, build_step

    world = dist.get_world_size()
    cfg = load_config(path=DEBUG_CONFIG, overrides={**OVERRIDES, "parallel.dp_shard": world})
    plan = LayoutPlan.resolve(cfg, world, dist.get_rank())
    meshes = build_meshes(plan, torch.device("cpu"), timeout_s=120)
    units = mesh.data_parallel.vocabulary_units
    if not vocab_units:
        mesh.data_parallel.vocabulary_units = lambda model: []  # the root keeps the embedding, norm and head
    try:
        model = build_step(cfg, plan, meshes, torch.device("cpu")).parts[0]
    finally:
        mesh.data_parallel.vocabulary_units = units
    n_units = fsdp_units(model)  # the norm and head, sharded as a list, are one unit
    tokens = torch.randint(0, plan.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
    with GatheredPeak(model) as gathered:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    params = list(model.parameters())
    return {
        "units": n_units,
        "sharded": sum(p.to_local().numel() * p.element_size() for p in params),
        "grads": sum(g.to_local().numel() * g.element_size() for p in params if (g := p.grad) is not None),
        "gathered_peak": gathered.peak,
    }


def table() -> dict[str, list[dict]]:
    from launch.spawn import run_on_ranks

    return {
        name: run_on_ranks(measure, WORLD, units, timeout=600) for name, units in (("before", False), ("after", True))
    }


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.vocab_units", description=__doc__.splitlines()[0])


def main() -> None:
    result = table()
    print(f"vocabulary 32,768, dim 64, 2 layers, fp32, FSDP over dp_shard = {WORLD}; bytes per rank (the largest rank)")
    print(
        f"{'units':<45} {'units with params':>17} {'sharded params+grads':>21} {'peak gathered':>14} {'peak total':>11}"
    )
    labels = {"before": "before: embedding, norm, head in the root", "after": "after: embedding | norm + head | root"}
    peaks = {}
    for name, ranks in result.items():
        r = max(ranks, key=lambda r: r["sharded"] + r["grads"] + r["gathered_peak"])
        peaks[name] = r["sharded"] + r["grads"] + r["gathered_peak"]
        print(
            f"{labels[name]:<45} {r['units']:>17} {r['sharded'] + r['grads']:>21,} {r['gathered_peak']:>14,} "
            f"{peaks[name]:>11,}"
        )
    print(f"peak total, after / before: {peaks['after'] / peaks['before']:.3f}")


if __name__ == "__main__":
    from measure import vocab_units

    vocab_units.build_parser().parse_args()

    vocab_units.main()
