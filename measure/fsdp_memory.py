"""What each rank really holds under FSDP2, next to the ZeRO-3 formula (4Ψ + 4Ψ + 8Ψ) / dp for fp32 training.

    .venv/bin/python -m measure.fsdp_memory        # from the repository root

For dp = 1, 2, 4 gloo ranks, shard the debug model over dp_shard = dp exactly as train.py does, take one
AdamW step, then count the bytes of local storage on each rank:

- parameters:       ``p.to_local()`` for a DTensor (this rank's shard), else the tensor itself
- gradients:        ``p.grad.to_local()`` likewise (kept: no zero_grad after the step)
- optimizer state:  every tensor in ``optimizer.state`` (AdamW's exp_avg and exp_avg_sq, local shards)

fp32 training holds 4 bytes (weights) + 4 (gradients) + 8 (Adam m and v) per parameter, so ZeRO-3 / FSDP
predicts (4Ψ + 4Ψ + 8Ψ) / dp per rank. AdamW's per-tensor ``step`` counters (one fp32 scalar per parameter
tensor, not sharded) are counted apart: they are not per-parameter state and the formula ignores them.

Padding: FSDP2 splits each parameter along dim 0 like ``torch.chunk``, so when dim 0 is not a multiple of dp the
first ranks get ceil(dim0 / dp) rows and the last ones fewer (the storage behind every shard is padded to
ceil(dim0 / dp) rows, so all-gathers have equal sizes). The ranks holding full-size shards then hold a little
more than 1/dp, and the measured/formula ratio reported below (the largest rank's) can be slightly above 1. The
debug model's dim-0 sizes (256, 128, 64, 384) are multiples of 4, so here it is exactly 1.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

WORLD_SIZES = (1, 2, 4)
CONFIG = "configs/debug.toml"


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's storage for ``t``: its local shard if it is a DTensor."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def measure(config: str = CONFIG) -> dict[str, int]:
    """Rank body: build the FSDP2 model over dp_shard = world, take one AdamW step, count local bytes."""
    from planning.plan import LayoutPlan
    from runtime.config import load_config
    from training.build import build_meshes, build_step

    world = dist.get_world_size()
    cfg = load_config(path=config, overrides={"parallel.dp_shard": world})
    plan = LayoutPlan.resolve(cfg, world, dist.get_rank())
    dims, args = plan.dims, plan.model
    built = build_step(cfg, plan, build_meshes(plan, torch.device("cpu"), timeout_s=60), torch.device("cpu"))
    model, optimizers = built.parts[0], built.optimizers
    optimizer = optimizers.optimizers[0]

    # One step on a small batch; each rank takes its rows, the loss is scaled by the global token count.
    tokens = torch.randint(0, args.vocab_size, (2 * world, 33), generator=torch.Generator().manual_seed(0))
    rows = tokens.chunk(dims.dp)[built.meshes.dp.get_local_rank()]
    loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    (loss / tokens[:, 1:].numel()).backward()
    optimizer.step()

    params = list(model.parameters())
    optim, steps = 0, 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                if key == "step":
                    steps += local_bytes(value)
                else:
                    optim += local_bytes(value)
    return {
        "psi": args.num_params(),
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optim": optim,
        "step_counters": steps,
    }


def formula_bytes(psi: int, n: int) -> float:
    """ZeRO-3 / FSDP per-rank bytes for fp32 training with Adam: (4Ψ + 4Ψ + 8Ψ) / dp."""
    return (4 * psi + 4 * psi + 8 * psi) / n


def table(world_sizes=WORLD_SIZES) -> list[dict]:
    """Measure on each world size; one row per dp with the largest rank's bytes and the formula."""
    from launch.spawn import run_on_ranks

    rows = []
    for n in world_sizes:
        per_rank = run_on_ranks(measure, n, timeout=300)
        biggest = max(per_rank, key=lambda r: r["params"] + r["grads"] + r["optim"])
        total = biggest["params"] + biggest["grads"] + biggest["optim"]
        formula = formula_bytes(biggest["psi"], n)
        rows.append({"n": n, **biggest, "total": total, "formula": formula, "ratio": total / formula})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.fsdp_memory", description=__doc__.splitlines()[0])


def main() -> None:
    rows = table()
    psi = rows[0]["psi"]
    print(
        f"debug model: Ψ = {psi:,} parameters; fp32 training, FSDP2 over dp ranks (dp_shard = dp); bytes on the largest rank"
    )
    print(
        f"{'dp':>2} {'params':>10} {'grads':>10} {'Adam m+v':>10} {'total':>11} {'(4+4+8)Ψ/dp':>12} {'ratio':>7} {'steps':>6}"
    )
    for r in rows:
        print(
            f"{r['n']:>2} {r['params']:>10,} {r['grads']:>10,} {r['optim']:>10,} {r['total']:>11,} "
            f"{r['formula']:>12,.0f} {r['ratio']:>7.4f} {r['step_counters']:>6}"
        )
    print("steps: AdamW's fp32 step counters (4 bytes per parameter tensor, not sharded), not in the total.")


if __name__ == "__main__":
    build_parser().parse_args()
    main()
