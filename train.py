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
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from checkpoint.manager import CheckpointManager, find_resume
from config import Config, ConfigError, load_config
from data.dataset import check_data, load_data
from data.loader import GlobalBatchLoader
from evaluation import eval_due, evaluate
from mesh.activation_checkpoint import apply_activation_checkpointing
from mesh.data_parallel import apply_fsdp
from mesh.dims import Meshes, ParallelDims, build_mesh, mesh_banner, pipeline_microbatches, validate_layout
from mesh.expert_parallel import apply_expert_parallel, load_metrics, step_expert_load
from mesh.grad_clip import clip_grad_norm
from mesh.materialize import materialize_weights
from mesh.pipeline import (
    build_pipeline_schedule,
    build_stage_module,
    split_layers,
    stage_ids_of_rank,
    stages_per_rank,
)
from mesh.pipeline_timeline import PipelineTimeline, bubble_report, predicted_bubble, timeline_svg
from mesh.runtime import (
    barrier,
    destroy_process_group,
    init_process_group,
    raise_if_any_rank_failed,
    select_device,
    sum_over,
    world_size_from_env,
)
from mesh.tensor_parallel import apply_tensor_parallel, loss_context, loss_value, reduce_partial_gradients
from metrics import MetricsWriter, check_run_dir, format_step, peak_memory_bytes
from models.llama import ModelArgs, Transformer
from models.moe import MoEArgs
from optim import Optimizers


