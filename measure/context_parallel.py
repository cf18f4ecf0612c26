"""Context parallelism, measured: activation memory per rank against cp, and the bytes each algorithm sends.

    .venv/bin/python -m measure.context_parallel        # from the repository root (10-45 s on 2 cores)

1. **Activation memory.** What autograd keeps from one TransformerBlock's forward on one rank, counted with
   measure/saved_bytes.py's ``SavedBytes`` (distinct storages, parameters and buffers left out), for
   cp = 1, 2, 4 and both algorithms, next to the formula below. The block is the debug model's shape at a
   longer sequence; with cp each rank's input is its n = s/cp tokens, and ``apply_context_parallel`` swaps
   the attention as in training.
2. **Communication.** Per layer and rank, forward plus backward, the bytes each algorithm sends: read off the
   collectives and point-to-point sends it issues (a dispatch mode sees each op and its tensor), counted
   the way ring algorithms move them (an all-gather or reduce-scatter over cp ranks sends (cp − 1)/cp of
   the gathered size per rank), next to the formula.

Formulas, per layer and rank, in elements (x 4 bytes in fp32), for batch b, sequence s, n = s/cp tokens per
rank, L = s/(2cp) per chunk, model dim h, kv width g = kv_heads x head_dim, SwiGLU hidden H, a query heads:

    outside attention (norms, matmul inputs, SwiGLU)   4bnh + 2bn + 4bnH          (n = s on one process)
    one process:  q; k, v at kv heads; output; lse     2bsh + 2bsg + abs
    ring:         q; k, v at kv heads; output; lse     2bnh + 2bng + abn          (nothing of size s)
    allgather:    q; all s keys and values at kv heads, in global order (every block is a view of them);
                  output; lse                          2bnh + 2bsg + abn

Both keep only what the fused kernels' backward reads (mesh/context_parallel.py, docstring 5): no score
tensor, no mask, no index.

Sent per layer and rank, with M = 2bng elements (this rank's K and V):

    allgather   all-gather M forward, reduce-scatter dK, dV backward     2(cp − 1) M
    ring        cp − 1 K/V hops forward; cp − 1 K/V hops and cp dK/dV    (3cp − 2) M
                hops backward (dK/dV accumulate in fp32 whatever the compute dtype)

The ring sends more (about 1.5x at cp = 4) but holds no tensor of size s, and each hop can overlap a
block's compute; the all-gather holds all keys.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from measure.saved_bytes import SavedBytes, storage_ptr
from models.llama import ModelArgs

# The debug model's width (dim 128, 8 heads) with GQA 4:1, at 16x its sequence length.
BENCH_ARGS = ModelArgs(dim=128, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=64)
BATCH, SEQ = 1, 2048
ROWS = ((1, "none"), (2, "allgather"), (2, "ring"), (4, "allgather"), (4, "ring"))


def measure_block(args: ModelArgs, batch: int, seq: int, algorithm: str) -> dict:
    """Bytes autograd saves in one block's forward on this rank (cp = the world size, or 1 without a group)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mesh.context_parallel import apply_context_parallel
    from models.llama import Transformer

    cp = dist.get_world_size() if dist.is_initialized() else 1
    with torch.device("meta"):
        model = Transformer(args)
    model.init_weights(seed=0)
    if cp > 1:
        apply_context_parallel(model, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), algorithm, seq)
    x = torch.randn(batch, seq // cp, args.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    state = {storage_ptr(t) for t in (*model.parameters(), *model.buffers())}
    with SavedBytes(exclude=state) as saved:
        out = model.layers["0"](x, model.rope_cos, model.rope_sin)
    out.sum().backward()  # the saved tensors were enough for backward
    return {"bytes": saved.total, "rank": dist.get_rank() if cp > 1 else 0}


def formula_bytes(args: ModelArgs, batch: int, seq: int, cp: int, rank: int, algorithm: str) -> int:
    """The module docstring's formula, in bytes (fp32), for cp rank ``rank`` (every rank keeps the same)."""
    b, h, hidden, a = batch, args.dim, args.hidden_dim, args.n_heads
    g = args.n_kv_heads * args.head_dim
    n = seq // cp
    outside = 4 * b * n * h + 2 * b * n + 4 * b * n * hidden  # norms: their input and rsqrt (models/llama.py)
    if cp == 1:
        return 4 * (outside + 2 * b * seq * h + 2 * b * seq * g + a * b * seq)
    keys = n if algorithm == "ring" else seq  # the ring holds this rank's keys; the all-gather every rank's
    return 4 * (outside + 2 * b * n * h + 2 * b * keys * g + a * b * n)


class SentBytes(TorchDispatchMode):
    """Bytes this rank sends through the collectives and sends it issues (ring-algorithm accounting)."""

    def __init__(self, group_size: int):
        super().__init__()
        self.n, self.sent, self.ops = group_size, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "send"):
            tensor = args[0][0] if name == "send" else args[0]
            nbytes = tensor.numel() * tensor.element_size()
            # all-gather: each rank passes on the n - 1 pieces that are not its own; reduce-scatter of an input of
            # n pieces: n - 1 partial pieces leave each rank; a send sends its tensor
            self.sent += {
                "all_gather_into_tensor": (self.n - 1) * nbytes,
                "reduce_scatter_tensor": (self.n - 1) * nbytes // self.n,
                "send": nbytes,
            }[name]
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def measure_comm(args: ModelArgs, batch: int, seq: int, algorithm: str) -> dict:
    """Rank body: bytes one attention layer's cp exchange sends from this rank, forward + backward."""
    from mesh.context_parallel import allgather_attention, ring_attention

    cp, gen = dist.get_world_size(), torch.Generator().manual_seed(2)
    n = seq // cp
    q = torch.randn(batch, n, args.n_heads, args.head_dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(batch, n, args.n_kv_heads, args.head_dim, generator=gen, requires_grad=True) for _ in "kv")
    attend = allgather_attention if algorithm == "allgather" else ring_attention
    with SentBytes(cp) as sent:
        attend(q, k, v, group=dist.group.WORLD).sum().backward()
    return {"bytes": sent.sent, "ops": sent.ops}


