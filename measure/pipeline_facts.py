"""The numbers of docs/pipeline_parallel.md that are not in measure/pipeline_bubble.py, one command each.

    python -m measure.pipeline_facts split          # section 1: stage contents and layers per stage
    python -m measure.pipeline_facts scale-grads    # section 7: what torch's default scale_grads=True would do
    python -m docs.figures pipeline --pp 4 --microbatches 8   # sections 3-4: activations in flight (and bubbles)

``split`` is arithmetic on ``mesh/pipeline.py: split_layers`` and ``build_stage_module``. ``scale-grads`` trains
the debug model for 3 steps on 2 gloo ranks (ZBVZeroBubble, pp 2, m 4) twice: as meshloom builds it
(``scale_grads=False``) and with the schedule's ``scale_grads`` switched back to torch's default, and prints
both next to one process (about 40 s).
"""

from __future__ import annotations

import argparse
import tempfile

from mesh.pipeline import build_stage_module
from models.llama import ModelArgs
from models.presets import PRESETS
from planning.pipeline_split import layer_costs, split_layers

DEBUG = ModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=64)  # configs/debug.toml
BENCH = ModelArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=64)  # pipeline_bubble.py


def stage_names(args: ModelArgs, n_stages: int) -> list[str]:
    lines = []
    for s, layers in enumerate(split_layers(args, n_stages, "params", 128)):
        names = [n for n, _ in build_stage_module(args, layers, s == 0, s == n_stages - 1).named_parameters()]
        lines.append(f"stage {s}, layers {layers}: {names[0]}, ..., {names[-1]}  ({len(names)} tensors)")
    return lines


def split_table() -> list[str]:
    rows = [
        ("debug", DEBUG, (2, 4), 128),
        ("bench", BENCH, (4, 8), 256),
        ("llama3-8b", PRESETS["llama3-8b"], (4, 8), 8192),
    ]
    lines = [f"{'model':<10} {'stages':>6}  {'params':<24} {'flops (seq_len)':<28} head / one layer (params)"]
    for name, args, counts, seq in rows:
        costs, _, last = layer_costs(args, "params", seq)
        for n in counts:
            by_params = ",".join(str(len(s)) for s in split_layers(args, n, "params", seq))
            by_flops = ",".join(str(len(s)) for s in split_layers(args, n, "flops", seq))
            lines.append(f"{name:<10} {n:>6}  {by_params:<24} {by_flops + f' ({seq})':<28} {last / costs[0]:.2f}")
    return lines


def scale_grads_run(scale_grads: bool, run_dir: str) -> list[dict]:
    """Rank body: 3 steps of the debug model on pp 2 (ZBVZeroBubble, m 4), optionally with scale_grads=True."""
    import train
    import training.step
    from runtime.config import load_config

    build = training.step.build_pipeline_schedule

    def build_then_rescale(*args, **kwargs):
        schedule, stages = build(*args, **kwargs)
        schedule.scale_grads = scale_grads  # torch's default is True: divide every gradient by m after the step
        return schedule, stages

    training.step.build_pipeline_schedule = build_then_rescale
    overrides = {
        "parallel.pp": 2,
        "parallel.dp_shard": 1,
        "parallel.pp_schedule": "ZBVZeroBubble",
        "parallel.pp_microbatches": 4,
        "training.steps": 3,
        "run.dir": run_dir,
        "run.tensorboard": False,
    }
    return train.train(load_config(path="configs/debug.toml", overrides=overrides))


def scale_grads() -> list[str]:
    from launch.local_runs import train_on
    from launch.spawn import run_on_ranks

    with tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        reference = train_on(1, {"training.steps": 3}, one)
        ours = run_on_ranks(scale_grads_run, 2, False, a)[0]
        torch_default = run_on_ranks(scale_grads_run, 2, True, b)[0]
    lines = [
        f"{'step':>4} {'grad_norm 1 process':>20} {'scale_grads=False':>18} {'=True':>10} {'ratio':>7}   "
        f"{'loss, =True vs 1 process (relative)':>36}"
    ]
    for r, o, t in zip(reference, ours, torch_default, strict=True):
        rel = abs(t["loss"] - r["loss"]) / r["loss"]
        lines.append(
            f"{r['step']:>4} {r['grad_norm']:>20.7f} {o['grad_norm']:>18.7f} {t['grad_norm']:>10.7f} "
            f"{r['grad_norm'] / t['grad_norm']:>7.3f}   {t['loss']:.7f} vs {r['loss']:.7f} ({rel:.1e})"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.pipeline_facts", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["split", "scale-grads"])
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.what == "split":
        print("\n".join(stage_names(DEBUG, 4)))
        print()
        print("\n".join(split_table()))
    else:
        print("\n".join(scale_grads()))


if __name__ == "__main__":
    from measure import pipeline_facts  # the ranks need an importable name, not __main__

    pipeline_facts.main()
