"""Gradient compression measured: bytes per step and the loss gap to exact reduction.

    .venv/bin/python -m measure.grad_compression               # 300 steps x 6 variants
    .venv/bin/python -m measure.grad_compression --steps 100   # a third of that: docs/dp_savers.md's table
    .venv/bin/python -m measure.grad_compression --links       # the bandwidth arithmetic only (no training)

The embedded default run (the debug model, Ψ = 853,120) on a pure data-parallel layout of 2 gloo ranks
(``parallel.dp_replicate 2``), trained ``--steps`` steps (the cosine schedule over those steps) once per
variant, from the same initial weights on the same data:

- ``exact``:        FSDP's all-reduce of the fp32 gradients (meshloom's default reduction);
- ``bf16``:         the same all-reduce in bf16 (``parallel.grad_compression bf16``);
- ``powersgd r1``:  DDP + torch's PowerSGD hook, rank 1 (``parallel.grad_compression powersgd``);
- ``powersgd r4``:  rank 4 (``parallel.powersgd_rank 4``).
- ``1-bit adam``:   1-bit Adam (``parallel.grad_compression onebit_adam``, savers/onebit_adam.py): exact Adam for
                    the first 20% of the steps (``ONEBIT_WARMUP_SHARE``), then the momentum sent as signs and one
                    scale per tensor;
- ``1-bit adam 10%``: the same with the variance frozen after 10% of the steps.

Per variant it prints the bytes of gradient reduction per step and rank (``measure/grad_traffic.py``: the
payload handed to the collectives, and what a ring sends for it), measured after PowerSGD's first two exact
steps (1-bit Adam: after its warm-up, and counted as the compressed size a real implementation sends, the
optimizer's own ``payload_bytes``: this reference all-reduces the decompressed values), and the loss gap to ``exact``: the largest per-step gap, and the gap of the mean loss over the last
50 steps (one step's loss is noisy; the mean is what training converges to).
"""

from __future__ import annotations

import argparse
import math
import tempfile

from measure.grad_traffic import GradientTraffic
from runtime.options import count_option, list_option

# 1-bit Adam's exact warm-up, as a share of the run: the paper warms up for 15-25% of its runs; the second
# variant freezes the variance at half that, while the loss still falls fast.
ONEBIT_WARMUP_SHARE = {"1-bit adam": 0.2, "1-bit adam 10%": 0.1}
VARIANTS = {
    "exact": {},
    "bf16": {"parallel.grad_compression": "bf16"},
    "powersgd r1": {"parallel.grad_compression": "powersgd", "parallel.powersgd_rank": 1},
    "powersgd r4": {"parallel.grad_compression": "powersgd", "parallel.powersgd_rank": 4},
    "1-bit adam": {"parallel.grad_compression": "onebit_adam"},
    "1-bit adam 10%": {"parallel.grad_compression": "onebit_adam"},
}
LAYOUT = {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}
TAIL = 50  # steps averaged for the converged-loss comparison


def train_counted(overrides: dict, run_dir: str) -> dict:
    """Rank body: train the embedded default with ``overrides``; losses and gradient bytes of every step."""
    import training.optimizer as optim
    from runtime.config import load_config
    from train import train

    # No replica check unless a variant asks (its all-reduce on the replicas' group would count as gradient bytes).
    base = {"run.dir": run_dir, "run.tensorboard": False, "run.log_every": 10**6, "debug.check_replicas": 0}
    cfg = load_config(overrides={**base, **overrides})
    payload, wire = [], []
    original_step = optim.Optimizers.step
    with GradientTraffic() as traffic:

        def step_and_record(self) -> None:  # the bytes of each step, read at its optimizer step
            original_step(self)
            onebit = getattr(self.optimizers[0], "payload_bytes", None)  # 1-bit Adam counts its compressed size
            sent = traffic.payload_bytes if onebit is None else onebit
            payload.append(sent - sum(payload))
            n = cfg.parallel.dp_replicate
            wire.append((traffic.wire_bytes if onebit is None else 2 * (n - 1) / n * onebit) - sum(wire))

        optim.Optimizers.step = step_and_record
        try:
            records = train(cfg)
        finally:
            optim.Optimizers.step = original_step
    out = {"loss": [r["loss"] for r in records], "payload": payload, "wire": wire, "calls": dict(traffic.calls)}
    if cfg.parallel.grad_compression == "onebit_adam":
        out["exact_steps"] = cfg.parallel.onebit_warmup_steps
    return out


def onebit_warmup(name: str, steps: int) -> int:
    """Exact steps before 1-bit Adam compresses: its share of the run, at least 1."""
    return max(1, round(ONEBIT_WARMUP_SHARE[name] * steps))


def run_variants(steps: int, variants: dict = VARIANTS, world: int = 2, timeout: float = 1800) -> dict[str, dict]:
    from launch.spawn import run_on_ranks

    out = {}
    with tempfile.TemporaryDirectory(prefix="meshloom-compression-") as tmp:
        for name, knobs in variants.items():
            overrides = {**LAYOUT, "parallel.dp_replicate": world, "training.steps": steps}
            if name in ONEBIT_WARMUP_SHARE:  # a warm-up given in the variant's knobs wins
                overrides["parallel.onebit_warmup_steps"] = onebit_warmup(name, steps)
            overrides.update(knobs)
            out[name] = run_on_ranks(
                train_counted, world, overrides, f"{tmp}/{name.replace(' ', '_')}", timeout=timeout
            )[0]
    return out


