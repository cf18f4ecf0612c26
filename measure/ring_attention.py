"""Ring attention through fused kernels, measured: peak memory per rank against the local sequence, and time.

    python -m measure.ring_attention                  # CPU: 2 gloo ranks, local lengths 512 .. 4096 (~1 min)
    python -m measure.ring_attention --device cuda --dtype bf16 --cp 1 --lengths 16384     # one GPU

For each local length s_cp (tokens of the sequence per rank, s/cp), every rank runs
``mesh/context_parallel.py: ring_attention`` forward and backward on its s_cp queries (cp − 1 blocks arrive from
the other ranks, each through the fused kernel) and records the peak bytes of the tensors alive while it ran,
its inputs (q, k, v and the output's gradient) included: on CPU from the profiler's memory timeline (every
allocation, the kernels' own scratch included), on CUDA from the allocator's peak (nothing else is allocated in
this process). Beside it, on the same rank and the same s_cp tokens, plain SDPA
(``models/llama.py: causal_attention``, the one-device path), and for scale the bytes of the one fp32 score
tensor b·heads·s_cp² that an unfused block would create (arithmetic).

Linear memory: bytes / s_cp stays flat when s_cp doubles (the "x prev" column near 2), while a score tensor
grows 4x. Times are the median of ``--repeats`` runs after one warm-up (CPU: one thread per rank; the ranks
share this machine's cores, so read them as relative).

``main(argv)`` prints the table and returns it as a dict (``python -m measure.gpu_check`` calls it on a GPU;
with ``--cp 1`` the ring has one block and no messages, and the process group is a one-rank group made here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.options import MAX_LOCAL_RANKS, count_option, int_option, list_option

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 8, 2, 64


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes of the tensors alive while ``fn()`` runs, those it reads included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.profiler import ProfilerActivity, profile

    from observers.profiling import summarize_memory_timeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA (allocator history); CPU's only view
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        return summarize_memory_timeline(path).get("total", 0)


def seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up (synchronised on CUDA)."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative_difference(got, want) -> float:
    """The largest |got - want| over each pair of tensors, relative to that ``want``'s largest magnitude."""
    return max(
        ((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want, strict=True)
    )


def measure_length(tokens: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Peak bytes and time of ring attention and of plain SDPA on this rank's s_cp tokens, forward + backward."""
    from mesh.context_parallel import ring_attention
    from models.llama import causal_attention

    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    q, k, v = (
        torch.randn(BATCH, tokens, heads, HEAD_DIM, generator=gen, device=device, dtype=dtype, requires_grad=True)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    grad = torch.randn(BATCH, tokens, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)

    def ring():
        q.grad = k.grad = v.grad = None  # every call allocates its gradients: all calls alike
        ring_attention(q, k, v, group=dist.group.WORLD).backward(grad)

    def sdpa():
        q.grad = k.grad = v.grad = None
        causal_attention(q, k, v).backward(grad)

    row = {
        "s_cp": tokens,
        "ring_bytes": peak_bytes(ring, device),
        "sdpa_bytes": peak_bytes(sdpa, device),
        "ring_s": seconds(ring, device, repeats),
        "sdpa_s": seconds(sdpa, device, repeats),
        "score_bytes": 4 * BATCH * HEADS * tokens * tokens,
    }
    if dist.get_world_size() == 1:  # one rank's ring is the whole attention: it must equal SDPA's (gpu_check)
        ring()
        ring_grads = [t.grad.clone() for t in (q, k, v)]
        sdpa()
        with torch.no_grad():
            outs = ring_attention(q, k, v, group=dist.group.WORLD), causal_attention(q, k, v)
        row["out_rel_diff"] = relative_difference([outs[0]], [outs[1]])
        row["grad_rel_diff"] = relative_difference(ring_grads, (q.grad, k.grad, v.grad))
    return row


def measure_rank(lengths: list[int], device_name: str, dtype_name: str, repeats: int) -> list[dict]:
    """Rank body: ``measure_length`` for each local length, in order."""
    return [measure_length(tokens, torch.device(device_name), DTYPES[dtype_name], repeats) for tokens in lengths]


def measure_one_rank(lengths: list[int], device_name: str, dtype_name: str, repeats: int) -> list[dict]:
    """``--cp 1``: the ring has a single block and sends nothing; a one-rank group made here, and removed."""
    made = not dist.is_initialized()
    if made:
        backend = "nccl" if device_name == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return measure_rank(lengths, device_name, dtype_name, repeats)
    finally:
        if made:
            dist.destroy_process_group()


def measure(lengths: list[int], device_name: str, dtype_name: str, cp: int, repeats: int) -> dict:
    """Every rank's rows for each local length; per length the busiest rank's, with the ratios the table prints."""
    if device_name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if cp == 1:
        ranks = [measure_one_rank(lengths, device_name, dtype_name, repeats)]
    elif device_name == "cpu":
        from launch.spawn import run_on_ranks

        ranks = run_on_ranks(measure_rank, cp, lengths, "cpu", dtype_name, repeats, timeout=1800)
    else:
        raise SystemExit("--device cuda runs one rank in this process: pass --cp 1")
    # the busiest rank at each length (every rank holds s_cp queries and two blocks of s_cp keys at a time)
    rows = [max((r[i] for r in ranks), key=lambda row: row["ring_bytes"]) for i in range(len(lengths))]
    for prev, row in zip([None, *rows], rows, strict=False):
        row["ring_bytes_per_token"] = row["ring_bytes"] / row["s_cp"]
        row["ring_vs_prev"] = row["ring_bytes"] / prev["ring_bytes"] if prev else None
        row["ring_vs_sdpa"] = row["ring_bytes"] / row["sdpa_bytes"]
    result = {
        "device": device_name,
        "dtype": dtype_name,
        "cp": cp,
        "shape": {"batch": BATCH, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "rows": rows,
    }
    return result


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.ring_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cp", type=int_option(ge=1, le=MAX_LOCAL_RANKS), default=2, help="ranks in the ring (CPU: spawned gloo ranks)"
    )
    parser.add_argument(
        "--lengths",
        type=list_option(item=count_option()),
        default="512,1024,2048,4096",
        help="local tokens per rank (s_cp = s/cp), comma-separated",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--repeats", type=count_option(), default=3)
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    lengths = [int(n) for n in args.lengths.split(",")]
    result = measure(lengths, args.device, args.dtype, args.cp, args.repeats)
    rows = result["rows"]
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print(
        f"ring attention forward + backward on each of {args.cp} rank(s), {args.device} {args.dtype}: batch {BATCH}, "
        f"{HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}; peak bytes alive during the call, busiest rank"
    )
    print(
        f"{'s_cp':>8} {'ring bytes':>13} {'bytes/s_cp':>11} {'x prev':>7} {'SDPA bytes':>13} {'ring/SDPA':>9} "
        f"{'s_cp² fp32 scores':>18} {'ring s':>8} {'SDPA s':>8}"
    )
    for row in rows:
        prev = f"{row['ring_vs_prev']:7.2f}" if row["ring_vs_prev"] else f"{'':>7}"
        print(
            f"{row['s_cp']:>8} {row['ring_bytes']:>13,} {row['ring_bytes_per_token']:>11,.0f} {prev} "
            f"{row['sdpa_bytes']:>13,} {row['ring_vs_sdpa']:>9.2f} {row['score_bytes']:>18,} "
            f"{row['ring_s']:>8.3f} {row['sdpa_s']:>8.3f}"
        )
    first, last = rows[0], rows[-1]
    growth = last["s_cp"] / first["s_cp"]
    print(
        f"s_cp grew {growth:.0f}x: ring bytes {last['ring_bytes'] / first['ring_bytes']:.2f}x (linear: {growth:.0f}x), "
        f"one score tensor {last['score_bytes'] / first['score_bytes']:.0f}x"
    )
    return result


if __name__ == "__main__":
    main()