def formula_comm(args: ModelArgs, batch: int, seq: int, cp: int, algorithm: str) -> int:
    kv = 2 * batch * (seq // cp) * args.n_kv_heads * args.head_dim * 4  # M, in fp32 bytes
    return 2 * (cp - 1) * kv if algorithm == "allgather" else (3 * cp - 2) * kv


def memory_table(args: ModelArgs = BENCH_ARGS, batch: int = BATCH, seq: int = SEQ, rows=ROWS) -> list[dict]:
    from launch.spawn import run_on_ranks

    table = []
    for cp, algorithm in rows:
        ranks = (
            [measure_block(args, batch, seq, algorithm)]
            if cp == 1
            else run_on_ranks(measure_block, cp, args, batch, seq, algorithm, timeout=600)
        )
        formulas = [formula_bytes(args, batch, seq, cp, r["rank"], algorithm) for r in ranks]
        table.append({"cp": cp, "algorithm": algorithm, "bytes": [r["bytes"] for r in ranks], "formula": formulas})
    return table


def comm_table(args: ModelArgs = BENCH_ARGS, batch: int = BATCH, seq: int = SEQ, cps=(2, 4)) -> list[dict]:
    from launch.spawn import run_on_ranks

    table = []
    for cp in cps:
        for algorithm in ("allgather", "ring"):
            ranks = run_on_ranks(measure_comm, cp, args, batch, seq, algorithm, timeout=600)
            table.append(
                {
                    "cp": cp,
                    "algorithm": algorithm,
                    "bytes": ranks[0]["bytes"],
                    "ops": ranks[0]["ops"],
                    "same_on_every_rank": len({r["bytes"] for r in ranks}) == 1,
                    "formula": formula_comm(args, batch, seq, cp, algorithm),
                }
            )
    return table


def build_parser() -> argparse.ArgumentParser:
    """No options: any is refused (tests/test_input_walk.py walks every tool's parser)."""
    return argparse.ArgumentParser(prog="python -m measure.context_parallel", description=__doc__.splitlines()[0])


def main() -> None:
    args, b, s = BENCH_ARGS, BATCH, SEQ
    print(
        f"one TransformerBlock, fp32: b={b} s={s} h={args.dim} H={args.hidden_dim} heads={args.n_heads} "
        f"kv_heads={args.n_kv_heads}"
    )
    print("1. activation bytes autograd saves per rank (largest rank; parameters and buffers excluded)")
    print(
        f"{'cp':>3} {'algorithm':<10} {'measured':>12} {'/ cp=1':>7} {'formula':>12} {'meas/form':>10} {'ranks differ by':>16}"
    )
    rows = memory_table()
    one = rows[0]["bytes"][0]
    for r in rows:
        worst = max(r["bytes"])
        formula = r["formula"][r["bytes"].index(worst)]
        print(
            f"{r['cp']:>3} {r['algorithm']:<10} {worst:>12,} {worst / one:>7.3f} {formula:>12,} {worst / formula:>10.4f} "
            f"{max(r['bytes']) - min(r['bytes']):>16,}"
        )
    print("2. bytes sent per layer and rank, forward + backward (fp32)")
    print(f"{'cp':>3} {'algorithm':<10} {'ops issued':<52} {'measured':>11} {'formula':>11}")
    for r in comm_table():
        ops = ", ".join(f"{n} x {op}" for op, n in r["ops"].items())
        print(f"{r['cp']:>3} {r['algorithm']:<10} {ops:<52} {r['bytes']:>11,} {r['formula']:>11,}")
    print("formulas: measure/context_parallel.py's docstring and docs/context_parallel.md, section 6")


if __name__ == "__main__":
    build_parser().parse_args()
    main()
