"""What a DCP checkpoint of meshloom holds on disk.

    python -m measure.dcp_files            # docs/checkpointing.md, section 2 (about 30 s)

The first form trains the debug model for 4 steps on dp_shard = 4 gloo ranks, saving at step 4, then lists
the checkpoint's files with their sizes, counts ``.metadata``'s entries (tensors and small Python values) and
prints the saved chunks of one weight (offsets and sizes in the full tensor) next to a one-process save.
How long training stands still per save, synchronous against asynchronous: measure/async_save.py.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

KEY = "model.layers.0.attention.wq.weight"


def train_steps(overrides: dict, run_dir: str) -> None:
    """Rank body: train the debug model with ``overrides``."""
    import train
    from runtime.config import load_config

    base = {"run.dir": run_dir, "run.tensorboard": False}
    train.train(load_config(path="configs/debug.toml", overrides={**base, **overrides}))


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
    run_on_ranks(train_steps, world, overrides, run_dir, timeout=300)
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


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.dcp_files", description=__doc__.splitlines()[0])


def main() -> None:
    build_parser().parse_args()
    for world in (4, 1):
        with tempfile.TemporaryDirectory() as run_dir:
            files(world, run_dir)


if __name__ == "__main__":
    from measure import dcp_files  # the ranks need an importable name, not __main__

    dcp_files.main()
