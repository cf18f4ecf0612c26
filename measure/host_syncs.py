"""Host syncs, counted: every op that makes the host wait for the device, per training step and layout, and why.

    python -m measure.host_syncs            # about a minute on 2 cores; tests/test_host_syncs.py asserts the same

A GPU runs ahead of Python: the host queues kernels and moves on, and the GPU works through the queue. An
operation whose *result the host needs* (a number to print or branch on, a size to allocate) stops the host
until the queue has drained; the GPU then idles while the host catches up. docs/profiling.md Appendix A.7.

1. **The counter** (``HostSyncCounter``) sees three kinds of sync:

   - ``aten._local_scalar_dense``: a tensor read as a Python number: ``.item()``, ``int(t)``, ``float(t)``,
     ``bool(t)``, ``if t:``;
   - ops whose *output size* is decided by the data: ``nonzero``, ``masked_select``, ``unique``, indexing with
     a boolean mask (a ``nonzero`` inside), ``bincount`` (its length is max + 1), ``repeat_interleave`` with
     tensor repeats and no ``output_size``;
   - copies to the host: ``.tolist()``, ``.numpy()``, ``.cpu()``.

   It is a ``TorchDispatchMode`` (every aten op, autograd's backward included) with a ``TorchFunctionMode``
   beside it (``.tolist()`` and ``.numpy()`` read a CPU tensor's memory without any aten op). Each sync is
   recorded with the innermost frame of meshloom's own code on the stack (``training/step.py:read_step``,
   ``mesh/expert_parallel.py:_dispatch``); a sync inside torch is charged to the meshloom line that called it.
   On a CPU every tensor is a host tensor, so the counter counts an op even where, on a GPU, its tensor lives
   on the host and costs no device sync (torch's AdamW keeps its step counter on the host): ``REASONS`` says
   which is which. A copy to the host written as ``.to(device)`` with a CPU device is invisible here
   (meshloom's step has none), and so is a sync inside a C++ kernel.
2. **Per step and layout** (``measure``). Each layout trains the debug model (2 layers, 4 sequences of 64
   tokens per step) through ``train.train`` twice on spawned gloo ranks, for 2 and for 3 steps, under the
   counter. Everything before the first step (building the model, the checks, the first step's one-time
   work) is the same in both runs, and the 3-step run has one more ordinary step: the difference of the two
   counts is one training step, site by site. ``REASONS`` says why each remaining sync is there and whether
   it waits for the device on a GPU.

``main(argv)`` prints the table and returns {layout: [rank 0's {"site op": count}, rank 1's, ...]}.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from launch.local_runs import DEBUG_CONFIG
from runtime.options import list_option

# ---- 1. the counter --------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
_aten = torch.ops.aten

# aten ops that always need a value from the device on the host
SCALAR_READS = {_aten._local_scalar_dense.default}
# aten ops whose output size the data decides
DATA_SIZED = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}
# Python-level tensor methods that copy to the host (no aten op shows it on a CPU tensor)
HOST_COPIES = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}


def is_meshloom_file(path: Path) -> bool:
    """A file of the repository's own code: under ROOT, and not in a virtual environment kept there (CI makes
    ``.venv`` inside the clone, so torch's own frames sit under ROOT too)."""
    if not path.is_relative_to(ROOT):
        return False
    parts = path.relative_to(ROOT).parts
    return not parts[0].startswith(".") and "site-packages" not in parts


def meshloom_site() -> str:
    """``path:function`` of the innermost frame of meshloom's own code (not this file, not tests)."""
    frame = inspect.currentframe()
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if is_meshloom_file(path) and path.name != "host_syncs.py" and "tests" not in path.parts:
            return f"{path.relative_to(ROOT).as_posix()}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside meshloom"


def sync_name(func, args, kwargs) -> str | None:
    """The name under which aten op ``func`` counts as a host sync, or None if it does not wait for the device."""
    if func in SCALAR_READS or func in DATA_SIZED:
        return func.__name__.split(".")[0]
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave"
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return "boolean index"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_name(func, args, kwargs)
        if name is not None:
            self.counts[(meshloom_site(), name)] += 1
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES:
            self.counts[(meshloom_site(), HOST_COPIES[func])] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.counts``: {(site, op): count} (module docstring)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._modes = (_Function(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def total(self) -> int:
        return sum(self.counts.values())


# ---- 2. per step and layout ------------------------------------------------------------------------------------------
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
    "log every 10": (1, DEBUG_CONFIG, {"run.log_every": 10}),  # the measured step is not a log step
    "log every 10 bf16": (1, DEBUG_CONFIG, {"run.log_every": 10, "training.mixed_precision": "bf16"}),
    "fsdp2 log every 10": (2, DEBUG_CONFIG, {"parallel.dp_shard": 2, "run.log_every": 10}),
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
    "moe log every 10": (1, MOE_CONFIG, {"run.log_every": 10}),
    "moe log every 10 bf16": (1, MOE_CONFIG, {"run.log_every": 10, "training.mixed_precision": "bf16"}),
}


# Every site that syncs today: (waits for the device on a GPU, why it is there).
LOSS = "training/step.py:read_step tolist"
FINITE = "training/step.py:read_step _local_scalar_dense"
STOP_AGREEMENT = "runtime/process.py:gather_floats tolist"
EMBEDDING_MASK = "mesh/tensor_parallel.py:summed boolean index"  # VocabParallelEmbedding finishes the sum
EP_SPLITS = "mesh/expert_parallel.py:host_split_sizes tolist"
EXPERT_LOAD = "mesh/expert_parallel.py:step_expert_load tolist"
CAPACITY = "models/moe.py:forward _local_scalar_dense"
REASONS = {
    LOSS: (
        True,
        "on a log step, the loss and gradient norm of this step and of the unlogged steps before it, in one "
        "read: for the log line and the divergence check (every rank stops before a non-finite step is applied)",
    ),
    FINITE: (
        True,
        "on a step that is not logged but agrees on stopping or saves (run.agree_every, checkpoint.interval), "
        "only the divergence flag (the first non-finite step, kept on the device; the optimizer obeys it without "
        "a read): a non-finite step is never saved and every rank stops on the same step; an ordinary step "
        "reads nothing",
    ),
    STOP_AGREEMENT: (
        False,
        "every run.agree_every steps and on log steps, the ranks agree whether a signal asked them to stop, and "
        "share their step compute times "
        "(observers/rank_balance.py), in one all-gather over the CPU control-plane group (runtime/signals.py): "
        "a host tensor",
    ),
    EMBEDDING_MASK: (
        True,
        "under TP, torch's vocab-sharded embedding (DTensor's _MaskPartial) zeroes the rows of the token ids "
        "outside this rank's vocabulary with a boolean mask when its sum is finished, a nonzero inside torch: "
        "once per micro-batch",
    ),
    EP_SPLITS: (
        True,
        "all_to_all_single takes its split sizes as host integers: one read per MoE layer and micro-batch "
        "(sent and received counts together)",
    ),
    EXPERT_LOAD: (
        True,
        "on a log step, the step's global expert load for the metrics line (the bias update uses it on the "
        "device, every step, obeying the divergence flag)",
    ),
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


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.host_syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layouts",
        type=list_option(choices=tuple(LAYOUTS)),
        default=",".join(LAYOUTS),
        help="comma-separated names from LAYOUTS",
    )
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    parser = build_parser()
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
    main()
