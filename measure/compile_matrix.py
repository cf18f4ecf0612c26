"""Which layouts ``training.compile`` runs: each eagerly and compiled, 3 steps, the loss compared (docs/profiling.md Appendix A.5).

    python -m measure.compile_matrix                 # about 10 minutes on 2 CPU cores (compiling is most of it)
    python -m measure.compile_matrix one,tp2         # some of them

For every layout: train ``configs/debug.toml`` (or ``debug_moe.toml``) for 3 steps eagerly and with
``training.compile=true`` on gloo ranks, and print the largest relative difference of the two loss curves, or
the error. A layout meshloom refuses (``planning/layout_rules.py: compile_errors``) prints the refusal; on a tree without
those checks (b4fdc54) the same command shows the error torch raised instead.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from launch.local_runs import ROOT, train_on
from launch.spawn import RankFailure
from runtime.options import list_option

DEBUG = str(ROOT / "configs" / "debug.toml")
MOE = str(ROOT / "configs" / "debug_moe.toml")
LAYOUTS = {
    "one": (1, DEBUG, {}),
    "one-selective": (1, DEBUG, {"training.activation_checkpoint": "selective"}),
    "one-full": (1, DEBUG, {"training.activation_checkpoint": "full"}),
    "one-bf16": (1, DEBUG, {"training.mixed_precision": "bf16"}),
    "fsdp2": (2, DEBUG, {"parallel.dp_shard": 2}),
    "tp2": (2, DEBUG, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "tp2-selective": (
        2,
        DEBUG,
        {"parallel.tp": 2, "parallel.dp_shard": 1, "training.activation_checkpoint": "selective"},
    ),
    "fsdp2-tp2": (4, DEBUG, {"parallel.tp": 2, "parallel.dp_shard": 2}),
    "tp2-nosp": (2, DEBUG, {"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.sequence_parallel": False}),
    "pp2-1F1B": (2, DEBUG, {"parallel.pp": 2, "parallel.dp_shard": 1}),
    "pp2-Interleaved1F1B": (
        2,
        DEBUG,
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "Interleaved1F1B"},
    ),
    "pp2-InterleavedZeroBubble": (
        2,
        DEBUG,
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "InterleavedZeroBubble"},
    ),
    "pp2-ZBVZeroBubble": (
        2,
        DEBUG,
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "ZBVZeroBubble"},
    ),
    "pp2-DualPipeV": (
        2,
        DEBUG,
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "DualPipeV", "parallel.pp_microbatches": 4},
    ),
    "cp2-allgather": (2, DEBUG, {"parallel.cp": 2, "parallel.dp_shard": 1}),
    "cp2-ring": (2, DEBUG, {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_attention": "ring"}),
    "moe-one": (1, MOE, {}),
    "moe-ep2": (2, MOE, {"parallel.dp_shard": 2, "parallel.ep": 2}),
    "moe-tp2": (2, MOE, {"parallel.tp": 2, "parallel.dp_shard": 1}),
}


def last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:300]


def build_parser() -> argparse.ArgumentParser:
    """The one argument, the layouts to run (tests/test_input_walk.py walks every tool's parser)."""
    parser = argparse.ArgumentParser(prog="python -m measure.compile_matrix", description=__doc__.splitlines()[0])
    parser.add_argument(
        "layouts",
        nargs="?",
        type=list_option(choices=tuple(LAYOUTS)),
        default=",".join(LAYOUTS),
        help="comma-separated",
    )
    return parser


def main(names: list[str]) -> None:
    for name in names:
        world, config, layout = LAYOUTS[name]
        base = {**layout, "training.steps": 3}
        with tempfile.TemporaryDirectory(prefix="meshloom-compile-") as run_dir:
            try:
                t0 = time.monotonic()
                eager = train_on(world, base, f"{run_dir}/eager", timeout=900, config=config)
                t1 = time.monotonic()
                compiled = train_on(
                    world, {**base, "training.compile": True}, f"{run_dir}/c", timeout=900, config=config
                )
            except RankFailure as exc:
                text = str(exc)
                if "ConfigError" in text:
                    reason = next(line for line in text.splitlines() if "training.compile=true" in line)
                    print(f"{name:<20} refused: {reason.strip(' -')}", flush=True)
                else:
                    print(f"{name:<20} FAILED: {last_error_line(text)}", flush=True)
                continue
        diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(compiled, eager, strict=True))
        print(
            f"{name:<20} compiles: loss differs by {diff:.1e} at most (eager {t1 - t0:.0f} s, compiled "
            f"{time.monotonic() - t1:.0f} s with compilation)",
            flush=True,
        )


if __name__ == "__main__":
    main(build_parser().parse_args().layouts.split(","))
