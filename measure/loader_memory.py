"""The loader's resident memory with a token file 10x larger: flat for the memory map, 10x for an in-memory copy.

    .venv/bin/python -m measure.loader_memory                  # 20M and 200M tokens (40 MB and 400 MB files)
    .venv/bin/python -m measure.loader_memory --tokens 5000000 # smaller

1. Write two prepared folders (data/token_file.py: tokens.bin + header.json) of N and 10N random uint16
   tokens into a temporary folder, in chunks (this process never holds a whole file).
2. For each folder, a fresh process opens it the way train.py does (``data.token_file.open_tokens``: a
   read-only ``numpy.memmap``) behind a ``GlobalBatchLoader``, and reads 200 global batches (8 x 512
   tokens) at positions spread evenly over the whole file (``load_state_dict`` jumps there), so the big
   file is read from its beginning to its end. It reports its resident memory (VmRSS of /proc/self/status)
   after the imports and after the reads, split into anonymous memory (RssAnon: what the process itself
   allocated) and mapped file pages (RssFile: shared libraries, plus any page of tokens.bin still mapped;
   ``TokenMap`` gives those back after each read, without which the kernel's large fault-around blocks
   left the whole 400 MB file resident after these 200 reads).
3. For contrast, the same process shape loads the whole file into memory (``np.fromfile``), as a loader
   without a memory map would.

Both figures come from one run of this script; compare the rows, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.options import count_option, path_option

BATCHES, GLOBAL_BATCH, SEQ_LEN = 200, 8, 512


def status_kib() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, in KiB (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def write_folder(folder: Path, n_tokens: int, seed: int) -> None:
    """Step 1: a prepared folder of ``n_tokens`` random ids, written 1M tokens at a time."""
    import numpy as np

    from data.token_file import TokenFileWriter

    writer = TokenFileWriter(folder, "uint16")
    rng = np.random.default_rng(seed)
    for start in range(0, n_tokens, 1 << 20):
        writer.append(rng.integers(0, 50_000, min(1 << 20, n_tokens - start), dtype=np.uint16))
    writer.finish({"num_documents": 1, "tokenizer": {"name": "random", "sha256": "none"}, "source": "bench"})


def child(folder: str, mode: str) -> dict:
    """Step 2 (mode "mmap") or 3 (mode "in-memory"), in a fresh process."""
    import numpy as np
    import torch

    from data.loader import GlobalBatchLoader
    from data.token_file import open_tokens, read_header

    torch.set_num_threads(1)
    before = status_kib()
    header = read_header(folder)
    if mode == "mmap":
        tokens = open_tokens(folder, header)
    else:
        tokens = np.fromfile(Path(folder) / "tokens.bin", dtype="<u2")
    loader = GlobalBatchLoader(
        tokens, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH, dp_rank=0, dp_size=1
    )
    checksum = 0
    span = header["num_tokens"] - GLOBAL_BATCH * SEQ_LEN - 1
    for i in range(BATCHES):
        loader.load_state_dict({"tokens_consumed": i * span // BATCHES})
        for inputs, _ in loader.next_batch():
            checksum += int(inputs[:, 0].sum())
    after = status_kib()
    return {"before": before, "after": after, "num_tokens": header["num_tokens"], "checksum": checksum}


def measure(folder: Path, mode: str) -> dict:
    cmd = [sys.executable, "-m", "measure.loader_memory", "--child", str(folder), "--mode", mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.loader_memory", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokens",
        type=count_option(),
        default=20_000_000,
        help="N: the small file; the large one is 10N",
    )
    parser.add_argument("--child", type=path_option(), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("mmap", "in-memory"), default="mmap", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child, opts.mode)))
        return
    mib = 1024
    with tempfile.TemporaryDirectory(prefix="meshloom-loader-bench-") as tmp:
        rows = []
        for scale in (1, 10):
            folder = Path(tmp) / f"x{scale}"
            write_folder(folder, opts.tokens * scale, seed=scale)
            for mode in ("mmap", "in-memory"):
                r = measure(folder, mode)
                rows.append((scale, mode, r))
        print(
            f"loader resident memory after {BATCHES} global batches of {GLOBAL_BATCH} x {SEQ_LEN} tokens spread "
            "over the whole file (MiB; 'after imports' is torch + numpy + meshloom)"
        )
        print(
            f"{'file':>16} {'loader':>10} {'after imports':>14} {'VmRSS':>8} {'RssAnon':>8} {'RssFile':>8} {'peak':>8}"
        )
        for scale, mode, r in rows:
            size = f"{r['num_tokens'] * 2 / 1e6:,.0f} MB ({scale}x)"
            a = r["after"]
            print(
                f"{size:>16} {mode:>10} {r['before']['VmRSS'] / mib:14.0f} {a['VmRSS'] / mib:8.0f} "
                f"{a['RssAnon'] / mib:8.0f} {a['RssFile'] / mib:8.0f} {a['VmHWM'] / mib:8.0f}"
            )
        grow = {
            mode: [r["after"]["VmRSS"] - r["before"]["VmRSS"] for _, m, r in rows if m == mode]
            for mode in ("mmap", "in-memory")
        }
        for mode, (small, large) in grow.items():
            print(
                f"{mode:>10}: the loader adds {small / mib:7.1f} MiB with the 1x file and {large / mib:7.1f} MiB "
                f"with the 10x file ({large / max(small, 1):.1f}x)"
            )


if __name__ == "__main__":
    main()
