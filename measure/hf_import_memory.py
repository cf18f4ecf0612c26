"""Peak host memory per rank while importing safetensors under FSDP 4: each rank's slice vs the full tensor.

    .venv/bin/python -m measure.hf_import_memory                   # vocabulary 131,072 x dim 512: 256 MiB in fp32
    .venv/bin/python -m measure.hf_import_memory --vocab 32768     # smaller

1. Write a model folder whose largest tensors (the embedding and the output head, vocab x dim in fp32) are
   much larger than one rank's piece of them (a quarter, under FSDP 4): checkpoint/hf.export_safetensors
   of a 2-layer model with a large vocabulary, random values written tensor by tensor.
2. On 4 fresh gloo ranks (launch/spawn.py), each rank builds the model on the meta device, shards every
   block and the whole model with FSDP2 over a 1-D mesh of 4 (every parameter ``Shard(0)``), allocates its
   pieces and writes zeros into them (so their pages are resident before the measurement), then resets its resident-memory high-water mark (``echo 5 > /proc/self/clear_refs``, which sets
   VmHWM back to the current VmRSS) and runs checkpoint/hf.import_safetensors: once reading only its own
   rows (``get_slice(name)[rows]``, the default) and, in another fresh set of ranks, reading each full
   tensor and cutting it (``sliced=False``).
3. Each rank reports VmHWM - VmRSS before the import: the most memory the import itself held at once,
   anonymous (tensors read) and file-backed (pages of the safetensors file mapped while being read)
   together. The table prints the largest over the ranks for both modes and their ratio, for a folder in
   bf16 (as published Llama folders are; meshloom's weights are fp32) and one in fp32.

What it shows: safetensors hands out tensors that are views of the memory-mapped file, so with a file
already in the model's dtype a full read that is then cut touches only the rows it keeps (the two reads
differ by the contiguous copy of the piece). A bf16 file must be converted: the full read converts the
whole tensor to fp32 on every rank (full size x 2, plus the pages it reads), the sliced read only the piece.
Both figures come from one run of this script; compare the rows, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from runtime.options import count_option

WORLD = 4


def status_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def model_args(vocab: int, dim: int):
    from models.llama import ModelArgs

    return ModelArgs(dim=dim, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=vocab, multiple_of=64)


def write_folder(folder: Path, vocab: int, dim: int, dtype: str) -> int:
    """Step 1; returns the largest tensor's size in bytes (as the model holds it: fp32)."""
    import torch

    from checkpoint.hf import export_safetensors
    from models.llama import Transformer

    args = model_args(vocab, dim)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(args).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    state = {
        name: (torch.randn(shape, generator=gen) * 0.02).to(getattr(torch, dtype)) for name, shape in shapes.items()
    }
    export_safetensors(state, args, folder)
    return max(t.numel() * 4 for t in state.values())


def rank_import(folder: str, vocab: int, dim: int, sliced: bool) -> dict:
    """Step 2-3 on one rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checkpoint.hf import import_safetensors
    from models.llama import Transformer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(model_args(vocab, dim))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():  # touch every page of the pieces now: the import's copies then add nothing
            p.to_local().zero_()
    piece = max(p.to_local().numel() * 4 for p in model.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib()
    import_safetensors([model], folder, sliced=sliced)
    after = status_kib()
    return {"peak_kib": after["VmHWM"] - before["VmRSS"], "reset": before["VmHWM"] <= before["VmRSS"], "piece": piece}


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.hf_import_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=count_option(), default=131072)
    parser.add_argument("--dim", type=count_option(), default=512)
    return parser


def main(argv: list[str] | None = None) -> None:
    from launch.spawn import run_on_ranks

    parser = build_parser()
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshloom-hf-import-") as tmp:
        rows = {}
        for dtype in ("bfloat16", "float32"):
            folder = Path(tmp) / dtype
            largest = write_folder(folder, opts.vocab, opts.dim, dtype)
            for sliced in (True, False):
                results = run_on_ranks(rank_import, WORLD, str(folder), opts.vocab, opts.dim, sliced, timeout=600)
                assert all(r["reset"] for r in results), "VmHWM was not reset: /proc/self/clear_refs not writable"
                rows[dtype, sliced] = max(r["peak_kib"] for r in results) / 1024
        piece = results[0]["piece"]
    mib = 2**20
    print(
        f"FSDP {WORLD}: largest tensor {largest / mib:,.0f} MiB in fp32, one rank's piece of it {piece / mib:,.0f} MiB"
    )
    print(f"{'file dtype':<12} {'sliced read (MiB)':>18} {'full read (MiB)':>16} {'full / sliced':>14}")
    for dtype in ("bfloat16", "float32"):
        sliced, full = rows[dtype, True], rows[dtype, False]
        print(f"{dtype:<12} {sliced:>18,.0f} {full:>16,.0f} {full / sliced:>13.1f}x")
    print("peak host memory per rank during the import (VmHWM - VmRSS before; the largest over the 4 ranks)")


if __name__ == "__main__":
    main()
