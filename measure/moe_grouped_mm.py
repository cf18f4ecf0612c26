"""MoE experts as one grouped matmul against a Python loop over experts: throughput and host syncs.

    python -m measure.moe_grouped_mm                     # CPU, fp32 and bf16 (~30 s on one core)
    python -m measure.moe_grouped_mm --device cuda --dtypes bf16 --tokens 65536 --dim 2048 --hidden 1408

``models/moe.py: GroupedExperts`` has two ways to run its experts on rows sorted by expert: ``grouped`` (three
``torch._grouped_mm`` calls over all experts, models/kernels.py) and ``looped`` (one small matmul per expert,
the fallback). Both run here on the same rows and weights, forward and backward, alternating, ``--rounds``
times; the bench prints the median time of each, the rows per second, their ratio, the largest difference
between the two paths' outputs and gradients, and how many host syncs each made (``HostSyncCounter``: the
loop reads every expert's row count on the host first). Rows are routed with a skewed load (expert e gets
a share proportional to e + 1), as a router early in training would.

On CPU torch 2.13 runs ``_grouped_mm`` as one matmul per group itself (the profiler shows its ``aten::mm``
calls), so a difference there is the loop's own Python, splits and concatenation, not a faster kernel; on a
GPU the grouped call is one kernel for all experts, and no host sync. The printed ratio is whatever this
machine measures. ``main(argv)`` returns the table as a dict (``python -m measure.gpu_check`` calls it on a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from runtime.options import count_option, list_option

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def routed_counts(tokens: int, experts: int) -> torch.Tensor:
    """Rows per expert summing to ``tokens``, expert e's share proportional to e + 1."""
    share = torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (share / share.sum() * tokens).floor().long()
    counts[-1] += tokens - counts.sum()
    return counts


def run_path(path, x, counts, weights, grad) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward of ``path`` (GroupedExperts.grouped or .looped); returns output and gradients."""
    for t in (x, *weights):
        t.grad = None
    out = path(x, counts, *weights)
    out.backward(grad)
    return out.detach(), [x.grad, *(w.grad for w in weights)]


def measure(device: torch.device, dtype: torch.dtype, tokens: int, experts: int, dim: int, hidden: int, rounds: int):
    from measure.host_syncs import HostSyncCounter
    from models.kernels import grouped_mm_works
    from models.moe import GroupedExperts

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
    w1, w3 = (
        (torch.randn(experts, dim, hidden, device=device, generator=gen) / dim**0.5).to(dtype).requires_grad_()
        for _ in "13"
    )
    w2 = (torch.randn(experts, hidden, dim, device=device, generator=gen) / hidden**0.5).to(dtype).requires_grad_()
    grad = torch.randn(tokens, dim, device=device, dtype=dtype, generator=gen)
    counts = routed_counts(tokens, experts).to(device)
    weights = (w1, w2, w3)
    paths = {"looped": GroupedExperts.looped}
    if grouped_mm_works(device, dtype, ((dim, hidden), (hidden, dim))):
        paths["grouped"] = GroupedExperts.grouped
    results, syncs, times = {}, {}, {name: [] for name in paths}
    for name, path in paths.items():
        with HostSyncCounter() as counter:
            results[name] = run_path(path, x, counts, weights, grad)
        syncs[name] = counter.total()
    for _ in range(rounds):
        for name, path in paths.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run_path(path, x, counts, weights, grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    row = {
        "dtype": str(dtype).removeprefix("torch."),
        "grouped_mm_runs": "grouped" in paths,
        **{f"{name}_s": statistics.median(t) for name, t in times.items()},
        **{f"{name}_rows_per_s": tokens / statistics.median(t) for name, t in times.items()},
        **{f"{name}_host_syncs": n for name, n in syncs.items()},
    }
    if "grouped" in paths:
        row["grouped_speedup"] = row["looped_s"] / row["grouped_s"]
        (out_g, grads_g), (out_l, grads_l) = results["grouped"], results["looped"]
        rel = [
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip([out_g, *grads_g], [out_l, *grads_l], strict=True)
        ]
        row["forward_rel_diff"], row["backward_rel_diff"] = rel[0], max(rel[1:])
        row["max_rel_diff"] = max(rel)
    return row


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.moe_grouped_mm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtypes", type=list_option(choices=("fp32", "bf16")), default="fp32,bf16", help="comma-separated: fp32, bf16"
    )
    parser.add_argument(
        "--tokens",
        type=count_option(),
        default=4096,
        help="routed rows (tokens x top-k) on this device",
    )
    parser.add_argument("--experts", type=count_option(), default=8)
    parser.add_argument("--dim", type=count_option(), default=256)
    parser.add_argument("--hidden", type=count_option(), default=512)
    parser.add_argument("--rounds", type=count_option(), default=5)
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)  # one core, as each training rank here runs
    device = torch.device(args.device)
    rows = [
        measure(device, DTYPES[d], args.tokens, args.experts, args.dim, args.hidden, args.rounds)
        for d in args.dtypes.split(",")
    ]
    shape = {"tokens": args.tokens, "experts": args.experts, "dim": args.dim, "hidden": args.hidden}
    result = {"device": args.device, "shape": shape, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print(
        f"MoE experts (SwiGLU) forward + backward on {args.device}: {args.tokens} rows, {args.experts} experts, "
        f"dim {args.dim}, hidden {args.hidden}; median of {args.rounds} alternating rounds"
    )
    print(f"{'dtype':<9} {'path':<8} {'ms':>9} {'rows/s':>11} {'host syncs':>11}")
    for row in rows:
        for name in ("looped", "grouped"):
            if f"{name}_s" in row:
                print(
                    f"{row['dtype']:<9} {name:<8} {row[f'{name}_s'] * 1e3:9.1f} {row[f'{name}_rows_per_s']:11,.0f} "
                    f"{row[f'{name}_host_syncs']:11d}"
                )
        if row["grouped_mm_runs"]:
            print(
                f"{row['dtype']:<9} grouped is {row['grouped_speedup']:.2f}x the loop's speed; largest difference "
                f"{row['max_rel_diff']:.1e} of the tensor's largest value"
            )
        else:
            print(f"{row['dtype']:<9} torch._grouped_mm does not run here: the loop only")
    return result


if __name__ == "__main__":
    main()
