"""The replica check's cost (observers/replica_check.py) against the training step, from one run.

    .venv/bin/python -m measure.replica_check               # 4 gloo ranks, dp_replicate 2 x tp 2, 12 steps
    .venv/bin/python -m measure.replica_check --steps 20 --dim 256 --layers 8

One run of configs/debug.toml (or the sizes given) on a layout where both kinds of replica exist: every
parameter is replicated over ``dp_replicate`` (HSDP's replicas), and the norm weights also over ``tp``. The
check runs after every step (``debug.check_replicas 1``); each rank times its checks (device-synchronised),
and the step time is the one train.py logs (tokens per step / tokens_per_s). The first two steps are left
out (allocator and first-collective warm-up). It prints the median check and step times, their ratio, and
what that ratio becomes at the default interval (``debug.check_replicas 100``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from runtime.options import count_option

LAYOUT = {"parallel.dp_replicate": 2, "parallel.dp_shard": 1, "parallel.tp": 2}
WARMUP = 2


def timed_run(overrides: dict, run_dir: str) -> dict:
    """Rank body: train with the check timed; this rank's check times, step times, and checked parameters."""
    import observers.replica_check
    import train
    from launch.local_runs import DEBUG_CONFIG
    from observers.replica_check import replica_groups
    from runtime.config import load_config
    from runtime.process import device_time

    checks, counted = [], {}
    original = observers.replica_check.check_replicas

    def timed(named_params, world_mesh, device, *args, **kwargs):
        start = device_time(device)
        out = original(named_params, world_mesh, device, *args, **kwargs)
        checks.append(device_time(device) - start)
        if not counted:
            groups = [replica_groups(p, world_mesh) for _, p in named_params]
            counted.update(
                params=sum(1 for g in groups if g),
                groups=len({grp.ranks for g in groups for grp in g}),
                elements=sum(
                    p.numel() if not hasattr(p, "to_local") else p.to_local().numel() for _, p in named_params
                ),
            )
        return out

    observers.replica_check.check_replicas = timed
    base = {"run.dir": run_dir, "run.tensorboard": False, "debug.check_replicas": 1}
    records = train.train(load_config(path=DEBUG_CONFIG, overrides={**base, **overrides}))
    return {"checks": checks, "records": records, **counted}


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(
        prog="python -m measure.replica_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=count_option(gt=WARMUP), default=12)
    parser.add_argument("--dim", type=count_option(ge=0), default=0, help="model.dim (0: the debug config's)")
    parser.add_argument("--layers", type=count_option(ge=0), default=0, help="model.n_layers (0: the debug config's)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    from launch.spawn import run_on_ranks
    from runtime.config import load_config

    overrides = {**LAYOUT, "training.steps": args.steps}
    if args.dim:
        overrides["model.dim"] = args.dim
    if args.layers:
        overrides["model.n_layers"] = args.layers
    from launch.local_runs import refusal

    problem = refusal(overrides, 4)
    if problem:
        parser.error(f"--dim {args.dim} --layers {args.layers}: {problem}")
    with tempfile.TemporaryDirectory(prefix="meshloom-replica-check-") as tmp:
        results = run_on_ranks(timed_run, 4, overrides, tmp, timeout=900)
    from launch.local_runs import DEBUG_CONFIG

    cfg = load_config(path=DEBUG_CONFIG, overrides=overrides)
    tokens = cfg.training.global_batch * cfg.training.seq_len
    rank0 = results[0]
    step_s = statistics.median(tokens / r["window_tokens_per_s"] for r in rank0["records"][WARMUP:])
    # the slowest rank's check is what every rank waits for
    check_s = statistics.median(max(r["checks"][i] for r in results) for i in range(WARMUP, args.steps))
    layout = " ".join(f"{key.split('.')[1]}={value}" for key, value in LAYOUT.items())
    print(f"layout      {layout}, 4 gloo ranks (CPU), model.dim {cfg.model.dim}, {cfg.model.n_layers} layers")
    print(
        f"checked     {rank0['params']} parameters on rank 0, {rank0['elements']:,} local elements, "
        f"{rank0['groups']} replica groups (one all-reduce each, plus one control-plane scalar)"
    )
    print(f"step        {step_s * 1e3:.1f} ms (median of steps {WARMUP + 1}-{args.steps})")
    print(f"check       {check_s * 1e3:.2f} ms (median, slowest rank)")
    print(f"ratio       {check_s / step_s:.3f}x of a step when checked every step")
    print(f"default     {check_s / step_s / 100:.5f}x of training time at debug.check_replicas 100")


if __name__ == "__main__":
    main()
