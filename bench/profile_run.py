"""Profile a whole meshloom run with torch.profiler, from outside train.py (docs/combining.md, section 9).

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 bench/profile_run.py --config configs/debug.toml \\
        --training.steps 2 --run.dir runs/profiled [--record-shapes]

Takes the same arguments as train.py (plus ``--record-shapes``), runs ``train.train`` inside
``torch.profiler.profile`` and writes one Chrome trace per rank, ``<run.dir>/trace_rank<R>.json`` (open it in
Perfetto or chrome://tracing), then prints the trace's size and how many FSDP ranges it holds. With
``--record-shapes`` the profiler keeps references to tensors while the model is built, and
``mesh/materialize.py: materialize_weights`` (``model.to_empty``) fails; the script says so instead of
writing a trace. Profiling only some steps, with a schedule, needs a hook inside train.py's loop.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import train
from config import load_config


def main(argv: list[str]) -> None:
    record_shapes = "--record-shapes" in argv
    cfg = load_config([a for a in argv if a != "--record-shapes"])  # the same overrides as train.py
    rank = os.environ.get("RANK", "0")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with profile(activities=activities, record_shapes=record_shapes) as prof:
            train.train(cfg)
    except RuntimeError as exc:
        print(f"rank {rank}: profiling failed: {str(exc).splitlines()[0]}", flush=True)
        raise
    finally:
        train.destroy_process_group()
    path = f"{cfg.run.dir}/trace_rank{rank}.json"
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    fsdp = sorted({e["name"].split(" ")[0] for e in events if e.get("name", "").startswith("FSDP::")})
    print(f"rank {rank}: {path}, {os.path.getsize(path) / 1e6:.1f} MB, {len(events):,} events; FSDP ranges: {fsdp}")


if __name__ == "__main__":
    main(sys.argv[1:])
