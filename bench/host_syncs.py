"""Host syncs per training step, per layout: every op that makes the host wait for the device, and why.

    python -m bench.host_syncs            # about a minute on 2 cores; tests/test_host_syncs.py asserts the same

Each layout trains the debug model (2 layers, 4 sequences of 64 tokens per step) through ``train.train``
twice on spawned gloo ranks, for 2 and for 3 steps, under ``training/host_syncs.py: HostSyncCounter``.
Everything before the first step (building the model, the checks, the first step's one-time work) is the same
in both runs, and the 3-step run has one more ordinary step: the difference of the two counts is one
training step, site by site. ``REASONS`` says why each remaining sync is there, and whether it waits for the
device on a GPU (a host tensor, such as AdamW's step counter, costs no device sync, though a CPU run counts
it like any other).

``main(argv)`` prints the table and returns {layout: {rank: {"site op": count}}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launch.local_runs import DEBUG_CONFIG, ROOT

MOE_CONFIG = str(ROOT / "configs" / "debug_moe.toml")
SMALL = {
    "model.n_layers": 2,
    "training.seq_len": 64,
    "training.global_batch": 4,
    "run.tensorboard": False,
}
# name: (ranks, config, overrides)
LAYOUTS = {
    "one process": (1, DEBUG_CONFIG, {}),
    "fsdp2": (2, DEBUG_CONFIG, {"parallel.dp_shard": 2}),
    "tp2": (2, DEBUG_CONFIG, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "pp2": (2, DEBUG_CONFIG, {"parallel.pp": 2, "parallel.dp_shard": 1}),
    "cp2 ring": (2, DEBUG_CONFIG, {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_attention": "ring"}),
    "cp2 allgather": (
        2,
        DEBUG_CONFIG,
        {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_attention": "allgather"},
    ),
    "moe one process": (1, MOE_CONFIG, {}),
    "moe capacity": (1, MOE_CONFIG, {"model.moe_capacity_factor": 1.25}),
    "moe ep2": (2, MOE_CONFIG, {"parallel.dp_shard": 2, "parallel.ep": 2}),
}


# Every site that syncs today: (waits for the device on a GPU, why it is there).
LOSS = "train.py:train _local_scalar_dense"
OPTIMIZER = "training/optimizer.py:step _local_scalar_dense"
STOP_AGREEMENT = "runtime/process.py:max_int _local_scalar_dense"
EMBEDDING_MASK = "models/llama.py:forward boolean index"
EP_SPLITS = "mesh/expert_parallel.py:_dispatch tolist"
EXPERT_LOAD = "mesh/expert_parallel.py:step_expert_load tolist"
CAPACITY = "models/moe.py:forward _local_scalar_dense"
REASONS = {
    LOSS: (
        True,
        "the step's loss and gradient norm, read for the log line and the divergence check (every rank stops "
        "before a non-finite step is applied); the second read finds the device idle already",
    ),
    OPTIMIZER: (
        False,
        "torch's AdamW (foreach) reads each parameter's step counter for its bias corrections, twice per "
        "parameter tensor; torch keeps that counter on the host, so on a GPU this waits for nothing",
    ),
    STOP_AGREEMENT: (
        False,
        "every step but the last, the ranks agree whether a signal asked them to stop, over the CPU "
        "control-plane group (runtime/signals.py): a host tensor",
    ),
    EMBEDDING_MASK: (
        True,
        "under TP, torch's vocab-sharded embedding (DTensor's _MaskPartial) zeroes the token ids outside "
        "this rank's rows with a boolean mask, a nonzero inside torch: once per micro-batch",
    ),
    EP_SPLITS: (
        True,
        "all_to_all_single takes its split sizes as host integers: one read per MoE layer and micro-batch "
        "(sent and received counts together)",
    ),
    EXPERT_LOAD: (True, "the step's global expert load, for the metrics line and the bias update: once per step"),
    CAPACITY: (
        True,
        "with a capacity factor, the number of kept assignments sizes the experts' input: once per MoE layer "
        "and micro-batch (dropless, nothing)",
    ),
}


def device_syncs(counts: dict[str, int]) -> int:
    """How many of ``counts`` wait for the device on a GPU (``REASONS``); an unknown site counts as one that does."""
    return sum(n for site, n in counts.items() if REASONS.get(site, (True,))[0])


def count_syncs(config: str, overrides: dict, run_dir: str, steps: int) -> dict[str, int]:
    """This rank's host syncs over a whole run of ``steps`` steps, as {"site op": count}."""
    from runtime.config import load_config
    from train import train
    from training.host_syncs import HostSyncCounter

    cfg = load_config(path=config, overrides={**SMALL, **overrides, "training.steps": steps, "run.dir": run_dir})
    with HostSyncCounter() as syncs:
        train(cfg)
    return {f"{site} {op}": n for (site, op), n in syncs.counts.items()}


def step_syncs(layouts: list[tuple[str, str, dict]], run_dir: str) -> dict[str, dict[str, int]]:
    """Rank body: {layout: {"site op": syncs in one training step}} for each layout, on this rank."""
    result = {}
    for name, config, overrides in layouts:
        two, three = (
            count_syncs(config, overrides, str(Path(run_dir) / f"{name}-{steps}".replace(" ", "-")), steps)
            for steps in (2, 3)
        )
        per_step = {site: three.get(site, 0) - two.get(site, 0) for site in {*two, *three}}
        result[name] = {site: n for site, n in sorted(per_step.items()) if n}
    return result


def measure(names: list[str], run_dir: str) -> dict[str, list[dict[str, int]]]:
    """{layout: [rank 0's counts, rank 1's, ...]}: the layouts of each world size in one set of spawned ranks."""
    from launch.spawn import run_on_ranks

    by_world: dict[int, list] = {}
    for name in names:
        world, config, overrides = LAYOUTS[name]
        by_world.setdefault(world, []).append((name, config, overrides))
    result = {}
    for world, layouts in by_world.items():
        ranks = run_on_ranks(step_syncs, world, layouts, run_dir, timeout=900)
        for name, _, _ in layouts:
            result[name] = [r[name] for r in ranks]
    return result


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.host_syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names from LAYOUTS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.layouts.split(","), tmp)
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print("host syncs in one training step, per rank (debug model, 2 layers); * = waits for the device on a GPU")
    for name, ranks in result.items():
        totals = ", ".join(f"rank {r}: {sum(c.values())} ({device_syncs(c)}*)" for r, c in enumerate(ranks))
        print(f"{name}: {totals}")
        for rank, counts in enumerate(ranks):
            for site, n in counts.items():
                star = "*" if REASONS.get(site, (True,))[0] else " "
                print(f"    rank {rank}  {n:3d}{star} {site}")
    print("why each is there:")
    for site, (waits, why) in REASONS.items():
        print(f"  {site}{' *' if waits else ''}: {why}")
    return result


if __name__ == "__main__":
    # Run as `python -m bench.host_syncs`: hand the ranks the function under its importable name.
    from bench import host_syncs

    host_syncs.main()
