"""Token dropping under a capacity factor, measured: the debug MoE model on one process, 10 steps per factor.

    python -m measure.moe_capacity      # four runs of 10 steps, under a minute on 2 loaded cores

For each capacity factor cf (0 = dropless), ``train.train`` runs configs/debug_moe.toml from the same weights
and data, and the table prints what its metrics.jsonl logs: the assignments dropped at each step, layer 0's
tokens per expert at the last step (an expert full at capacity shows 8 sequences x its per-sequence capacity),
and the last step's loss. One process on CPU is deterministic, so the printout reruns exactly
(docs/expert_parallel.md, section 4).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "debug_moe.toml")
FACTORS = (0.0, 1.0, 1.25, 2.0)
STEPS = 10


def run(cf: float, run_dir: Path) -> list[dict]:
    """The metrics.jsonl records of one ``STEPS``-step run at capacity factor ``cf``."""
    from runtime.config import load_config
    from train import train

    overrides = {
        "model.moe_capacity_factor": cf,
        "training.steps": STEPS,
        "checkpoint.interval": 0,
        "run.dir": str(run_dir),
        "run.tensorboard": False,
    }
    train(load_config(path=CONFIG, overrides=overrides))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.moe_capacity", description=__doc__.splitlines()[0])


def main() -> None:
    build_parser().parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = {cf: run(cf, Path(folder) / f"cf{cf:g}") for cf in FACTORS}
    print(f"{'cf':<13} {'dropped assignments, steps 1 … ' + str(STEPS):<55} {'layer 0 load at the last step':<34} loss")
    for cf, records in rows.items():
        name = "0 (dropless)" if cf == 0 else f"{cf:g}"
        dropped = " ".join(str(r["dropped_assignments"]) for r in records)
        load = " ".join(str(n) for n in records[-1]["expert_load"]["0"])
        print(f"{name:<13} {dropped:<55} {load:<34} {records[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
