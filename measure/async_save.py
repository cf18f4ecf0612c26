"""How long the training thread stands still per checkpoint save: a synchronous save against an async one.

    python -m measure.async_save                  # one process, an 18M-parameter model (1-2 minutes on 2 cores)
    python -m measure.async_save --world 2        # fsdp2 on 2 ranks
    python -m measure.async_save --gpu            # on a GPU, a 160M-parameter model (pinned staging, a side stream)

Both runs train the same model for ``--steps`` steps with a save every ``--interval`` steps, once with
``checkpoint.async false`` and once with ``true``, in one invocation. The *stall* of a save is the time the
training thread spends in checkpoint/manager.py's calls that train.py makes (wrapped here, nothing else
changed):

- ``maybe_save``: a synchronous save's whole copy, write, hashing and publishing; an async save's
  agreement that step-N does not exist, building the state dict and handing it to the stager (and, before
  that, waiting for the previous async save to be written and published, if it is not yet);
- ``wait_staged`` (async only): before the next optimizer step, waiting until the stager copied the state;
- ``finish``: at the end, waiting for the last async save to be written; reported apart, since a run that
  ends must wait for its last save whatever the mode.

Printed: the median stall per save (the saves before the last step) of each mode, their ratio, and the median
step time (train.py's timed window, saves not included) for scale. The model is the debug model widened until
a save moves a few hundred MB (weights and Adam's two moments in fp32: 12 bytes per parameter), so the copy
and the write are not lost in noise. On a 2-core machine the staging and writing threads compete with
training for the same cores, and the async figure includes that; on a GPU the copy is device-to-host.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from runtime.options import MAX_LOCAL_RANKS, count_option, int_option

SHAPE = {
    "model.dim": 512,
    "model.n_layers": 6,
    "model.n_heads": 8,
    "model.n_kv_heads": 4,
    "model.vocab_size": 256,
    "training.seq_len": 128,
    "training.global_batch": 4,
}
# On a GPU (``--gpu``): 160M parameters, 1.8 GiB per save, so the device-to-host copy and the write show.
GPU_SHAPE = {
    "model.dim": 1024,
    "model.n_layers": 8,
    "model.n_heads": 16,
    "model.n_kv_heads": 8,
    "model.vocab_size": 32768,
    "training.seq_len": 1024,
    "training.global_batch": 8,
    "training.mixed_precision": "bf16",
}


def train_and_time_stalls(overrides: dict, run_dir: str) -> dict:
    """Rank body: train with ``overrides``; returns each save's stall (s), the finish wait and the step times."""
    import train
    from checkpoint.manager import CheckpointManager
    from runtime.config import load_config

    saves: dict[int, float] = {}  # step -> seconds the training thread stalled for that save
    current = {"step": None}  # the newest save: an optimizer step waits for its copy
    finish_s = [0.0]

    def timed(method, charge):
        def wrapper(self, *args):
            start = time.perf_counter()
            out = method(self, *args)
            charge(self, args, time.perf_counter() - start)
            return out

        return wrapper

    def on_save(self, args, seconds):
        step = args[0]
        if self.due(step):
            saves[step] = saves.get(step, 0.0) + seconds
            current["step"] = step

    def on_staged(self, args, seconds):
        if current["step"] is not None:  # the copy belongs to the save before this optimizer step
            saves[current["step"]] += seconds

    def on_finish(self, args, seconds):
        finish_s[0] += seconds

    patched = {
        "maybe_save": timed(CheckpointManager.maybe_save, on_save),
        "wait_staged": timed(CheckpointManager.wait_staged, on_staged),
        "finish": timed(CheckpointManager.finish, on_finish),
    }
    originals = {name: getattr(CheckpointManager, name) for name in patched}
    for name, method in patched.items():
        setattr(CheckpointManager, name, method)
    try:
        base = {"run.dir": run_dir, "run.tensorboard": False, "run.log_every": 1000}
        records = train.train(load_config(path="configs/debug.toml", overrides={**base, **overrides}))
    finally:
        for name, method in originals.items():
            setattr(CheckpointManager, name, method)
    tokens = overrides["training.global_batch"] * overrides["training.seq_len"]
    step_s = [tokens / r["window_tokens_per_s"] for r in records]  # train.py's timed window: the step without the save
    return {"saves": saves, "finish_s": finish_s[0], "step_s": step_s, "last_step": records[-1]["step"]}


def state_bytes(shape: dict) -> int:
    """Bytes a save copies: fp32 weights and Adam's two fp32 moments (12 bytes per parameter)."""
    from runtime.config import load_config, model_args

    return 12 * model_args(load_config(path="configs/debug.toml", overrides=shape)).num_params()


def measure(world: int, steps: int, interval: int, gpu: bool, timeout: float = 1200) -> dict:
    """Run both modes in this invocation; returns per mode the median stall per save and the median step."""
    from launch.spawn import run_on_ranks

    shape = GPU_SHAPE if gpu else SHAPE
    layout = {"parallel.dp_shard": world} if world > 1 else {}
    device = {"training.device": "cuda" if gpu else "cpu"}
    results = {}
    for async_ in (False, True):
        overrides = {
            **shape,
            **layout,
            **device,
            "training.steps": steps,
            "checkpoint.interval": interval,
            "checkpoint.async": async_,
            "checkpoint.keep_last": 1,
        }
        with tempfile.TemporaryDirectory(prefix="meshloom-async-save-") as run_dir:
            out = run_on_ranks(train_and_time_stalls, world, overrides, run_dir, timeout=timeout, gpus=gpu)[0]
        steady = [s for step, s in sorted(out["saves"].items()) if step != out["last_step"]]
        results["async" if async_ else "sync"] = {
            "stall_s": statistics.median(steady),
            "stalls_s": steady,
            "finish_s": out["finish_s"],
            "step_s": statistics.median(out["step_s"]),
        }
    results["ratio"] = results["sync"]["stall_s"] / max(results["async"]["stall_s"], 1e-9)
    results["state_bytes"] = state_bytes(shape)
    return results


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.async_save", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--world", type=int_option(ge=1, le=MAX_LOCAL_RANKS), default=1, help="ranks (fsdp over all of them)"
    )
    parser.add_argument("--steps", type=count_option(), default=7, help="steps per run (the last step always saves)")
    parser.add_argument("--interval", type=count_option(), default=2, help="save every N steps")
    parser.add_argument("--gpu", action="store_true", help="train on cuda (one GPU per rank)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpu:
        import torch

        if torch.cuda.device_count() < args.world:
            parser.error(
                f"--gpu with --world {args.world} needs {args.world} GPUs, this machine shows "
                f"{torch.cuda.device_count()}; lower --world or leave out --gpu"
            )
    r = measure(args.world, args.steps, args.interval, args.gpu)
    print(
        f"{'gpu' if args.gpu else 'cpu'}, world {args.world}: {r['state_bytes'] / 2**20:,.0f} MiB of fp32 weights "
        f"and Adam moments per save (whole model), a save every {args.interval} of {args.steps} steps"
    )
    for mode in ("sync", "async"):
        m = r[mode]
        stalls = ", ".join(f"{s:.3f}" for s in m["stalls_s"])
        print(
            f"  {mode:<5}: stall per save {m['stall_s']:.3f} s (saves before the last: {stalls}); "
            f"waiting for the last save at the end {m['finish_s']:.3f} s; step {m['step_s']:.2f} s"
        )
    print(f"training-thread stall per save, sync / async: {r['ratio']:.1f}x")
    return r


if __name__ == "__main__":
    main()