def summarize(results: dict[str, dict], tail: int = TAIL) -> list[dict]:
    exact = results["exact"]["loss"]
    tail = min(tail, len(exact))
    exact_tail = sum(exact[-tail:]) / tail
    rows = []
    for name, r in results.items():
        exact_steps = r.get("exact_steps", 2)  # PowerSGD's two exact steps, or 1-bit Adam's warm-up
        steady = r["payload"][exact_steps:] or r["payload"]
        steady_wire = r["wire"][exact_steps:] or r["wire"]
        mean_tail = sum(r["loss"][-tail:]) / tail
        rows.append(
            {
                "variant": name,
                "payload": sum(steady) / len(steady),
                "wire": sum(steady_wire) / len(steady_wire),
                "max_gap": max(abs(a - e) / e for a, e in zip(r["loss"], exact, strict=True)),
                "tail_loss": mean_tail,
                "tail_gap": (mean_tail - exact_tail) / exact_tail,
            }
        )
    return rows


def print_table(rows: list[dict], steps: int) -> None:
    exact = rows[0]["payload"]
    warmups = [
        f"{r['variant']}: after its warm-up of {onebit_warmup(r['variant'], steps)} steps"
        for r in rows
        if r["variant"] in ONEBIT_WARMUP_SHARE
    ]
    print(
        f"embedded default model, dp_replicate 2 (gloo), {steps} steps; bytes per step and rank, after step 2"
        + (f" ({'; '.join(warmups)})" if warmups else "")
    )
    print(
        f"{'variant':<14} {'payload B':>11} {'ring wire B':>12} {'vs exact':>9} {'max step gap':>13} "
        f"{'loss, last ' + str(min(TAIL, steps)):>15} {'gap':>8}"
    )
    for r in rows:
        print(
            f"{r['variant']:<14} {r['payload']:>11,.0f} {r['wire']:>12,.0f} {exact / r['payload']:>8.1f}x "
            f"{r['max_gap']:>12.2%} {r['tail_loss']:>15.4f} {r['tail_gap']:>+8.2%}"
        )


# ---- the bandwidth arithmetic of docs/dp_savers.md section 3 -----------------------------------------------

LINKS = {  # bytes per second per rank, one direction: round figures for the three kinds of link
    "NVLink (H100, 450 GB/s)": 450e9,
    "InfiniBand NDR (400 Gb/s)": 50e9,
    "cross-region (10 Gb/s)": 1.25e9,
}


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int) -> int:
    """Elements PowerSGD all-reduces for these gradients: (n + m) r per matrix it compresses, the rest whole.

    torch's hook compresses a matrix only when that saves at least ``min_compression_rate`` = 2x.
    """
    total = 0
    for shape in shapes:
        if len(shape) < 2:
            total += math.prod(shape)
            continue
        n, m = shape[0], math.prod(shape[1:])
        total += (n + m) * rank if n * m >= 2 * (n + m) * rank else n * m
    return total


def llama8b_shapes() -> list[tuple[int, ...]]:
    from models.presets import PRESETS

    args = PRESETS["llama3-8b"]
    head_dim = args.dim // args.n_heads
    per_layer = [
        (args.n_heads * head_dim, args.dim),
        (args.n_kv_heads * head_dim, args.dim),
        (args.n_kv_heads * head_dim, args.dim),
        (args.dim, args.n_heads * head_dim),
        (args.hidden_dim, args.dim),
        (args.hidden_dim, args.dim),
        (args.dim, args.hidden_dim),
        (args.dim,),
        (args.dim,),
    ]
    shapes = [(args.vocab_size, args.dim), *per_layer * args.n_layers, (args.dim,), (args.vocab_size, args.dim)]
    assert sum(math.prod(s) for s in shapes) == args.num_params(), "the shapes must be the whole model"
    return shapes


def payloads() -> dict[str, int]:
    """Bytes one rank contributes to Llama-3 8B's gradient exchange, per variant (the link table's rows)."""
    shapes = llama8b_shapes()
    psi = sum(math.prod(s) for s in shapes)
    return {
        "fp32": 4 * psi,
        "bf16": 2 * psi,
        "PowerSGD r4": 4 * powersgd_elements(shapes, 4),
        "PowerSGD r1": 4 * powersgd_elements(shapes, 1),
        "1-bit Adam": sum(math.ceil(math.prod(s) / 8) + 4 for s in shapes),  # signs + one fp32 scale a tensor
    }


def link_table(n: int = 64) -> None:
    variants = payloads()
    psi = variants["fp32"] // 4
    ring = 2 * (n - 1) / n
    print(f"llama3-8b, Ψ = {psi / 1e9:.2f}B: seconds per gradient all-reduce (ring over n = {n}: {ring:.2f} x payload)")
    print(f"{'payload':<12} {'bytes':>9} " + " ".join(f"{link:>26}" for link in LINKS))
    for name, payload in variants.items():
        cells = " ".join(f"{ring * payload / bw:>25.3g}s" for bw in LINKS.values())
        print(f"{name:<12} {payload / 1e9:>7.3f}GB {cells}")


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.grad_compression", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=count_option(), default=300)
    parser.add_argument("--links", action="store_true", help="print the bandwidth arithmetic only")
    parser.add_argument(
        "--variants",
        type=list_option(choices=tuple(VARIANTS)),
        default=",".join(VARIANTS),
        help="comma-separated, among: " + ", ".join(VARIANTS),
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.links:
        link_table()
        return
    names = ["exact", *(n.strip() for n in args.variants.split(",") if n.strip() != "exact")]  # exact: the baseline
    print_table(summarize(run_variants(args.steps, {n: VARIANTS[n] for n in names})), args.steps)


if __name__ == "__main__":
    main()
