"""What a DCP checkpoint of meshloom holds on disk, and how long training stands still per save.

    python -m bench.dcp_files            # docs/checkpointing.md, section 2 (about 30 s)
    python -m bench.dcp_files --timing   # section 7: sync vs async save, 1 process and dp_shard 4 (about 2 min)

The first form trains the debug model for 4 steps on dp_shard = 4 gloo ranks, saving at step 4, then lists
the checkpoint's files with their sizes, counts ``.metadata``'s entries (tensors and small Python values) and
prints the saved chunks of one weight (offsets and sizes in the full tensor) next to a one-process save.
``--timing`` trains 6 steps saving every 2 and reports, per save, the seconds ``maybe_save`` kept the training
loop waiting (wrapped around checkpoint/manager.py: CheckpointManager.maybe_save), with ``checkpoint.async``
off and on.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

KEY = "model.layers.0.attention.wq.weight"


def train_and_time(overrides: dict, run_dir: str) -> list[float]:
    """Rank body: train the debug model with ``overrides``; returns the seconds each maybe_save that saved took."""
    import train
    from checkpoint.manager import CheckpointManager
    from runtime.config import load_config

    plain, seconds = CheckpointManager.maybe_save, []

    def timed(self, step, *args):
        start = time.perf_counter()
        plain(self, step, *args)
        if step % self.cfg.checkpoint.interval == 0 or step == self.cfg.training.steps:
            seconds.append(time.perf_counter() - start)

    CheckpointManager.maybe_save = timed
    base = {"run.dir": run_dir, "run.tensorboard": False}
    train.train(load_config(path="configs/debug.toml", overrides={**base, **overrides}))
    return seconds


def chunks(folder: Path) -> tuple[dict, list]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    kinds = {"tensors": sum(isinstance(m, TensorStorageMetadata) for m in meta.values())}
    kinds["small Python values"] = len(meta) - kinds["tensors"]
    return kinds, [(tuple(c.offsets), tuple(c.sizes)) for c in meta[KEY].chunks]


def files(world: int, run_dir: str) -> None:
    from launch.spawn import run_on_ranks

    overrides = {"parallel.dp_shard": world, "training.steps": 4, "checkpoint.interval": 4}
    run_on_ranks(train_and_time, world, overrides, run_dir, timeout=300)
    folder = Path(run_dir) / "checkpoints" / "step-4"
    kinds, saved = chunks(folder)
    print(f"dp_shard={world}: {folder.name}/")
    for path in sorted(folder.iterdir()):
        print(f"  {path.name:<16} {path.stat().st_size:>10,} bytes")
    print(
        f"  .metadata entries: {sum(kinds.values())} ({kinds['tensors']} tensors, {kinds['small Python values']} "
        f"small Python values)"
    )
    print(f"  {KEY} chunks (offsets, sizes): {saved}")


def timing() -> None:
    from launch.spawn import run_on_ranks

    print("seconds the training loop waited in each save (rank 0), 3 saves of the debug model")
    for world in (1, 4):
        for async_ in (False, True):
            with tempfile.TemporaryDirectory() as run_dir:
                overrides = {
                    "parallel.dp_shard": world,
                    "training.steps": 6,
                    "checkpoint.interval": 2,
                    "checkpoint.async": async_,
                }
                seconds = run_on_ranks(train_and_time, world, overrides, run_dir, timeout=300)[0]
            print(f"  world {world}, async {str(async_).lower():<5}: " + ", ".join(f"{s:.2f}" for s in seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true")
    if parser.parse_args().timing:
        timing()
        return
    for world in (4, 1):
        with tempfile.TemporaryDirectory() as run_dir:
            files(world, run_dir)


if __name__ == "__main__":
    from bench import dcp_files  # the ranks need an importable name, not __main__

    dcp_files.main()
