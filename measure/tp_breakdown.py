"""Where a TP 2 step's time goes, next to one process: a profiled breakdown (docs/profiling.md, Appendix A.1).

    python -m measure.tp_breakdown                 # about 2 minutes on 2 CPU cores
    python -m measure.tp_breakdown --set parallel.sp_regather=true --set training.activation_checkpoint=none

Trains measure/tokens_per_second.py's model (dim 256, 6 layers, seq 512, 8 sequences, selective AC) for 4 steps on one
process and on tp=2 (SP), profiles steps 3 and 4 (``profile.enabled``), and splits each rank's training
thread time, per step, into:

- ``matmul`` and ``attention``: the self time of aten::mm/addmm/bmm and of the SDPA kernels, forward and
  backward: the FLOPs, which TP divides;
- ``other ops``: the self time of every other operator (elementwise, norms, the loss, AdamW's foreach ops);
- ``dispatch``: the self time of DTensor's and the dispatch modes' own ranges (``PythonSubclass``,
  ``Redistribute``, ``_FromTorchTensor``, ...) plus the step time outside any operator: Python, hooks,
  sharding propagation;
- ``collectives``: the self time of collective calls and waits on the training thread: communication that
  nothing hides (on CPU, gloo's threads run it while the training thread waits).

It also lists the collectives issued per step by phase (forward, backward, the gradient reductions between
backward and clipping, clipping, optimizer) and kind, with their bytes, from the operators'
recorded input shapes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from measure.tokens_per_second import DEBUG, SHAPE
from runtime.options import override_option

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
DISPATCH = (
    "PythonSubclass",
    "PythonDispatchMode",
    "Redistribute",
    "NestedRedistribute",
    "_FromTorchTensor",
    "_ToTorchTensor",
    "_ToTorchTensorBackward",
    "_FromTorchTensorBackward",
)
# The c10d calls that launch a collective (a functional collective calls one of these; one that selective
# activation checkpointing answers from its cache, during recomputation, calls none).
ISSUE = (
    "c10d::allreduce_",
    "c10d::_allgather_base_",
    "c10d::allgather_into_tensor_coalesced_",
    "c10d::_reduce_scatter_base_",
    "c10d::reduce_scatter_tensor_coalesced_",
)
PHASES = ("forward", "backward", "gradient clipping", "optimizer")
BYTES = {"float": 4, "c10::BFloat16": 2, "long int": 8, "int": 4, "double": 8}


def profiled_run(overrides: dict, run_dir: str) -> str:
    """Rank body: train with the profiler on; returns this rank's trace path."""
    import torch.distributed as dist

    from observers.profiling import trace_path
    from runtime.config import load_config
    from train import train

    train(load_config(path=DEBUG, overrides={**overrides, "run.dir": run_dir}))
    return str(trace_path(run_dir, dist.get_rank()))


def numel(dims) -> int:
    """Elements of a recorded input: a shape, or a list of shapes (a tensor list)."""
    if dims and isinstance(dims[0], list):
        return sum(numel(d) for d in dims)
    count = 1
    for d in dims:
        count *= d
    return count


