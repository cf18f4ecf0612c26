"""Simulate before you rent: ``python train.py --simulate --world-size N [--config F] [--key value ...]``.

The planner (planning/memory_estimate.py) is arithmetic; this runs meshloom's own code at the world size it is
meant for, on one CPU, and measures what one rank of each pipeline stage holds and sends:

1. The simulation's flags, read with every mode's by runtime/command_line.py: ``--world-size N``, ``--pp-ranks
   0,15`` (default: every pipeline rank; the other coordinates of a pipeline rank are symmetric),
   ``--simulate-out FILE`` (the report as JSON, its folder checked before anything runs) and
   ``--simulate-routing balanced`` (the only routing today).
2. Refuse what cannot be simulated, naming what and why (``refusals``): MoE token dropping (a host read sizes the
   experts' input), MoE in fp32 (the grouped matmul's shape function takes bf16 only), layouts with neither FSDP
   nor TP (torch cannot swap plain fake parameters when materialising), CPU offload, a compiled block, and the
   DDP-replicated layouts (PowerSGD, 1-bit Adam).
3. Per pipeline rank, in a fresh process each (``in_fresh_process``): ``run_rank``, which train.py hands in
   (training/simulated_rank.py: the real build and two real training steps on a fake world of N ranks under fake
   tensors, metered by planning/sim_accounting.py). Expert parallelism routes by ``balanced_split_sizes``
   (mesh/expert_parallel.py): balanced routing is assumed, not read.
4. The planner's estimate for the same rank beside the measured peak, category by category, and ``why`` when
   they differ by more than 10%; the collectives of step 2 per mesh dim; printed, and written as JSON.

The memory is CPU-style: no allocator rounding or fragmentation, CUDA context, kernel workspaces or NCCL buffers.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from planning.dry_run import size
from planning.memory_estimate import in_flight_activations, rank_memory, rank_parameters, stage_parameters
from planning.plan import LayoutPlan
from runtime.command_line import planned_device
from runtime.config import ConfigError

if TYPE_CHECKING:
    from runtime.command_line import CommandLine
    from runtime.schema import Config, ModelConfig

TOLERANCE = 0.10  # a difference beyond this gets a ``why``
NOT_MODELLED = (
    "CPU-style memory: no allocator rounding or fragmentation, CUDA context, kernel workspaces or NCCL buffers"
)


def refusals(plan: LayoutPlan) -> list[str]:
    """Step 2: what this layout does that a simulation cannot run, each with its reason."""
    layout, m = plan.layout, plan.model
    found = []
    if m.moe is not None and m.moe.capacity_factor > 0:
        found.append(
            f"model.moe_capacity_factor={m.moe.capacity_factor}: the kept assignments are counted on the host to size "
            "the experts' input (models/moe.py, step 3); fake tensors hold no counts. Simulate the dropless "
            "layer (capacity_factor=0)."
        )
    if m.moe is not None and layout.mixed_precision == "fp32":
        found.append(
            "training.mixed_precision=fp32 with MoE layers: torch's shape function for the experts' grouped matmul "
            "(aten._grouped_mm) accepts bf16 only (the CUDA kernel's rule), though the CPU kernel runs fp32. "
            "Simulate it with training.mixed_precision=bf16."
        )
    if not plan.layout.fsdp and plan.dims.tp == 1:
        found.append(
            "a layout with neither FSDP nor TP (fp32, dp_shard = dp_replicate = cp = tp = 1): materialising its plain "
            "meta-device weights swaps each parameter for a new one (nn.Module.to_empty), which torch refuses for "
            "fake tensors (FSDP's and TP's parameters are DTensors, which it swaps). "
            "Simulate it with training.mixed_precision=bf16 (FSDP then holds the weights, as at scale)."
        )
    if layout.fsdp_cpu_offload:
        found.append("parallel.fsdp_cpu_offload=true: the states live in host memory, which the meter does not split.")
    if layout.compile:
        found.append("training.compile=true: a compiled block is traced, not run op by op; simulate it eagerly.")
    if layout.grad_compression in ("powersgd", "onebit_adam"):
        found.append(
            f"parallel.grad_compression={layout.grad_compression}: its replicated model communicates through DDP's "
            "buckets and reads its state on the host."
        )
    return found


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a spawned process of its own: torch caches what a fake world's groups are called (DTensor's
    sharding propagation, meshes), and the next pipeline rank's world reuses the names for other groups."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def estimate(
    cfg: Config, world_size: int, pp_rank: int, model_config=None, device_type: str | None = None
) -> tuple[float, dict[str, float]]:
    """The planner's bytes for the same rank, split the way the simulation splits them (``device_type``: the device
    kind planned for, runtime/command_line.py: ``planned_device``)."""
    device_type = device_type or planned_device(None, cfg.training.device)
    first = LayoutPlan.resolve(cfg, world_size, rank=0, model_config=model_config, device_type=device_type)
    rank = pp_rank * (world_size // first.dims.pp)
    plan = LayoutPlan.resolve(cfg, world_size, rank=rank, model_config=model_config, device_type=device_type)
    layout, m, stages = plan.layout, plan.model, plan.stage_ids
    memory = rank_memory(m, layout, plan.stage_layers, pp_rank, stages)
    layers = [i for s in stages for i in plan.stage_layers[s]]
    owned = rank_parameters(m, layout, stage_parameters(m, layers, 0 in stages, plan.layout.n_stages - 1 in stages))
    per = memory.states / 16 if owned else 0.0  # states are 16 bytes per owned parameter: 4 + 4 + 8
    split = {
        "parameters": 4 * per,
        "gradients": 4 * per,
        "optimizer_states": 8 * per,
        "activations_and_temporaries": memory.gathered + memory.activations,
        "logits": memory.logits,
    }
    return memory.total, split


def in_flight(cfg: Config, world_size: int, pp_rank: int, model_config=None, device_type: str | None = None):
    """The schedule's in-flight activations in the planner's estimate for this rank: (bytes, chunks held per stage,
    the schedule's name), or None without pipelining."""
    device_type = device_type or planned_device(None, cfg.training.device)
    first = LayoutPlan.resolve(cfg, world_size, rank=0, model_config=model_config, device_type=device_type)
    if first.dims.pp == 1:
        return None
    rank = pp_rank * (world_size // first.dims.pp)
    plan = LayoutPlan.resolve(cfg, world_size, rank=rank, model_config=model_config, device_type=device_type)
    held_bytes, held = in_flight_activations(plan.model, plan.layout, plan.stage_layers, pp_rank, plan.stage_ids)
    return held_bytes, dict(zip(plan.stage_ids, held, strict=True)), plan.layout.pp_schedule


def why(simulated: float, estimated: float, sim: dict, est: dict, flight=None) -> str | None:
    """The reason for a difference beyond TOLERANCE: the categories that differ most, and what neither counts.
    ``flight`` (``in_flight``): when the activations differ most, the schedule's chunks in flight are named, since
    they are most of that category on a pipeline rank (the chunks held per stage, from the schedule's own order)."""
    if estimated and abs(simulated - estimated) <= TOLERANCE * estimated:
        return None
    gaps = sorted(((sim[k] - est[k], k) for k in sim), key=lambda g: -abs(g[0]))
    named = "; ".join(
        f"{k.replace('_', ' ')} {size(sim[k])} simulated vs {size(est[k])} estimated" for gap, k in gaps[:2] if gap
    )
    if flight is not None and gaps[0][1] == "activations_and_temporaries":
        held_bytes, held, schedule = flight
        chunks = ", ".join(f"{n} of stage {s}" for s, n in held.items())
        named += (
            f"; of the estimated activations, {size(held_bytes)} are the {schedule} schedule's chunks in flight "
            f"({chunks}: planning/memory_estimate.py, stage_chunks_in_flight)"
        )
    return (
        f"{named}. Neither counts the CUDA context, NCCL's buffers or the allocator's rounding; the estimate also "
        "leaves out the optimizer step's temporaries (planning/memory_estimate.py)."
    )


def simulate(cfg: Config, args: CommandLine, run_rank, model_config: ModelConfig | None = None) -> dict:
    """Steps 2-4 for every pipeline rank asked for; the report (``--simulate-out``'s JSON). ``run_rank(cfg,
    world_size, pp_rank)`` is step 3 (training/simulated_rank.py: ``simulate_rank``, handed in by train.py: the
    plan's room does not import the training loop)."""
    device_type = args.target_device(cfg.training.device)  # what mixed_precision = auto resolves for
    plan = LayoutPlan.resolve(cfg, args.world_size, rank=0, model_config=model_config, device_type=device_type)
    problems = refusals(plan)
    if problems:
        raise ConfigError("the simulation cannot run this config:\n  - " + "\n  - ".join(problems))
    pp = plan.dims.pp
    ranks = args.pp_ranks if args.pp_ranks is not None else list(range(pp))
    bad = [r for r in ranks if r >= pp]
    if bad:
        raise ConfigError(f"--pp-ranks {bad}: this layout has pp {pp}, so pipeline ranks 0..{pp - 1}.")
    rows = []
    for pp_rank in ranks:
        row = in_fresh_process(run_rank, cfg, args.world_size, pp_rank, True, False, model_config, device_type)
        total, split = estimate(cfg, args.world_size, pp_rank, model_config, device_type)
        row["estimated_bytes"] = round(total)
        row["estimated_categories"] = {k: round(v) for k, v in split.items()}
        flight = in_flight(cfg, args.world_size, pp_rank, model_config, device_type)
        row["why"] = why(row["simulated_peak_bytes"], total, row["categories"], split, flight)
        rows.append(row)
    routing = "balanced (assumed, not read)" if plan.model.moe is not None else "no MoE layers"
    return {
        "world_size": args.world_size,
        "layout": plan.dims.describe(),
        "mixed_precision": plan.layout.mixed_precision,
        "device_kind": device_type,
        "routing": routing,
        "memory_model": NOT_MODELLED,
        "ranks": rows,
    }


def format_report(report: dict) -> str:
    """The two tables per pipeline rank: memory by category (simulated, estimated, difference), collectives."""
    lines = [
        f"meshloom simulation | world {report['world_size']} | {report['layout']} | "
        f"{report['mixed_precision']} on {report['device_kind']} | "
        f"MoE routing: {report['routing']}",
        f"  one process per pipeline rank, fake world, fake tensors; {report['memory_model']}",
    ]
    for row in report["ranks"]:
        sim, est = row["categories"], row["estimated_categories"]
        total_s, total_e = row["simulated_peak_bytes"], row["estimated_bytes"]
        lines += [
            f"  pp rank {row['pp_rank']} (rank {row['rank']}, stages {row['stages']}; {row['seconds']} s); "
            f"the build peaks at {size(row['build_peak_bytes'])} (materialising the largest weight in full)",
            f"    {'memory at the peak':<30} {'simulated':>12} {'estimated':>12} {'difference':>11}",
        ]
        for key in sim:
            diff = (sim[key] - est[key]) / est[key] if est[key] else 0.0
            lines.append(f"    {key.replace('_', ' '):<30} {size(sim[key]):>12} {size(est[key]):>12} {diff:>+10.1%}")
        diff = (total_s - total_e) / total_e if total_e else 0.0
        lines.append(f"    {'total':<30} {size(total_s):>12} {size(total_e):>12} {diff:>+10.1%}")
        if row["why"]:
            lines.append(f"    why: {row['why']}")
        lines.append(f"    {'collectives of step 2':<30} {'count':>7} {'bytes/rank':>12} {'on the wire':>12}")
        for c in row["collectives"]:
            name = f"{c['dim']} {c['kind']}"
            lines.append(f"    {name:<30} {c['count']:>7} {size(c['bytes']):>12} {size(c['wire_bytes']):>12}")
    return "\n".join(lines)


def run_simulation(cfg: Config, args: CommandLine, run_rank, model_config: ModelConfig | None = None) -> str:
    """``train.py --simulate``: the report printed (and written as JSON with ``--simulate-out``); ``model_config``:
    a transformers folder's [model] (checkpoint/hf_folder.py: ``folder_model``)."""
    report = simulate(cfg, args, run_rank, model_config)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return format_report(report)
