"""Grouped-query attention: SDPA reading the k/v heads (``enable_gqa``) against repeating them first.

    python -m measure.attention_gqa            # about a minute on one CPU core

One ``models.llama.Attention`` at measure/tokens_per_second.py's shape (batch 8, sequence 512, dim 256, 16 heads, 4
key/value heads), forward and backward, fp32, one process. The two paths are the model's own:
``sdpa_reads_grouped_kv`` decides, and the "repeat" rows force its answer to False, which is what meshloom did
before (``repeat_interleave`` of k and v, then SDPA on n_heads). Timings alternate between the two paths,
``--rounds`` times, and the bench prints the median of each and their ratio, with the bytes autograd saves
(measure/saved_bytes.SavedBytes) and the largest difference between the two paths' outputs and gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from measure.saved_bytes import SavedBytes, storage_ptr
from models import llama
from models.llama import ModelArgs
from runtime.options import count_option

ARGS = ModelArgs(dim=256, n_layers=1, n_heads=16, n_kv_heads=4, vocab_size=2048, ffn_dim=768, max_seq_len=512)
BATCH, SEQ = 8, 512


def run(attention, x, cos, sin, grouped: bool, saved: SavedBytes | None = None):
    with mock.patch.object(llama, "sdpa_reads_grouped_kv", lambda q, mask: grouped):
        if saved is None:
            out = attention(x, cos, sin)
        else:
            with saved:
                out = attention(x, cos, sin)
        out.backward(torch.ones_like(out))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.attention_gqa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=count_option(), default=10)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    attention = llama.Attention(ARGS)
    cos, sin = llama.rotary_tables(ARGS.head_dim, SEQ, ARGS.rope_theta)
    x = torch.randn(BATCH, SEQ, ARGS.dim, requires_grad=True)
    params = {storage_ptr(p) for p in attention.parameters()} | {storage_ptr(cos), storage_ptr(sin)}
    results = {}
    for grouped in (True, False):
        attention.zero_grad()
        x.grad = None
        saved = SavedBytes(exclude=params | {storage_ptr(x)})
        out = run(attention, x, cos, sin, grouped, saved)
        results[grouped] = (out.detach(), x.grad.clone(), [p.grad.clone() for p in attention.parameters()], saved.total)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for grouped in (True, False):
            start = time.perf_counter()
            run(attention, x, cos, sin, grouped)
            times[grouped].append(time.perf_counter() - start)
    diff = max(  # relative to each tensor's largest value
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(
            [results[True][0], results[True][1], *results[True][2]],
            [results[False][0], results[False][1], *results[False][2]],
            strict=True,
        )
    )
    print(
        f"one Attention, fp32, CPU: batch {BATCH}, sequence {SEQ}, dim {ARGS.dim}, {ARGS.n_heads} heads, "
        f"{ARGS.n_kv_heads} kv heads; forward + backward, median of {args.rounds} alternating rounds"
    )
    print(f"{'path':<28} {'ms':>8} {'saved bytes':>13}")
    for grouped, label in ((False, "repeat k/v, then SDPA"), (True, "SDPA enable_gqa")):
        print(f"{label:<28} {statistics.median(times[grouped]) * 1e3:8.1f} {results[grouped][3]:13,}")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(
        f"enable_gqa is {ratio:.2f}x as fast; saves {results[False][3] - results[True][3]:,} bytes fewer; "
        f"largest difference in outputs and gradients: {diff:.1e} of the tensor's largest value"
    )


if __name__ == "__main__":
    main()
