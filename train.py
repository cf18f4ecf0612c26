"""Train a Llama-style model on any parallel layout: config -> mesh -> model -> parallelize -> data -> steps.

    python train.py                                   # the embedded default, one process
    torchrun --standalone --nproc-per-node 4 train.py --config configs/debug.toml --parallel.dp_shard 4

Every layout trains the same model as one process: the initial weights are a function of (seed, name),
each data-parallel rank reads its slice of the same global batches, and the loss is the sum of token
losses over the global batch divided by the global token count.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from checkpoint.manager import CheckpointManager, find_resume
from config import Config, ConfigError, check_values, help_text, load_config
from data.corpus import check_corpus, load_corpus
from data.loader import GlobalBatchLoader
from mesh.activation_checkpoint import apply_activation_checkpointing
from mesh.data_parallel import apply_fsdp
from mesh.dims import Meshes, build_mesh, mesh_banner
from mesh.expert_parallel import apply_expert_parallel, load_metrics, step_expert_load
from mesh.grad_clip import clip_grad_norm
from mesh.materialize import materialize_weights
from mesh.pipeline import build_pipeline_schedule, build_stage_module
from mesh.pipeline_timeline import PipelineTimeline, bubble_report, predicted_bubble, timeline_svg
from mesh.plan import LayoutPlan
from mesh.runtime import (
    ControlPlane,
    destroy_process_group,
    device_time,
    init_process_group,
    rank_from_env,
    select_device,
    sum_over,
    world_size_from_env,
)
from mesh.tensor_parallel import apply_tensor_parallel, loss_context, loss_value, reduce_partial_gradients
from metrics import MetricsWriter, check_run_dir, format_step, peak_memory_bytes
from models.llama import Transformer
from optim import Optimizers


class DivergenceError(FloatingPointError):
    """The loss or the gradient norm of a step is not finite; raised before that step reaches the weights."""


def check_config(cfg: Config, world_size: int, rank: int = 0) -> tuple[LayoutPlan, Path | None]:
    """Every check that needs no process group; raises the same ConfigError on every rank.

    Returns the layout plan and the checkpoint to resume from (None: a fresh start), each worked out once.
    """
    check_values(cfg)
    plan = LayoutPlan.resolve(cfg, world_size, rank)
    check_corpus(cfg.data.source, cfg.training.seq_len)
    resume_dir = find_resume(cfg, plan.model)
    # A run that resumes from a checkpoint continues the metrics of run.dir instead of refusing them.
    check_run_dir(cfg.run.dir, cfg.run.overwrite, resuming=resume_dir is not None)
    return plan, resume_dir


def parallelize(model: nn.Module, cfg: Config, plan: LayoutPlan, meshes: Meshes, device: torch.device) -> nn.Module:
    """The fixed order: TP -> EP -> activation checkpointing -> compile -> FSDP -> layout-independent weights."""
    dims = plan.dims
    if dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, sequence_parallel=cfg.parallel.sequence_parallel)
    if dims.ep > 1:
        apply_expert_parallel(model, meshes.ep)
    apply_activation_checkpointing(model, cfg.training.activation_checkpoint, compiled=cfg.training.compile)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile()
    # FSDP whenever there is data parallelism, and also for bf16 on one rank: its MixedPrecisionPolicy is
    # where bf16 compute with fp32 master weights and fp32 gradient reduction lives.
    if dims.dp > 1 or cfg.training.mixed_precision == "bf16":
        apply_fsdp(
            model, meshes,
            mixed_precision=cfg.training.mixed_precision,
            reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward,
            pipelined=dims.pp > 1,
        )  # fmt: skip
    materialize_weights(model, device, cfg.training.seed)
    return model


def build_model(cfg: Config, plan: LayoutPlan, meshes: Meshes, device: torch.device) -> Transformer:
    """The whole model, parallelized (no pipeline)."""
    with torch.device("meta"):
        model = Transformer(plan.model)
    return parallelize(model, cfg, plan, meshes, device)


def build_model_parts(cfg: Config, plan: LayoutPlan, meshes: Meshes, device: torch.device) -> list[nn.Module]:
    """This rank's model parts: the whole model, or its pipeline stages (``plan.stage_ids``)."""
    if plan.dims.pp == 1:
        return [build_model(cfg, plan, meshes, device)]
    return [
        parallelize(
            build_stage_module(plan.model, plan.stage_layers[s], s == 0, s == plan.n_stages - 1),
            cfg,
            plan,
            meshes,
            device,
        )  # fmt: skip
        for s in plan.stage_ids
    ]


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies, in fp32 (under TP, on vocab-sharded logits via loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def forward_backward(parts, schedule, plan: LayoutPlan, inputs, targets, tp_enabled: bool) -> torch.Tensor:
    """One micro-batch's forward and backward; returns this rank's token-loss sum (0 off the last stage).

    The loss that is backpropagated is the token-loss sum divided by the *global* token count: each rank's
    gradient is then its exact share of the global mean, so data-parallel ranks sum (never average) their
    gradients, and the scale is applied once whatever dp, accumulation or pipeline micro-batching is.
    """
    with loss_context(tp_enabled):  # vocab-sharded cross-entropy under TP: forward *and* backward inside
        if schedule is None:
            loss = token_loss_sum(parts[0](inputs), targets)
            (loss / plan.global_tokens).backward()
            return loss_value(loss.detach())
        losses: list[torch.Tensor] = []
        is_first, is_last = 0 in plan.stage_ids, plan.n_stages - 1 in plan.stage_ids
        schedule.step(
            *((inputs,) if is_first else ()),
            **({"target": targets, "losses": losses} if is_last else {}),
        )
        if not is_last:
            return torch.zeros((), device=inputs.device)
        return sum(loss_value(loss.detach()) for loss in losses) * plan.global_tokens


def train(cfg: Config) -> list[dict]:
    """Run ``cfg`` on the current world (process group optional); returns the per-step records on every rank."""
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = world_size_from_env(), rank_from_env()
    plan, resume_dir = check_config(cfg, world_size, rank)
    t, dims = cfg.training, plan.dims
    device = select_device(t.device)
    control = init_process_group(device, cfg.parallel.collective_timeout_s)
    torch.manual_seed(t.seed)
    meshes = build_mesh(dims, device, cfg.parallel.collective_timeout_s, has_experts=plan.model.moe is not None)
    assert meshes.pp.get_local_rank() == plan.pp_rank, "the plan's pp rank must match the mesh coordinate"
    is_logger = dist.get_rank() == 0
    checkpoints = CheckpointManager(cfg, plan, resume_dir, control)

    parts = build_model_parts(cfg, plan, meshes, device)
    schedule, timeline = None, None
    if dims.pp > 1:
        schedule, stages = build_pipeline_schedule(
            parts, list(plan.stage_ids), plan.n_stages,
            schedule=plan.pp_schedule, microbatches=plan.pp_microbatches,
            pp_group=meshes.pp.get_group(), device=device,
            loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / plan.global_tokens,
        )  # fmt: skip
        if cfg.run.pp_timeline:
            timeline = PipelineTimeline(plan.pp_rank, device)
            for stage in stages:
                timeline.instrument(stage)
    optimizers = Optimizers(parts, cfg)
    params = [p for part in parts for p in part.parameters()]
    moe_layer_ids = [i for i in range(plan.model.n_layers) if plan.model.is_moe_layer(i)]
    loader = GlobalBatchLoader(
        load_corpus(cfg.data.source, cfg.data.max_bytes),
        seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=plan.micro_batch,
        dp_rank=meshes.dp.get_local_rank(), dp_size=dims.dp,
    )  # fmt: skip
    writer, records = None, []
    try:
        # Weights, optimizer, LR schedule, data position and RNG from the checkpoint (or init_from weights).
        start_step = checkpoints.restore(parts, optimizers, loader)
        if is_logger:
            print_banner(cfg, plan, meshes, params, device)
        writer = open_metrics(cfg, control, is_logger, checkpoints.resumed_step)
        for step in range(start_step + 1, t.steps + 1):
            start = device_time(device)
            loss_sum = torch.zeros((), device=device)
            batch = loader.next_batch()
            if timeline is not None:
                timeline.begin_step()  # after data loading: the window holds only the pipeline's work
            for inputs, targets in batch:
                loss_sum += forward_backward(parts, schedule, plan, inputs.to(device), targets.to(device), dims.tp > 1)
            if timeline is not None:
                timeline.end_step()
            if dims.tp > 1:
                reduce_partial_gradients(params)
            # The step's global numbers, before anything changes: the loss is the global mean (sum the
            # token-loss sums over the dp ranks and the pp stages; only last-stage ranks hold a non-zero
            # sum), the gradient norm the norm of the whole model's gradient.
            sum_over(loss_sum, meshes.loss)
            grad_norm = clip_grad_norm(params, t.grad_clip, meshes.pp)
            loss, norm = (loss_sum / plan.global_tokens).item(), grad_norm.item()
            if not (math.isfinite(loss) and math.isfinite(norm)):
                # Every rank holds the same global numbers, so every rank stops here, together: the step is
                # not applied, so neither the weights, the expert bias nor any checkpoint ever see it.
                raise DivergenceError(
                    f"at step {step} the loss is {loss} and the gradient norm {norm}; the step was not applied "
                    f"and nothing was saved after step {step - 1}. Lower training.lr (now {t.lr})"
                    + (", set training.grad_clip" if t.grad_clip <= 0 else "")
                    + (", or try training.mixed_precision=fp32" if t.mixed_precision == "bf16" else "")
                    + ", then resume with --checkpoint.resume auto."
                )
            lr = optimizers.lr
            optimizers.step()
            # MoE: global expert load of the step (metrics), and the aux-loss-free bias update from it.
            moe_load = step_expert_load(parts, moe_layer_ids, meshes.loss) if moe_layer_ids else {}
            elapsed = device_time(device) - start
            record = {
                "step": step, "loss": loss, "grad_norm": norm, "lr": lr,
                "tokens_per_s": plan.global_tokens / elapsed, "peak_mem_bytes": peak_memory_bytes(device),
                "tokens_consumed": loader.tokens_consumed, **load_metrics(moe_load),
            }  # fmt: skip
            records.append(record)
            if step % cfg.run.log_every == 0 or step == t.steps:
                writer.log(record)
                if is_logger:
                    print(format_step(record), flush=True)
            checkpoints.maybe_save(step, parts, optimizers, loader)
        checkpoints.finish()
        if timeline is not None:
            write_pipeline_timeline(cfg, plan, meshes, timeline, control, is_logger)
    finally:
        checkpoints.close()  # a save in flight finishes writing and its thread stops, on every exit path
        if writer is not None:
            writer.close()
    return records


def print_banner(cfg: Config, plan: LayoutPlan, meshes: Meshes, params, device: torch.device) -> None:
    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    stages = f"; pipeline stages {list(plan.stage_ids)} of {plan.n_stages} on rank 0" if plan.dims.pp > 1 else ""
    print(
        f"meshloom | world {plan.dims.world_size} | {plan.dims.describe()} | device {device} | "
        f"{cfg.training.mixed_precision}\n"
        f"{mesh_banner(meshes.world)}\n"
        f"  parameters    {plan.model.num_params():,} total, {local_params:,} on rank 0{stages}\n"
        f"  batch         {plan.batch_line()}",
        flush=True,
    )


def open_metrics(cfg: Config, control: ControlPlane, is_logger: bool, resumed_step: int | None) -> MetricsWriter:
    """Rank 0 opens metrics.jsonl and TensorBoard; a failure there is raised on every rank, together."""
    # Every rank checked run.dir in check_config; wait for all of them before rank 0 creates files in it.
    control.barrier()
    writer, error = None, None
    try:
        writer = MetricsWriter(
            cfg.run.dir, enabled=is_logger, tensorboard=cfg.run.tensorboard, resume_step=resumed_step
        )
    except OSError as exc:
        error = ConfigError(f"run.dir={cfg.run.dir!r} cannot be written ({exc}); choose a writable --run.dir.")
    control.raise_if_any_failed(error, "opening run.dir", error_type=ConfigError)
    return writer


def write_pipeline_timeline(
    cfg: Config, plan: LayoutPlan, meshes: Meshes, timeline, control: ControlPlane, is_logger: bool
) -> None:
    """The last step's pipeline timeline: bubble table on the console and in JSON, picture as SVG."""
    events, windows = timeline.gather(control, dist.get_process_group_ranks(meshes.pp.get_group()))
    if not is_logger:
        return
    schedule, n_local, microbatches = plan.pp_schedule, plan.stages_per_rank, plan.pp_microbatches
    rows = bubble_report(events, windows)
    predicted = predicted_bubble(schedule, plan.dims.pp, microbatches, n_local)
    measured = sum(r["idle_fraction"] for r in rows) / len(rows)
    title = f"{schedule}: pp={plan.dims.pp}, {n_local} stage(s)/rank, m={microbatches}"
    out = Path(cfg.run.dir)
    (out / "pipeline_timeline.svg").write_text(timeline_svg(events, windows, title))
    summary = {"schedule": schedule, "pp": plan.dims.pp, "stages_per_rank": n_local, "microbatches": microbatches,
               "measured_idle_fraction": measured, "predicted_idle_fraction": predicted, "ranks": rows}  # fmt: skip
    (out / "pipeline_bubble.json").write_text(json.dumps(summary, indent=1))
    print(f"pipeline timeline ({title}) -> {out / 'pipeline_timeline.svg'}")
    for r in rows:
        busy = " ".join(f"{k} {r[k] * 1000:7.1f} ms" for k in ("F", "B", "I", "W"))
        print(f"  pp rank {r['rank']}: {busy}  idle {r['idle'] * 1000:7.1f} ms ({r['idle_fraction']:.1%})")
    shown = "n/a" if predicted is None else f"{predicted:.1%}"
    print(f"  bubble: measured {measured:.1%} (mean over ranks) vs predicted {shown}", flush=True)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
        train(cfg)
    except ConfigError as exc:
        # Printed by every rank (the same text): whichever rank's output the user reads shows the fix.
        print(f"meshloom: configuration error: {exc}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as exc:
        print(f"meshloom: training diverged: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
