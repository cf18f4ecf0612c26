"""Check a launch before launching it: ``python train.py --dry-run --world-size N [--config F] [--key value ...]``.

A misfit layout on a cluster costs a queue wait, a rendezvous and a torch import on every node before the
first rank says what is wrong. The dry run does, in one process and in a second, everything ``train.py``
decides before its first collective that needs neither a process group nor a file:

1. The dry run's flags, read with every mode's by runtime/command_line.py (``--dry-run``, ``--world-size N``);
   the rest is the run's own ``[--config F] [--key value ...]``, parsed by runtime/config.py as the run would
   parse it.
2. Resolve the plan for the world size and the device kind the run will use (``--device-kind``, default cuda:
   ``mixed_precision = auto`` is bf16 there, whatever machine the dry run runs on), once per pipeline rank (its stages differ): every field's range
   and every layout rule (planning/plan.py: ``LayoutPlan.resolve``). A broken rule raises the same
   ConfigError, listing every broken rule, that every rank of the real launch would raise: exit 2.
3. Print the banner: the mesh (every dim and its size, in mesh order); the parameters in total, then per
   pipeline rank those of its stages and those each of its ranks holds once TP, EP and FSDP split them; the
   estimated memory per rank (planning/memory_estimate.py: states, gathered weights, activations, logits); the
   batch split; the pipeline's stages; and what was not checked because it needs files or the machine: the
   data (``data.*``: sources, tokenizer, token-file headers, split sizes), the checkpoints (``checkpoint.*``:
   resume, folder, init_from), ``run.dir``, and the estimate against the device's memory. Exit 0.

Nothing here creates a process group, reads a data or checkpoint file, or writes anything; the config
file itself is read (tests/test_launch_commands.py runs every command of README.md and launch/ through it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mesh.dims import MESH_DIMS
from mesh.pipeline import stage_ids_of_rank
from planning.memory_estimate import rank_memory, rank_parameters, stage_parameters
from planning.plan import LayoutPlan
from runtime.command_line import planned_device

if TYPE_CHECKING:
    from runtime.schema import Config, ModelConfig


def size(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"


def dry_run(
    cfg: Config, world_size: int, model_config: ModelConfig | None = None, device_type: str | None = None
) -> str:
    """Steps 2-3: the banner of ``cfg`` on ``world_size`` ranks, or a ConfigError naming every broken rule
    (``model_config``: a transformers folder's [model], checkpoint/hf_folder.py: ``folder_model``; ``device_type``:
    the device kind the run will use, runtime/command_line.py's ``--device-kind``: ``mixed_precision = auto``
    resolves for it, not for this machine; default: runtime/command_line.py's ``planned_device``)."""
    device_type = device_type or planned_device(None, cfg.training.device)
    plan = LayoutPlan.resolve(cfg, world_size, rank=0, model_config=model_config, device_type=device_type)
    d, layout, m = plan.dims, plan.layout, plan.model
    lines = [
        f"meshloom dry run | world {world_size} | {d.describe()} | {layout.mixed_precision} on {device_type} | "
        "no process group; no data, checkpoint or run.dir file touched",
        "  mesh (outermost first: consecutive ranks differ in tp, then cp, ...)",
        *(f"  {name:<13} size {getattr(d, name):>3}" for name in MESH_DIMS),
    ]
    if d.ep > 1:
        lines.append(f"  {'ep':<13} size {d.ep:>3}   (borrowed from dp_shard x cp x tp: the MoE experts' ranks)")
    lines.append(f"  parameters    {m.num_params():,} total")
    for pp_rank in range(d.pp):
        stages = tuple(stage_ids_of_rank(pp_rank, d.pp, layout.stages_per_rank, layout.pp_schedule))
        layers = [i for s in stages for i in plan.stage_layers[s]]
        params = stage_parameters(m, layers, 0 in stages, plan.layout.n_stages - 1 in stages)
        owned = rank_parameters(m, layout, params)
        memory = rank_memory(m, layout, plan.stage_layers, pp_rank, stages)
        if d.pp > 1:
            what = f"stages {list(stages)} (layers {layers}): {sum(params.values()):,} parameters, {round(owned):,}"
            what += " on each of its ranks"
        else:
            what = f"{round(owned):,} of the parameters"
        lines += [
            f"  {f'pp rank {pp_rank}' if d.pp > 1 else 'per rank':<13} {what} (after tp, ep and fsdp split them)",
            f"  {'':<13} memory about {size(memory.total)} per rank: states {size(memory.states)}, gathered weights "
            f"{size(memory.gathered)}, activations {size(memory.activations)}, logits {size(memory.logits)} "
            "(planning/memory_estimate.py)",
        ]
    lines.append(f"  batch         {plan.batch_line()}")
    if d.pp > 1:
        lines.append(
            f"  pipeline      {plan.layout.pp_schedule}, {plan.layout.n_stages} stages ({plan.layout.stages_per_rank} per rank), "
            f"{plan.layout.pp_microbatches} micro-batches per forward call; {plan.split_line()} (pp_split {layout.pp_split})"
        )
    if d.cp > 1:
        lines.append(
            f"  context       cp {d.cp}, {layout.cp_attention} attention, {plan.seq_len // d.cp} tokens per rank"
        )
    c = cfg.checkpoint
    lines += [
        "  not checked (they need files or the machine; the launch checks them on every rank before any collective):",
        f"    data        source {cfg.data.source!r}, tokenizer {cfg.data.tokenizer!r}"
        + (f", validation {cfg.data.val_source!r}" if cfg.data.val_source else ""),
        f"    checkpoint  folder {c.folder or cfg.run.dir + '/checkpoints'!r}, resume {c.resume!r}"
        + (f", init_from {c.init_from!r}" if c.init_from else ""),
        f"    run.dir     {cfg.run.dir!r}",
        "    memory      the estimate against each machine's memory (run.memory_check: every rank compares it)",
    ]
    return "\n".join(lines)
