"""What ``parallel.grad_sync = step`` costs in memory: the gradients a rank holds between micro-batches.

    .venv/bin/python -m measure.grad_sync_memory        # from the repository root, about a minute

The debug model (Ψ = 853,120, fp32) built as train.py builds it, on 2 or 4 gloo ranks. One micro-batch's
forward and backward runs inside ``savers.reduce_once_per_step.reduction_window`` with the reduction on (``microbatch``) or
off (``step``, a non-final micro-batch); then the bytes of every live tensor storage of the process are added
up (``gc``, each storage once) and compared with the count before the forward. Activations are freed by then,
so the difference is the gradient state the rank carries into the next micro-batch:

- ``microbatch``: the reduced gradient shards, 4Ψ / (dp_shard) bytes;
- ``step`` on FSDP: every unit's *unsharded* gradient, 4Ψ (the memory sharding the gradients saved);
- ``step`` on HSDP: the reduce-scattered shards, summed locally until the all-reduce, 4Ψ / dp_shard;
- ``step`` on the DDP layout (dp_replicate only): the full gradient, 4Ψ, as it holds anyway.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

LAYOUTS = {
    "fsdp 2": {"parallel.dp_shard": 2},
    "fsdp 4": {"parallel.dp_shard": 4},
    "hsdp 2x2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2},
    "replicate 2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 1},
}


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable in this process (each storage counted once)."""
    gc.collect()
    seen: dict[int, int] = {}
    is_tensor_type: dict[type, bool] = {}  # one issubclass per type: isinstance on every object is slow
    objects = []
    for obj in gc.get_objects():
        kind = type(obj)
        if kind not in is_tensor_type:
            is_tensor_type[kind] = issubclass(kind, torch.Tensor)
        if is_tensor_type[kind]:
            objects.append(obj)
    for obj in objects:
        if obj.device.type != "meta":
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_after_backward(overrides: dict, reduce: bool) -> dict:
    """Rank body: bytes of gradient state held after one micro-batch with the reduction on or off."""
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from savers.reduce_once_per_step import reduction_window
    from training.build import build_meshes, build_step
    from training.loss import token_loss_sum

    cfg = load_config(path="configs/debug.toml", overrides=overrides)
    plan = LayoutPlan.resolve(cfg, dist.get_world_size(), dist.get_rank())
    meshes = build_meshes(plan, torch.device("cpu"), timeout_s=120)
    model = build_step(cfg, plan, meshes, torch.device("cpu")).parts[0]
    tokens = torch.randint(0, plan.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    before = live_tensor_bytes()
    with reduction_window([model], reduce=reduce, hsdp=plan.dims.dp_replicate > 1):
        loss = token_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / (2 * dist.get_world_size() * 64)
        loss.backward()
    del loss
    return {"psi": plan.model.num_params(), "held": live_tensor_bytes() - before}


def table() -> list[dict]:
    from launch.spawn import run_on_ranks

    rows = []
    for name, layout in LAYOUTS.items():
        world = layout.get("parallel.dp_replicate", 1) * layout["parallel.dp_shard"]
        row = {"layout": name, "dp_shard": layout["parallel.dp_shard"]}
        for mode, reduce in (("microbatch", True), ("step", False)):
            per_rank = run_on_ranks(held_after_backward, world, layout, reduce, timeout=300)
            row[mode] = max(r["held"] for r in per_rank)
            row["psi"] = per_rank[0]["psi"]
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.grad_sync_memory", description=__doc__.splitlines()[0])


def main() -> None:
    rows = table()
    psi = rows[0]["psi"]
    print(f"debug model, Ψ = {psi:,}, fp32: gradient bytes a rank holds after a micro-batch's backward")
    print(f"{'layout':<12} {'microbatch':>11} {'step':>11} {'step / 4Ψ':>10}   (4Ψ = {4 * psi:,}; 4Ψ/dp_shard below)")
    for r in rows:
        print(
            f"{r['layout']:<12} {r['microbatch']:>11,} {r['step']:>11,} {r['step'] / (4 * psi):>10.3f}"
            f"   4Ψ/dp_shard = {4 * psi // r['dp_shard']:,}"
        )


if __name__ == "__main__":
    build_parser().parse_args()
    main()
