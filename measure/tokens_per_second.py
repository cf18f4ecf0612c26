"""Tokens per second of meshloom against a plain PyTorch loop, and of each layout against one process.

    python -m measure.tokens_per_second                          # the default set, about 8 minutes on 2 CPU cores
    python -m measure.tokens_per_second --layouts plain,one --rounds 4      # just the 1-process overhead
    python -m measure.tokens_per_second --compile                # eager and compiled, side by side (the compile set)
    python -m measure.tokens_per_second --moe                    # adds MoE runs (configs/debug_moe.toml shape)
    python -m measure.tokens_per_second --gpu-1b                 # on a GPU: a Llama-3.2-1B-shaped model in bf16

Every run is a fresh set of processes (tests/harness.run_on_ranks: gloo ranks from a forkserver that has
imported torch already) training the same model on the same data. The runs are *interleaved*: round 1 runs
every layout once, round 2 again in reverse order, and so on; a layout's figure is the median over its rounds
of the median step. This machine's speed drifts by up to 1.6x between minutes (other jobs share its 2 cores), so only
ratios taken from one invocation mean anything, and the per-round ratios show how stable they are.

What is timed, per step (medians over steps > ``--warmup``):

- ``plain``: a plain PyTorch loop (``PlainLoop``): ``models.llama.Transformer``, AdamW (foreach, no decay on
  1-D weights), warmup + cosine, gradient clipping, the same loss, the same batches from ``data/``. It runs
  in the same process as the ``one`` layout, *step by step in turn with it*: after each meshloom step, one
  plain step (its time is taken out of meshloom's). Two runs a minute apart can differ by 30% here; two
  neighbouring steps of one process share the machine's state, so the overhead of meshloom against plain
  PyTorch is read from these pairs.
- meshloom layouts: ``train.train`` with the layout's overrides. ``full`` is the same start-to-start time
  (measured by wrapping ``training.step.clock_reading``, which train_step calls at the start and the end of each
  step's timed window), so it includes everything train.py does per step: logging, checkpoint checks, the
  stop agreement. ``window_tokens_per_s`` in metrics.jsonl times only the window, and is printed as ``window``.

For the one-process pair the bench also prints *CPU time* per step (``time.process_time`` at the same points):
a one-process run's CPU time is the work its own code does, which other jobs on the machine barely change, so
it shows meshloom's overhead even when the wall-clock ratios swing with the load.

``CPU s`` is the CPU time of rank 0's process per step: the work a rank does, compute and its share of the
collectives, without the time it waits; where the wall-clock ratios swing with the machine's load, it shows
what a change removed from each rank's work.

``--compile`` runs every layout eagerly and compiled (``training.compile=true``) in the same rounds; without
``--layouts`` the layouts are the compile set: one process, FSDP 2, TP 2, FSDP 2 x TP 2, EP 2 and CP 2. A compiled
row's ratio is against the same layout run eagerly, and two more columns say what compiling cost: ``1st +s``, the
first step's time less a steady step's (the compilation, as the step that compiles pays it; eager rows show
their own first-step overhead beside it), and ``recomp``, the frames dynamo compiled after the first step
(metrics.jsonl's ``compiled_frames``: a layout that recompiles as the routing or the shapes change shows it
here). A layout meshloom refuses to compile (planning/layout_rules.py: ``compile_errors``) gets its row with the
reason instead of figures.

The plain loop and meshloom must compute the same thing: the bench prints the largest relative difference
between their losses (same initial weights, same data, same arithmetic: it is 0 or round-off).

TFLOP/s per device come from ``flops.flops_per_token`` (model FLOPs: recomputation does not count); MFU needs
``--peak-tflops`` on a CPU. The model is the issue's: dim 256, 6 layers, 16 heads (4 kv heads), vocabulary
2,048, SwiGLU 768, sequences of 512, 8 per step, fp32, selective activation checkpointing for the layouts
(``--ac``), none for the plain-vs-meshloom pair.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from launch.spawn import RankFailure, run_on_ranks
from runtime.options import count_option, float_option, list_option, override_option

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")
MOE = str(ROOT / "configs" / "debug_moe.toml")

# The shape of the measurements (docs/profiling.md, section 7).
SHAPE = {
    "model.dim": 256,
    "model.n_layers": 6,
    "model.n_heads": 16,
    "model.n_kv_heads": 4,
    "model.vocab_size": 2048,
    "model.ffn_dim": 768,
    "training.seq_len": 512,
    "training.global_batch": 8,
    "model.max_seq_len": 512,
}
MOE_SHAPE = {**SHAPE, "model.n_experts": 8, "model.top_k": 2, "model.moe_ffn_dim": 384}

# name -> (ranks, config, overrides); "plain" is the plain PyTorch loop.
LAYOUTS: dict[str, tuple[int, str, dict]] = {
    "plain": (1, DEBUG, {"training.activation_checkpoint": "none"}),
    "one": (1, DEBUG, {"training.activation_checkpoint": "none"}),
    "one-ac": (1, DEBUG, {}),
    "fsdp2": (2, DEBUG, {"parallel.dp_shard": 2}),
    "tp2": (2, DEBUG, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "tp2-rg": (
        2,
        DEBUG,
        {
            "parallel.tp": 2,
            "parallel.dp_shard": 1,
            "parallel.sp_regather": True,
            "training.activation_checkpoint": "none",
        },
    ),
    "tp2-noac": (2, DEBUG, {"parallel.tp": 2, "parallel.dp_shard": 1, "training.activation_checkpoint": "none"}),
    "fsdp2xtp2": (4, DEBUG, {"parallel.dp_shard": 2, "parallel.tp": 2}),
    "pp2": (2, DEBUG, {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_microbatches": 4}),
    "cp2": (2, DEBUG, {"parallel.cp": 2, "parallel.dp_shard": 1}),
    "moe-one": (1, MOE, {}),
    "moe-tp2": (2, MOE, {"parallel.tp": 2, "parallel.dp_shard": 1}),
    "moe-ep2": (2, MOE, {"parallel.dp_shard": 2, "parallel.ep": 2}),
}
DEFAULT = ("plain", "one", "one-ac", "fsdp2", "tp2", "fsdp2xtp2")
COMPILE_SET = ("one-ac", "fsdp2", "tp2", "fsdp2xtp2", "moe-ep2", "cp2")  # --compile without --layouts
# What each layout is compared with
# (others: one-ac, one process with the same selective AC; moe-one, the MoE model, has none in the dense runs)
BASELINE = {
    "one": "plain",
    "tp2-noac": "one",
    "tp2-rg": "tp2-noac",
    "moe-one": None,
    "moe-tp2": "moe-one",
    "moe-ep2": "moe-one",
}


# ---- rank bodies -------------------------------------------------------------------------------------------
class PlainLoop:
    """The same training in a plain PyTorch loop on one process (no mesh, no DTensor, no FSDP), one step a call."""

    def __init__(self, config: str, overrides: dict, run_dir: str):
        import torch

        from data.dataset import load_data
        from data.loader import GlobalBatchLoader
        from models.llama import Transformer
        from runtime.config import load_config, model_args
        from training.optimizer import lr_factor

        cfg = load_config(path=config, overrides={**overrides, "run.dir": run_dir})
        self.t = t = cfg.training
        self.device = torch.device("cuda" if t.device != "cpu" and torch.cuda.is_available() else "cpu")
        with torch.device("meta"):
            self.model = Transformer(model_args(cfg))
        self.model.init_weights(t.seed, self.device)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), foreach=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr_ratio)
        )
        self.loader = GlobalBatchLoader(
            load_data(cfg).train,
            seq_len=t.seq_len,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch or t.global_batch,
            dp_rank=0,
            dp_size=1,
        )
        self.losses: list[float] = []

    def step(self) -> None:
        import torch
        import torch.nn.functional as F

        t, device = self.t, self.device
        tokens = t.global_batch * t.seq_len
        loss_sum = torch.zeros((), device=device)
        for inputs, targets in self.loader.next_batch():
            with torch.autocast(device.type, torch.bfloat16, enabled=t.mixed_precision == "bf16"):
                logits = self.model(inputs.to(device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten(), reduction="sum")
            (loss / tokens).backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        self.losses.append((loss_sum / tokens).item())
        norm.item()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def meshloom_steps(config: str, overrides: dict, run_dir: str, paired: bool = False, event=None) -> dict:
    """Train with meshloom; per step: the start-to-start wall and CPU time and the window tokens/s of
    metrics.jsonl. ``paired``: after each meshloom step, one step of a PlainLoop in the same process (its time
    is taken out of meshloom's), so the two alternate step by step under the same conditions. ``event``: a class
    with CUDA events' API (runtime/process.py: ``HostEvent``) that the step's clock records instead of the
    device's own clock: the CPU stand-in of a GPU run, whose readings are events, not numbers."""
    import train
    import training.step
    from runtime.config import load_config
    from runtime.process import seconds_between

    calls: list[tuple] = []  # (clock reading, cpu) at each clock_reading call: a step's start, then its end
    plain_spans: list[tuple[float, float]] = []  # (wall, cpu) a plain step took, inside meshloom's step k
    plain = PlainLoop(config, overrides, run_dir + "-plain") if paired else None
    timed = training.step.clock_reading
    if event is not None:

        def timed(device):
            reading = event(enable_timing=True)
            reading.record()
            return reading

    def recording(device):
        now = timed(device)  # a float on CPU, an event on CUDA (read only through seconds_between)
        calls.append((now, time.process_time()))
        if plain is not None and len(calls) % 2 == 0:  # the end of meshloom's step: one plain step now
            wall, cpu = clock()
            plain.step()
            plain_spans.append((time.perf_counter() - wall, time.process_time() - cpu))
        return now  # meshloom's own window ends before the plain step

    training.step.clock_reading = recording  # train_step reads it at each step's start and end
    try:
        records = train.train(load_config(path=config, overrides={**overrides, "run.dir": run_dir}))
    finally:
        training.step.clock_reading = timed
    assert len(calls) == 2 * len(records), "train_step does not call clock_reading exactly twice a step"
    starts = calls[::2]
    inserted = plain_spans or [(0.0, 0.0)] * len(records)
    result = {
        # step k: from its start to step k+1's start, less any plain step run in between
        "full_s": [seconds_between(a[0], b[0]) - p[0] for a, b, p in zip(starts, starts[1:], inserted, strict=False)],
        "cpu_s": [b[1] - a[1] - p[1] for a, b, p in zip(starts, starts[1:], inserted, strict=False)],
        "window_tokens_per_s": [r["window_tokens_per_s"] for r in records],
        "loss": [r["loss"] for r in records],
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
        "compiled_frames": [r.get("compiled_frames") for r in records],  # None when not compiled
    }
    if plain is not None:
        result["plain"] = {
            "full_s": [w for w, _ in plain_spans],
            "cpu_s": [c for _, c in plain_spans],
            "window_tokens_per_s": [],
            "loss": plain.losses,
            "peak_mem_bytes": 0,
        }
    return result


def plain_steps(config: str, overrides: dict, run_dir: str) -> dict:
    """The PlainLoop alone, in a process of its own (``--gpu-1b``)."""
    from training.metrics import peak_memory_bytes

    plain = PlainLoop(config, overrides, run_dir)
    spans = []
    for _ in range(plain.t.steps):
        wall, cpu = clock()
        plain.step()
        spans.append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        "full_s": [w for w, _ in spans],
        "cpu_s": [c for _, c in spans],
        "window_tokens_per_s": [],
        "loss": plain.losses,
        "peak_mem_bytes": peak_memory_bytes(plain.device),
    }