def model_args(cfg: Config) -> ModelArgs:
    m = cfg.model
    args = ModelArgs(
        dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
        ffn_dim=m.ffn_dim, multiple_of=m.multiple_of, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        max_seq_len=m.max_seq_len, moe_every=m.moe_every,
    )  # fmt: skip
    if m.n_experts:
        args.moe = MoEArgs(
            n_experts=m.n_experts, top_k=m.top_k, hidden_dim=m.moe_ffn_dim or max(1, args.hidden_dim // m.top_k),
            n_shared_experts=m.moe_shared_experts, score_func=m.moe_score_func, route_norm=m.moe_route_norm,
            aux_loss_coef=m.moe_aux_loss_coef, bias_update_rate=m.moe_bias_update_rate,
            capacity_factor=m.moe_capacity_factor,
            # the aux loss is summed per sequence and averaged over the global batch, whatever the layout
            aux_loss_scale=1.0 / cfg.training.global_batch,
        )  # fmt: skip
    return args


def check_values(cfg: Config) -> None:
    """Ranges of single values (the layout rules live in mesh/dims.validate_layout)."""
    m, t = cfg.model, cfg.training
    rules = [
        (t.steps >= 1, "training.steps", t.steps, ">= 1"),
        (t.global_batch >= 1, "training.global_batch", t.global_batch, ">= 1"),
        (t.seq_len >= 1, "training.seq_len", t.seq_len, ">= 1"),
        (t.lr > 0, "training.lr", t.lr, "> 0"),
        (t.warmup_steps >= 0, "training.warmup_steps", t.warmup_steps, ">= 0"),
        (0 <= t.min_lr_ratio <= 1, "training.min_lr_ratio", t.min_lr_ratio, "between 0 and 1"),
        (m.vocab_size >= 256, "model.vocab_size", m.vocab_size, ">= 256, which the byte tokenizer needs"),
        (m.n_heads >= 1 and m.n_kv_heads >= 1, "model.n_heads/n_kv_heads", (m.n_heads, m.n_kv_heads), ">= 1"),
        (m.dim >= 1 and m.n_layers >= 1, "model.dim/n_layers", (m.dim, m.n_layers), ">= 1"),
        (m.multiple_of >= 1, "model.multiple_of", m.multiple_of, ">= 1"),
        (m.n_heads < 1 or m.dim % m.n_heads or (m.dim // m.n_heads) % 2 == 0, "model.dim / model.n_heads",
         m.dim // max(1, m.n_heads), "even (rotary embeddings rotate pairs)"),
        (m.moe_shared_experts in (0, 1), "model.moe_shared_experts", m.moe_shared_experts, "0 or 1"),
        (m.moe_capacity_factor >= 0, "model.moe_capacity_factor", m.moe_capacity_factor, ">= 0 (0: dropless)"),
        (cfg.run.log_every >= 1, "run.log_every", cfg.run.log_every, ">= 1"),
        (cfg.parallel.collective_timeout_s >= 1, "parallel.collective_timeout_s", cfg.parallel.collective_timeout_s, ">= 1"),
    ]  # fmt: skip
    broken = [f"{name}={value!r} must be {rule}." for ok, name, value, rule in rules if not ok]
    if broken:
        raise ConfigError("invalid settings:\n  - " + "\n  - ".join(broken))


def check_config(cfg: Config, world_size: int) -> tuple[ParallelDims, ModelArgs]:
    """Every check that needs no process group; raises the same ConfigError on every rank."""
    check_values(cfg)
    dims = ParallelDims.resolve(cfg, world_size)
    args = model_args(cfg)
    validate_layout(dims, cfg, args)
    check_data(cfg)  # tokenizer, token-file headers, vocab, dataset and validation-split sizes
    # A run that resumes from a checkpoint continues the metrics of run.dir instead of refusing them.
    check_run_dir(cfg.run.dir, cfg.run.overwrite, resuming=find_resume(cfg, args) is not None)
    return dims, args


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, meshes: Meshes, device: torch.device) -> nn.Module:
    """The fixed order: TP -> EP -> activation checkpointing -> compile -> FSDP -> layout-independent weights."""
    if dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, sequence_parallel=cfg.parallel.sequence_parallel)
    if dims.ep > 1:
        apply_expert_parallel(model, meshes.ep)
    apply_activation_checkpointing(model, cfg.training.activation_checkpoint)
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


def build_model(cfg: Config, args: ModelArgs, dims: ParallelDims, meshes: Meshes, device: torch.device) -> Transformer:
    """The whole model, parallelized (no pipeline)."""
    with torch.device("meta"):
        model = Transformer(args)
    return parallelize(model, cfg, dims, meshes, device)


def build_model_parts(cfg: Config, args: ModelArgs, dims: ParallelDims, meshes: Meshes, device: torch.device):
    """This rank's model parts: the whole model, or its pipeline stages. Returns (parts, stage ids, n stages)."""
    if dims.pp == 1:
        return [build_model(cfg, args, dims, meshes, device)], [0], 1
    p = cfg.parallel
    n_local = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
    n_stages = dims.pp * n_local
    layers = split_layers(args, n_stages, p.pp_split, cfg.training.seq_len)
    stage_ids = stage_ids_of_rank(meshes.pp.get_local_rank(), dims.pp, n_local, p.pp_schedule)
    parts = [
        parallelize(build_stage_module(args, layers[s], s == 0, s == n_stages - 1), cfg, dims, meshes, device)
        for s in stage_ids
    ]
    return parts, stage_ids, n_stages


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies, in fp32 (under TP, on vocab-sharded logits via loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def forward_backward(parts, schedule, stage_ids, n_stages, inputs, targets, global_tokens, tp_enabled):
    """One micro-batch's forward and backward; returns this rank's token-loss sum (0 off the last stage).

    The loss that is backpropagated is the token-loss sum divided by the *global* token count: each rank's
    gradient is then its exact share of the global mean, so data-parallel ranks sum (never average) their
    gradients, and the scale is applied once whatever dp, accumulation or pipeline micro-batching is.
    """
    with loss_context(tp_enabled):  # vocab-sharded cross-entropy under TP: forward *and* backward inside
        if schedule is None:
            loss = token_loss_sum(parts[0](inputs), targets)
            (loss / global_tokens).backward()
            return loss_value(loss.detach())
        losses: list[torch.Tensor] = []
        is_first, is_last = 0 in stage_ids, n_stages - 1 in stage_ids
        schedule.step(
            *((inputs,) if is_first else ()),
            **({"target": targets, "losses": losses} if is_last else {}),
        )
        if not is_last:
            return torch.zeros((), device=inputs.device)
        return sum(loss_value(loss.detach()) for loss in losses) * global_tokens


def train(cfg: Config) -> list[dict]:
    """Run ``cfg`` on the current world (process group optional); returns the per-step records on every rank."""
    dims, args = check_config(cfg, world_size_from_env() if not dist.is_initialized() else dist.get_world_size())
    checkpoints = CheckpointManager(cfg, dims, args)  # finds and validates the checkpoint to resume from
    device = select_device(cfg.training.device)
    init_process_group(device, cfg.parallel.collective_timeout_s)
    torch.manual_seed(cfg.training.seed)
    meshes = build_mesh(dims, device.type, has_experts=args.moe is not None)
    is_logger = dist.get_rank() == 0
    t = cfg.training
    micro_batch = t.micro_batch or t.global_batch // dims.dp
    global_tokens = t.global_batch * t.seq_len

    parts, stage_ids, n_stages = build_model_parts(cfg, args, dims, meshes, device)
    schedule, timeline = None, None
    if dims.pp > 1:
        schedule, stages = build_pipeline_schedule(
            parts, stage_ids, n_stages,
            schedule=cfg.parallel.pp_schedule, microbatches=pipeline_microbatches(cfg, dims),
            pp_group=meshes.pp.get_group(), device=device,
            loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / global_tokens,
        )  # fmt: skip
        if cfg.run.pp_timeline:
            timeline = PipelineTimeline(meshes.pp.get_local_rank())
            for stage in stages:
                timeline.instrument(stage)
    optimizers = Optimizers(parts, cfg)
    params = [p for part in parts for p in part.parameters()]
    data = load_data(cfg)
    loader = GlobalBatchLoader(
        data.train, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=micro_batch,
        dp_rank=meshes.dp.get_local_rank(), dp_size=dims.dp,
    )  # fmt: skip
    val_loader = None if data.val is None else GlobalBatchLoader(
        data.val, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=micro_batch,
        dp_rank=meshes.dp.get_local_rank(), dp_size=dims.dp,
    )  # fmt: skip
    # Weights, optimizer, LR schedule, data position and RNG from the checkpoint (or init_from weights).
    start_step = checkpoints.restore(parts, optimizers, loader)

    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    if is_logger:
        stages = f"; pipeline stages {stage_ids} of {n_stages} on rank 0" if dims.pp > 1 else ""
        print(
            f"meshloom | world {dims.world_size} | {dims.describe()} | device {device} | {t.mixed_precision}\n"
            f"{mesh_banner(meshes.world)}\n"
            f"  parameters    {args.num_params():,} total, {local_params:,} on rank 0{stages}\n"
            f"  batch         global {t.global_batch} = micro {micro_batch} x dp {dims.dp} x accumulation "
            f"{loader.local_batch // micro_batch}; seq_len {t.seq_len}; {global_tokens:,} tokens/step\n"
            f"  data          {data.description}",
            flush=True,
        )
    # Every rank checked run.dir in check_config; wait for all of them before rank 0 creates files in it.
    barrier()
    writer, error = None, None
    try:
        writer = MetricsWriter(
            cfg.run.dir, enabled=is_logger, tensorboard=cfg.run.tensorboard, resume_step=checkpoints.resumed_step
        )
    except OSError as exc:
        error = ConfigError(f"run.dir={cfg.run.dir!r} cannot be written ({exc}); choose a writable --run.dir.")
    raise_if_any_rank_failed(error, "opening run.dir", error_type=ConfigError)
    records = []
    try:
        for step in range(start_step + 1, t.steps + 1):
            start = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            batch = loader.next_batch()
            if timeline is not None:
                timeline.begin_step()  # after data loading: the window holds only the pipeline's work
            for inputs, targets in batch:
                loss_sum += forward_backward(
                    parts, schedule, stage_ids, n_stages, inputs.to(device), targets.to(device),
                    global_tokens, dims.tp > 1,
                )  # fmt: skip
            if timeline is not None:
                timeline.end_step()
            if dims.tp > 1:
                reduce_partial_gradients(params)
            grad_norm = clip_grad_norm(params, t.grad_clip, meshes.pp)
            lr = optimizers.lr
            optimizers.step()
            # MoE: global expert load of the step (metrics), and the aux-loss-free bias update from it.
            moe_load = step_expert_load(parts, meshes.dp, meshes.pp) if args.moe is not None else {}
            # The logged loss is the global mean: sum the token-loss sums over the dp ranks and the pp stages
            # (only last-stage ranks hold a non-zero sum).
            sum_over(loss_sum, meshes.loss)
            loss = (loss_sum / global_tokens).item()
            elapsed = time.perf_counter() - start
            record = {
                "step": step, "loss": loss, "grad_norm": grad_norm.item(), "lr": lr,
                "tokens_per_s": global_tokens / elapsed, "peak_mem_bytes": peak_memory_bytes(device),
                "tokens_consumed": loader.tokens_consumed, **load_metrics(moe_load),
            }  # fmt: skip
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}; lower training.lr or enable grad_clip.")
            if eval_due(step, cfg.eval.interval, t.steps):
                kept = len(timeline.events) if timeline is not None else 0
                record["val_loss"] = evaluate(
                    parts, schedule, val_loader, steps=cfg.eval.steps, stage_ids=stage_ids, n_stages=n_stages,
                    loss_fn=token_loss_sum, tp_enabled=dims.tp > 1, loss_mesh=meshes.loss, device=device,
                )  # fmt: skip
                if timeline is not None:
                    del timeline.events[kept:]  # the pipeline timeline shows the training step only
            records.append(record)
            if step % cfg.run.log_every == 0 or step == t.steps or "val_loss" in record:
                writer.log(record)
                if is_logger:
                    print(format_step(record), flush=True)
            checkpoints.maybe_save(step, parts, optimizers, loader)
        checkpoints.finish()
        if timeline is not None:
            write_pipeline_timeline(cfg, dims, meshes, timeline, is_logger)
    finally:
        writer.close()
    return records


def write_pipeline_timeline(cfg: Config, dims: ParallelDims, meshes: Meshes, timeline, is_logger: bool) -> None:
    """The last step's pipeline timeline: bubble table on the console and in JSON, picture as SVG."""
    events, windows = timeline.gather(meshes.pp.get_group())
    if not is_logger:
        return
    p = cfg.parallel
    n_local = stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
    microbatches = pipeline_microbatches(cfg, dims)
    rows = bubble_report(events, windows)
    predicted = predicted_bubble(p.pp_schedule, dims.pp, microbatches, n_local)
    measured = sum(r["idle_fraction"] for r in rows) / len(rows)
    title = f"{p.pp_schedule}: pp={dims.pp}, {n_local} stage(s)/rank, m={microbatches}"
    out = Path(cfg.run.dir)
    (out / "pipeline_timeline.svg").write_text(timeline_svg(events, windows, title))
    summary = {"schedule": p.pp_schedule, "pp": dims.pp, "stages_per_rank": n_local, "microbatches": microbatches,
               "measured_idle_fraction": measured, "predicted_idle_fraction": predicted, "ranks": rows}  # fmt: skip
    (out / "pipeline_bubble.json").write_text(json.dumps(summary, indent=1))
    print(f"pipeline timeline ({title}) -> {out / 'pipeline_timeline.svg'}")
    for r in rows:
        busy = " ".join(f"{k} {r[k] * 1000:7.1f} ms" for k in ("F", "B", "I", "W"))
        print(f"  pp rank {r['rank']}: {busy}  idle {r['idle'] * 1000:7.1f} ms ({r['idle_fraction']:.1%})")
    shown = "n/a" if predicted is None else f"{predicted:.1%}"
    print(f"  bubble: measured {measured:.1%} (mean over ranks) vs predicted {shown}", flush=True)


def main(argv: list[str]) -> int:
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
