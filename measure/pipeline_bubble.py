"""Every pipeline schedule side by side: measured idle fraction vs the textbook bubble, and a timeline each.

    python -m measure.pipeline_bubble [--pp 2] [--microbatches 4] [--out docs/img] [--details]
    python -m measure.pipeline_bubble --out ''       # no pictures: the table only (the docs leg's rerun)

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
from runtime.options import MAX_LOCAL_RANKS, count_option, int_option, path_option

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"model.dim": 256, "model.n_layers": 8, "model.n_heads": 8, "model.n_kv_heads": 4, "training.seq_len": 256}


def run_schedule(schedule: str, pp: int, microbatches: int, run_dir: str) -> None:
    from runtime.config import load_config
    from train import train

    train(
        load_config(
            path=str(ROOT / "configs" / "debug.toml"), overrides=schedule_overrides(schedule, pp, microbatches, run_dir)
        )
    )


def schedule_overrides(schedule: str, pp: int, microbatches: int, run_dir: str) -> dict:
    return {
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


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.pipeline_bubble", description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int_option(ge=1, le=MAX_LOCAL_RANKS), default=2)
    parser.add_argument("--microbatches", type=count_option(), default=4)
    parser.add_argument(
        "--out",
        type=path_option(required=False),
        default=str(ROOT / "docs" / "img"),
        help="folder for the timelines; '' draws none (the docs leg's rerun leaves docs/img as committed)",
    )
    parser.add_argument("--details", action="store_true", help="per-rank F/B/I/W/idle seconds of the last step")
    return parser


def main(argv: list[str] | None = None) -> None:
    from launch.local_runs import read_metrics
    from launch.spawn import run_on_ranks

    parser = build_parser()
    args = parser.parse_args(argv)
    from launch.local_runs import refusal
    from measure.schedule_ir import pipeline_ideal
    from runtime.config import ConfigError
    from runtime.options import check_out_folder

    for schedule in SCHEDULES:  # every run's config, before any rank starts
        problem = refusal(schedule_overrides(schedule, args.pp, args.microbatches, "unused"), args.pp)
        if problem:
            parser.error(f"--pp {args.pp} --microbatches {args.microbatches} ({schedule}): {problem}")
    out = Path(args.out) if args.out else None
    try:
        if out is not None:
            check_out_folder(out, "--out")
            out.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as err:
        parser.error(
            str(err) if isinstance(err, ConfigError) else f"--out {out}: {err.strerror}; pass a folder you can write"
        )
    print(f"pp={args.pp}, m={args.microbatches}; idle fraction of the last step, mean over ranks")
    print(
        f"{'schedule':<22} {'stages/rank':>11} {'predicted':>10} {'idealized':>10} {'measured':>9}  {'losses':<26} picture"
    )
    for schedule in SCHEDULES:
        with tempfile.TemporaryDirectory() as run_dir:
            run_on_ranks(run_schedule, args.pp, schedule, args.pp, args.microbatches, run_dir, timeout=600)
            summary = json.loads((Path(run_dir) / "pipeline_bubble.json").read_text())
            records = read_metrics(run_dir)
            picture = out / f"pp{args.pp}_m{args.microbatches}_{schedule}.svg" if out else None
            if picture is not None:
                shutil.copy(Path(run_dir) / "pipeline_timeline.svg", picture)
        predicted = summary["predicted_idle_fraction"]
        shown = "n/a" if predicted is None else f"{predicted:.1%}"
        ideal = pipeline_ideal(schedule, args.pp, args.microbatches)["idle"]
        losses = " ".join(f"{r['loss']:.4f}" for r in records)
        print(
            f"{schedule:<22} {summary['stages_per_rank']:>11} {shown:>10} {ideal:>10.1%} "
            f"{summary['measured_idle_fraction']:>9.1%}  {losses:<26} "
            f"{'-' if picture is None else picture.relative_to(ROOT) if picture.is_relative_to(ROOT) else picture}",
            flush=True,
        )
        if args.details:
            for row in summary["ranks"]:
                busy = "  ".join(f"{k} {row[k] * 1000:6.0f} ms" for k in ("F", "B", "I", "W"))
                print(f"    rank {row['rank']}: {busy}  idle {row['idle'] * 1000:6.0f} ms ({row['idle_fraction']:.1%})")


if __name__ == "__main__":
    from measure import pipeline_bubble  # the ranks need an importable name, not __main__

    pipeline_bubble.main()