def run_layout(name: str, shape: dict, steps: int, extra: dict, timeout: float) -> dict:

    ranks, config, overrides = LAYOUTS[name]
    shape = {**(MOE_SHAPE if config == MOE else shape)}
    merged = {
        **shape,
        "training.activation_checkpoint": "selective",
        **overrides,
        **extra,
        "training.steps": steps,
        "run.tensorboard": False,
        "run.log_every": steps,
    }
    with tempfile.TemporaryDirectory(prefix="meshloom-throughput-") as run_dir:
        if name == "plain":  # run with "one", step by step in its process (module docstring)
            name, paired = "one", True
        else:
            paired = False
        return run_on_ranks(meshloom_steps, ranks, config, merged, run_dir + "/run", paired, timeout=timeout)[0]


# ---- the table ----------------------------------------------------------------------------------------------
def median_after(values: list[float], warmup: int) -> float:
    kept = values[warmup:] or values[-1:]
    return statistics.median(kept)


# ---- one GPU, a 1B model ---------------------------------------------------------------------------------------
def gpu_1b(
    rounds: int = 2,
    warmup: int = 2,
    peak_tflops_arg: float = 0.0,
    smoke: bool = False,
    no_compile: bool = False,
    overrides: list[str] | tuple[str, ...] = (),
    event=None,
    only: tuple[str, ...] = (),
) -> dict:
    """Llama-3.2-1B's shape (models/presets.py: PRESETS["llama3-1b"]) in bf16 on one GPU: meshloom vs the plain loop.

    Not run here (no GPU on the machine this was written on); ``--smoke`` runs the same path with one layer
    and short sequences on whatever device there is, so the script itself is checked; ``event`` (meshloom_steps)
    times the meshloom runs with CUDA events' stand-in there. ``only``: these runs (by name), compiled or not, even
    with ``smoke``. Returns each run's tokens/s, TFLOP/s, MFU (None without a known peak), peak GiB, the first step's
    time less a steady step's (``first_step_extra_s``: a compiled run's compilation) and the frames compiled after
    the first step (``recompiles``; None eagerly): ``python -m measure.gpu_check`` reports them.
    """
    import torch

    from models.presets import PRESETS

    p = PRESETS["llama3-1b"]
    seq = 2048
    shape = {
        "model.dim": p.dim,
        "model.n_layers": p.n_layers,
        "model.n_heads": p.n_heads,
        "model.n_kv_heads": p.n_kv_heads,
        "model.vocab_size": p.vocab_size,
        "model.ffn_dim": p.hidden_dim,
        "model.rope_theta": p.rope_theta,
        "model.max_seq_len": seq,
        "training.seq_len": seq,
        "training.global_batch": 8,
        "training.mixed_precision": "bf16",
        "training.activation_checkpoint": "selective",
        "training.steps": 12,
        "run.tensorboard": False,
        "run.log_every": 1000,
    }
    if smoke:  # the same code path at a size a laptop's memory takes (the 1B's fp32 states are ~20 GB)
        seq = 128
        shape.update(
            {
                "model.dim": 256,
                "model.n_layers": 1,
                "model.n_heads": 4,
                "model.n_kv_heads": 1,
                "model.vocab_size": 2048,
                "model.ffn_dim": 512,
                "model.max_seq_len": seq,
                "training.seq_len": seq,
                "training.global_batch": 2,
                "training.steps": 4,
            }
        )
    extra = dict(kv.split("=", 1) for kv in overrides)
    on_gpu = torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name() if on_gpu else 'cpu (smoke test only)'}; 1B shape: {shape}")
    rows = {}
    for round_ in range(rounds):
        for name, body, more in (
            ("plain (autocast bf16)", plain_steps, {"training.activation_checkpoint": "none"}),
            ("meshloom bf16, no AC", meshloom_steps, {"training.activation_checkpoint": "none"}),
            ("meshloom bf16, selective AC", meshloom_steps, {}),
            ("meshloom bf16, selective AC, compile", meshloom_steps, {"training.compile": True}),
        ):
            if (name not in only) if only else ((smoke or no_compile) and "compile" in name):
                continue
            with tempfile.TemporaryDirectory(prefix="meshloom-1b-") as run_dir:
                args = (DEBUG, {**shape, **more, **extra}, run_dir) + ((False, event) if body is meshloom_steps else ())
                result = run_on_ranks(body, 1, *args, timeout=1800, gpus=on_gpu)[0]
            rows.setdefault(name, []).append(result)
            print(f"  round {round_ + 1}: {name}", flush=True)
    from models.flops import flops_per_token
    from runtime.config import load_config, model_args
    from training.mfu import peak_tflops

    cfg = load_config(path=DEBUG, overrides=shape)
    per_token = flops_per_token(model_args(cfg), seq)
    device = torch.device("cuda" if on_gpu else "cpu")
    peak = peak_tflops(peak_tflops_arg, device, "bf16")
    tokens = shape["training.global_batch"] * seq
    print(f"{'run':<40} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    table = {}
    for name, results in rows.items():
        rate = statistics.median(tokens / median_after(r["full_s"], warmup) for r in results)
        tflops = per_token * rate / 1e12
        mfu = f"{tflops / peak:6.1%}" if peak else "   n/a"
        peak_gib = max(r["peak_mem_bytes"] for r in results) / 2**30
        first_extra, recompiles = compile_cost(results, warmup)
        print(f"{name:<40} {rate:9,.0f} {tflops:8.1f} {mfu} {peak_gib:9.2f}")
        table[name] = {
            "first_step_extra_s": first_extra,
            "recompiles": recompiles,
            "tokens_per_s": rate,
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "peak_gib": peak_gib,
            "first_loss": statistics.median(r["loss"][0] for r in results),  # same weights, same first batch
        }
    return {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "peak_tflops": peak, "runs": table}


def build_parser() -> argparse.ArgumentParser:
    """The options, each with a checked type (runtime/options.py; tests/test_input_walk.py walks them)."""
    parser = argparse.ArgumentParser(prog="python -m measure.tokens_per_second", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layouts",
        type=list_option(choices=tuple(LAYOUTS)),
        help=f"comma-separated, from {', '.join(LAYOUTS)} (default: {','.join(DEFAULT)}; with --compile "
        f"{','.join(COMPILE_SET)})",
    )
    parser.add_argument(
        "--rounds",
        type=count_option(),
        default=2,
        help="interleaved rounds (each runs every layout once)",
    )
    parser.add_argument("--steps", type=count_option(), default=8, help="steps per run")
    parser.add_argument("--warmup", type=count_option(ge=0), default=2, help="steps left out of the median")
    parser.add_argument("--compile", action="store_true", help="also run each layout with training.compile=true")
    parser.add_argument("--moe", action="store_true", help="also run moe-one and moe-tp2")
    parser.add_argument(
        "--peak-tflops", type=float_option(ge=0), default=0.0, help="peak TFLOP/s of one device: prints MFU"
    )
    parser.add_argument("--seq-len", type=count_option(), default=SHAPE["training.seq_len"])
    parser.add_argument(
        "--set", type=override_option(), action="append", default=[], help="extra override for every run, key=value"
    )
    parser.add_argument("--gpu-1b", action="store_true", help="a Llama-3.2-1B-shaped model in bf16 on one GPU")
    parser.add_argument("--smoke", action="store_true", help="with --gpu-1b: 1 layer, short sequences, any device")
    parser.add_argument("--no-compile", action="store_true", help="with --gpu-1b: leave out the compiled run")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpu_1b:
        return gpu_1b(args.rounds, args.warmup, args.peak_tflops, args.smoke, args.no_compile, args.set)
    names = [n for n in (args.layouts or ",".join(COMPILE_SET if args.compile else DEFAULT)).split(",") if n]
    if args.moe:
        names += [n for n in ("moe-one", "moe-tp2") if n not in names]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    runs = [(n, {}) for n in names]
    if args.compile:
        runs += [(n + "+compile", {"training.compile": True}) for n in names if n != "plain"]
    extra = dict(kv.split("=", 1) for kv in args.set)
    shape = {**SHAPE, "training.seq_len": args.seq_len, "model.max_seq_len": args.seq_len}
    if "plain" in names and "one" not in names:
        runs.insert(names.index("plain") + 1, ("one", {}))
    results: dict[str, list[dict]] = {name: [] for name, _ in runs}
    started = time.monotonic()
    refused: dict[str, str] = {}
    for round_ in range(args.rounds):
        # Odd rounds run the layouts in reverse (A B C, C B A, ...): a drift in the machine's speed over the
        # invocation then hits every layout about equally.
        for name, more in runs if round_ % 2 == 0 else runs[::-1]:
            if name in refused or (name == "one" and "plain" in results):  # "one" runs paired with "plain"
                continue
            layout = name.split("+")[0]
            t0 = time.monotonic()
            try:
                result = run_layout(layout, shape, args.steps, {**more, **extra}, timeout=900)
                if name == "plain":
                    results["plain"].append(result.pop("plain"))
                    results.setdefault("one", []).append(result)
                else:
                    results[name].append(result)
            except RankFailure as exc:  # a layout meshloom refuses (ConfigError before any collective)
                if "ConfigError" not in str(exc):
                    raise
                refused[name] = str(exc).split("ConfigError: ")[-1].strip().splitlines()[-1].strip(" -")
            print(f"  round {round_ + 1}: {name:<18} {time.monotonic() - t0:5.0f} s", flush=True)
    print_table(results, runs, shape, args, refused)
    print(f"total {time.monotonic() - started:.0f} s")


def layout_rate(rounds: list[dict], tokens: int, warmup: int) -> tuple[float, float | None, list[float]]:
    """(median full-loop tokens/s over rounds, median window tokens/s or None, per-round full tokens/s)."""
    per_round = [tokens / median_after(r["full_s"], warmup) for r in rounds]
    windows = [median_after(r["window_tokens_per_s"], warmup) for r in rounds if r["window_tokens_per_s"]]
    return statistics.median(per_round), (statistics.median(windows) if windows else None), per_round


def compile_cost(rounds: list[dict], warmup: int) -> tuple[float, float | None]:
    """(the first step's time less a steady step's: a compiled run's compilation; the frames dynamo compiled after
    the first step, None for an eager run), medians over the rounds."""
    first = statistics.median(r["full_s"][0] - median_after(r["full_s"], warmup) for r in rounds)
    frames = [r.get("compiled_frames") or [None] for r in rounds]
    if frames[0][0] is None:
        return first, None
    return first, statistics.median(f[-1] - f[0] for f in frames)


def compile_columns(rounds: list[dict], warmup: int) -> str:
    """The table's ``1st +s`` and ``recomp`` (module docstring)."""
    first, recompiles = compile_cost(rounds, warmup)
    return f"{first:7.1f} {'-' if recompiles is None else f'{recompiles:.0f}':>6}"


def print_table(results: dict, runs: list, shape: dict, args, refused: dict | None = None) -> None:
    """The table of ``runs``; a layout in ``refused`` (name -> meshloom's reason) gets its row with the reason."""
    from models.flops import flops_per_token
    from runtime.config import load_config, model_args

    refused = refused or {}
    tokens = shape["training.global_batch"] * shape["training.seq_len"]
    rates = {name: layout_rate(results[name], tokens, args.warmup) for name, _ in runs if name not in refused}
    print(
        f"\nmodel dim {shape['model.dim']}, {shape['model.n_layers']} layers, seq {shape['training.seq_len']}, "
        f"{shape['training.global_batch']} sequences/step; {args.rounds} rounds x {args.steps} steps, median over "
        f"steps > {args.warmup}; full = step start to next step start, window = metrics.jsonl's window_tokens_per_s; "
        "CPU s = CPU time of rank 0's process per step"
    )
    header = f"{'layout':<18} {'ranks':>5} {'tok/s full':>10} {'window':>8} {'vs':>10} {'ratio':>6}  per round"
    header += f"      {'CPU s':>6} {'TFLOP/s/dev':>11}" + ("   MFU" if args.peak_tflops else "")
    header += f" {'1st +s':>7} {'recomp':>6}" if args.compile else ""
    print(header)
    for name, _ in runs:
        layout = name.split("+")[0]
        ranks, config, _ = LAYOUTS[layout]
        if name in refused:
            print(f"{name:<18} {ranks:>5} refused by meshloom: {refused[name]}")
            continue
        full, window, per_round = rates[name]
        base = BASELINE.get(layout, "one-ac") if layout != "plain" else ""
        if name.endswith("+compile"):
            base = layout  # compile's speedup: the same layout, eager
        ratio, per = "", ""
        if base in rates and base != name:
            ratio = f"{full / rates[base][0]:6.3f}"
            per = " ".join(f"{a / b:.3f}" for a, b in zip(per_round, rates[base][2], strict=False))
        cfg = load_config(path=config, overrides={**(MOE_SHAPE if config == MOE else shape)})
        tflops = flops_per_token(model_args(cfg), shape["training.seq_len"]) * full / ranks / 1e12
        shown = f"{window:8,.0f}" if window else f"{'':>8}"
        cpu = statistics.median(median_after(r["cpu_s"], args.warmup) for r in results[name])
        line = f"{name:<18} {ranks:>5} {full:10,.0f} {shown} {base if ratio else '':>10} {ratio:>6}  {per:<14}"
        line += f" {cpu:6.2f} {tflops:11.4f}" + (f" {tflops / args.peak_tflops:6.1%}" if args.peak_tflops else "")
        line += f" {compile_columns(results[name], args.warmup)}" if args.compile else ""
        print(line)
    if "plain" in results and "one" in results:
        diffs = [
            max(abs(a - b) / abs(b) for a, b in zip(m["loss"], p["loss"], strict=True))
            for m, p in zip(results["one"], results["plain"], strict=True)
        ]
        # Paired: meshloom's step k against the plain step k that ran right after it, in the same process.
        for clock_name, key in (("wall-clock", "full_s"), ("CPU", "cpu_s")):
            ratios = [
                [a / b for a, b in zip(m[key][args.warmup :], p[key][args.warmup :], strict=False)]
                for m, p in zip(results["one"], results["plain"], strict=True)
            ]
            overall = statistics.median(r for per in ratios for r in per) - 1
            print(
                f"meshloom's 1-process overhead against the plain loop, {clock_name} time per step, median over "
                f"{sum(map(len, ratios))} step pairs: {overall:+.1%} (per round: "
                f"{', '.join(f'{statistics.median(per) - 1:+.1%}' for per in ratios)})"
            )
        print(f"same losses in both loops: max relative difference {max(diffs):.1e}")


if __name__ == "__main__":
    main()