def breakdown(path: str) -> dict:
    """Per-step mean of the categories of the module docstring, and the collectives by phase and kind."""
    from training.comm_share import COMM_CALL

    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    main = steps[0]["tid"]
    windows = [(s["ts"], s["ts"] + s["dur"]) for s in steps]
    ops = sorted(
        (
            e
            for e in events
            if e.get("cat") == "cpu_op" and e["tid"] == main and any(a <= e["ts"] < b for a, b in windows)
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    phases = [
        (e["ts"], e["ts"] + e["dur"], e["name"].split("::")[1])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("meshloom::")
    ]
    covered, stack = 0.0, []
    for e in ops:  # self time: an op's duration minus its children's
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][1] <= start:
            stack.pop()
        if stack:
            stack[-1][2]["self"] -= e["dur"]
        else:
            covered += e["dur"]
        e["self"] = e["dur"]
        stack.append((start, end, e))
    cats, waits = defaultdict(float), defaultdict(float)
    collectives: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    phase_of = lambda e: next((p for a, b, p in phases if a <= e["ts"] < b and p in PHASES), "between")  # noqa: E731
    for e in ops:
        name = e["name"]
        if COMM_CALL.match(name):
            cats["collectives"] += e["self"]
            waits[phase_of(e)] += e["self"]
        elif name in MATMUL:
            cats["matmul"] += e["self"]
        elif "scaled_dot_product" in name:
            cats["attention"] += e["self"]
        elif name in DISPATCH:
            cats["dispatch"] += e["self"]
        else:
            cats["other ops"] += e["self"]
        if name in ISSUE:
            phase = phase_of(e)
            kind = "all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name else "all_reduce"
            # the whole tensor: the gathered output, the input of a reduce-scatter, an all-reduce's tensor
            arg = 1 if kind == "reduce_scatter" else 0
            dims = (e.get("args", {}).get("Input Dims") or [[]] * 2)[arg]
            dtype = (e.get("args", {}).get("Input type") or ["float"] * 2)[arg]
            collectives[(phase, kind)][0] += 1
            collectives[(phase, kind)][1] += numel(dims) * BYTES.get(dtype if isinstance(dtype, str) else "float", 4)
    n = len(steps)
    step_us = sum(b - a for a, b in windows) / n
    cats = {k: v / n for k, v in cats.items()}
    cats["dispatch"] = cats.get("dispatch", 0.0) + step_us - covered / n  # time outside any operator
    return {
        "step_ms": step_us / 1e3,
        "ms": {k: v / 1e3 for k, v in cats.items()},
        "collectives": {f"{p}/{k}": (c / n, b / n) for (p, k), (c, b) in sorted(collectives.items())},
        "collective_ms_by_phase": {p: w / n / 1e3 for p, w in sorted(waits.items())},
    }


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.tp_breakdown", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--set", type=override_option(), action="append", default=[], help="extra override for both runs, key=value"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    from launch.spawn import run_on_ranks

    parser = build_parser()
    args = parser.parse_args(argv)
    base = {
        **SHAPE,
        "training.activation_checkpoint": "selective",
        "training.steps": 4,
        "run.tensorboard": False,
        "profile.enabled": True,
        "profile.start_step": 3,
        "profile.steps": 2,
        "run.log_every": 4,
        **dict(kv.split("=", 1) for kv in args.set),
    }
    rows = {}
    for name, ranks, layout in (("one process", 1, {}), ("tp=2", 2, {"parallel.tp": 2, "parallel.dp_shard": 1})):
        with tempfile.TemporaryDirectory(prefix="meshloom-tp-breakdown-") as run_dir:
            paths = run_on_ranks(profiled_run, ranks, {**base, **layout}, run_dir, timeout=900)
            for rank, path in enumerate(paths):
                rows[f"{name}, rank {rank}" if ranks > 1 else name] = breakdown(path)
    cats = ("matmul", "attention", "other ops", "dispatch", "collectives")
    print(f"{'ms per step':<20} {'step':>8} " + " ".join(f"{c:>12}" for c in cats))
    for name, r in rows.items():
        print(f"{name:<20} {r['step_ms']:8.1f} " + " ".join(f"{r['ms'].get(c, 0.0):12.1f}" for c in cats))
    for rank in (0, 1):
        r = rows[f"tp=2, rank {rank}"]
        print(f"\ntp=2 rank {rank}, collectives per step (phase/kind: count, MiB of the whole tensor):")
        for key, (count, nbytes) in r["collectives"].items():
            print(f"  {key:<30} {count:5.0f} {nbytes / 2**20:9.2f}")
        print(
            "  time in collective calls and waits, ms per step: "
            + ", ".join(f"{p} {ms:.1f}" for p, ms in r["collective_ms_by_phase"].items())
        )


if __name__ == "__main__":
    from measure import tp_breakdown

    tp_breakdown.main()
