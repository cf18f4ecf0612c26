"""Peak memory per pipeline rank under ``parallel.pp_split params`` against ``memory``, measured on pp 4.

    python -m measure.pp_split_memory        # from the repository root, about a minute on 2 cores

The debug model with 8 layers (fp32, no FSDP: pp 4 is the whole world), 1F1B with 4 micro-batches of 2
sequences, built and stepped on 4 gloo ranks by train.py's own build (training/build.py: ``build_step``:
the stages, their 1F1B schedule and the optimizers). Under 1F1B rank r holds up to 4 - r micro-batches of
activations, so with equal layers the first rank holds the most; the memory split gives it fewer layers.
Each rank:

1. runs one training step (torch infers the stages' shapes, AdamW creates its state), then counts the bytes
   of every live tensor storage of the process (``gc``, each storage once: weights, Adam's m and v, the
   stages' receive buffers);
2. runs a second step under a dispatch mode that records the storage of every op output as it is created
   and, after every op, adds up those still alive (activations, the gradients, the logits): the step's peak
   above step 1's count;
3. reports the count plus that peak: the rank's peak tensor bytes in a step.

Printed per split: the layers per stage, each rank's measured peak next to planning/memory_estimate.py's estimate,
and the ratio max / min over the ranks, from one run. Not counted: the allocator's caches, Python objects,
torch's own buffers outside tensors (the process RSS includes the torch import, about 200 MiB per rank).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from measure.grad_sync_memory import live_tensor_bytes

CONFIG = "configs/debug.toml"
LAYOUT = {
    "parallel.pp": 4,
    "parallel.dp_shard": 1,
    "parallel.pp_schedule": "1F1B",
    "parallel.pp_microbatches": 4,
    "model.n_layers": 8,
    "training.global_batch": 8,
    "run.memory_check": False,
}
SPLITS = ("params", "memory")


def step_peak(split: str) -> dict:
    """Rank body: steps 1-3 of the module docstring under ``pp_split = split``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from measure.saved_bytes import remember
    from mesh.pipeline import run_schedule
    from planning.memory_estimate import rank_memory
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from training.build import build_meshes, build_step

    class LiveBytes(TorchDispatchMode):
        """The peak of the bytes of op outputs created under the mode and still alive (step 2)."""

        def __init__(self):
            super().__init__()
            self.storages: dict[int, tuple] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    remember(self.storages, st)
            self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.storages.values()))
            return out

    torch.set_num_threads(1)
    cfg = load_config(path=CONFIG, overrides={**LAYOUT, "parallel.pp_split": split})
    rank, device = dist.get_rank(), torch.device("cpu")
    plan = LayoutPlan.resolve(cfg, dist.get_world_size(), rank)
    built = build_step(cfg, plan, build_meshes(plan, device, timeout_s=120), device)  # as train.py builds it
    schedule, optimizers = built.schedule, built.optimizers
    seq = cfg.training.seq_len
    tokens = torch.randint(0, plan.model.vocab_size, (plan.local_batch, seq + 1), generator=torch.Generator())

    def step() -> None:
        run_schedule(schedule, list(plan.stage_ids), plan.layout.n_stages, tokens[:, :-1], tokens[:, 1:], False)
        optimizers.step()

    step()  # 1: shapes inferred, Adam's state created
    dist.barrier()
    before = live_tensor_bytes()
    with LiveBytes() as live:
        run_schedule(schedule, list(plan.stage_ids), plan.layout.n_stages, tokens[:, :-1], tokens[:, 1:], False)
    estimate = rank_memory(plan.model, plan.layout, plan.stage_layers, plan.pp_rank, plan.stage_ids).total
    return {"split": plan.split_line(), "measured": before + live.peak, "estimate": estimate}


def table() -> dict[str, list[dict]]:
    from launch.spawn import run_on_ranks

    return {split: run_on_ranks(step_peak, 4, split, timeout=300) for split in SPLITS}


def spread(values: list[float]) -> float:
    return max(values) / min(values)


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.pp_split_memory", description=__doc__.splitlines()[0])


def main() -> dict[str, list[dict]]:
    rows = table()
    mib = 2**20
    print("debug model, 8 layers, fp32; pp 4, 1F1B, 4 micro-batches of 2 x 128 tokens; peak tensor MiB per rank")
    print(
        f"{'pp_split':<9} {'layers':<10} {'':<9} " + " ".join(f"{'rank ' + str(r):>8}" for r in range(4)) + "  max/min"
    )
    for split, ranks in rows.items():
        measured = [r["measured"] for r in ranks]
        estimate = [r["estimate"] for r in ranks]
        layers = ranks[0]["split"].removeprefix("layers per stage ")
        for what, values in (("measured", measured), ("estimate", estimate)):
            cells = " ".join(f"{v / mib:8.2f}" for v in values)
            print(
                f"{split if what == 'measured' else '':<9} {layers if what == 'measured' else '':<10} {what:<9} {cells}  {spread(values):7.2f}"
            )
    params, memory = (max(r["measured"] for r in rows[s]) for s in SPLITS)
    print(f"largest rank, memory / params: {memory / params:.2f} (measured)")
    return rows


if __name__ == "__main__":
    # Run as `python -m measure.pp_split_memory`: the ranks get the function under its importable name.
    from measure import pp_split_memory

    pp_split_memory.build_parser().parse_args()

    pp_split_memory.main()
