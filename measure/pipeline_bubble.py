"""Every pipeline schedule side by side: measured idle fraction vs the textbook bubble, and a timeline each.

    python -m measure.pipeline_bubble [--pp 2] [--microbatches 4] [--out docs/img] [--details]

Runs one short training (3 steps) per schedule on ``pp`` gloo ranks with ``run.pp_timeline true`` and reports
the last step: the idle fraction against the textbook prediction and the idealized run of the same schedule
(docs/figures/pipeline.py: torch's own action order with unit times), the logged losses (equal for every schedule:
they all train the same model), and with ``--details`` each rank's seconds of F, B, I, W and idle. The model is larger than the debug one (8 layers, dim 256, seq 256) so that compute, not
Python overhead, dominates each box. On a CPU with fewer cores than ranks, ranks also wait for a core: use
pp <= cores for numbers that mean something. The same picture for any single layout comes from
``torchrun ... train.py --parallel.pp P --run.pp_timeline true`` (written to run.dir).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from mesh.pipeline import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model.dim": 256, "model.n_layers": 8, "model.n_heads": 8, "model.n_kv_heads": 4, "training.seq_len": 256}


def run_schedule(schedule: str, pp: int, microbatches: int, run_dir: str) -> None:
    from runtime.config import load_config
    from train import train

    overrides = {
        **MODEL,
        "parallel.pp": pp,
        "parallel.dp_shard": 1,
        "parallel.pp_schedule": schedule,
        "parallel.pp_microbatches": microbatches,
        "training.global_batch": microbatches,
        "training.steps": 3,
        "run.dir": run_dir,
        "run.tensorboard": False,
        "run.pp_timeline": True,
    }
    train(load_config(path=str(ROOT / "configs" / "debug.toml"), overrides=overrides))


def main() -> None:
    from launch.local_runs import read_metrics
    from launch.spawn import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--details", action="store_true", help="per-rank F/B/I/W/idle seconds of the last step")
    args = parser.parse_args()
    from measure.schedule_ir import pipeline_ideal

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"pp={args.pp}, m={args.microbatches}; idle fraction of the last step, mean over ranks")
    print(
        f"{'schedule':<22} {'stages/rank':>11} {'predicted':>10} {'idealized':>10} {'measured':>9}  {'losses':<26} picture"
    )
    for schedule in SCHEDULES:
        with tempfile.TemporaryDirectory() as run_dir:
            run_on_ranks(run_schedule, args.pp, schedule, args.pp, args.microbatches, run_dir, timeout=600)
            summary = json.loads((Path(run_dir) / "pipeline_bubble.json").read_text())
            records = read_metrics(run_dir)
            picture = out / f"pp{args.pp}_m{args.microbatches}_{schedule}.svg"
            shutil.copy(Path(run_dir) / "pipeline_timeline.svg", picture)
        predicted = summary["predicted_idle_fraction"]
        shown = "n/a" if predicted is None else f"{predicted:.1%}"
        ideal = pipeline_ideal(schedule, args.pp, args.microbatches)["idle"]
        losses = " ".join(f"{r['loss']:.4f}" for r in records)
        print(
            f"{schedule:<22} {summary['stages_per_rank']:>11} {shown:>10} {ideal:>10.1%} "
            f"{summary['measured_idle_fraction']:>9.1%}  {losses:<26} "
            f"{picture.relative_to(ROOT) if picture.is_relative_to(ROOT) else picture}",
            flush=True,
        )
        if args.details:
            for row in summary["ranks"]:
                busy = "  ".join(f"{k} {row[k] * 1000:6.0f} ms" for k in ("F", "B", "I", "W"))
                print(f"    rank {row['rank']}: {busy}  idle {row['idle'] * 1000:6.0f} ms ({row['idle_fraction']:.1%})")


if __name__ == "__main__":
    from measure import pipeline_bubble  # the ranks need an importable name, not __main__

    pipeline_bubble.main()
