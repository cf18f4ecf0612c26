"""Train a Llama-style model on any parallel layout: config -> mesh -> model -> parallelize -> data -> steps.

    python train.py                                   # the embedded default, one process
    torchrun --standalone --nproc-per-node 4 train.py --config configs/debug.toml --parallel.dp_shard 4
    python train.py --dry-run --world-size 16 --config configs/debug.toml --parallel.tp 4   # check a layout

Every layout trains the same model as one process: the initial weights are a function of (seed, name),
each data-parallel rank reads its slice of the same global batches, and the loss is the sum of token
losses over the global batch divided by the global token count.
"""

from __future__ import annotations

from runtime.signals import StopSignals  # standard library only, so it can come first

# Under torchrun, a worker whose peer fails at start-up gets SIGTERM, maybe while it is still importing torch;
# recording signals from the very start lets every worker still finish its own checks and exit with its own
# code (runtime/signals.py, step 1).
STARTUP_SIGNALS = StopSignals().install() if __name__ == "__main__" else None

import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.folder import check_writable, checkpoint_bytes, checkpoint_folder
from checkpoint.hf_folder import adopt_folder_config
from checkpoint.manager import CheckpointManager, CheckpointSaveError
from checkpoint.resume import Resume, find_resume
from data.dataset import check_data, load_data
from data.loader import GlobalBatchLoader
from mesh.comm_memory_savers import reduction_window
from mesh.context_parallel import load_balanced_positions
from mesh.dims import build_mesh, mesh_banner
from mesh.dry_run import dry_run, parse_dry_run
from mesh.expert_parallel import load_metrics, step_expert_load
from mesh.grad_clip import clip_grad_norm
from mesh.layout_rules import check_memory
from mesh.pipeline import build_pipeline_schedule, run_schedule
from mesh.pipeline_timeline import PipelineTimeline, write_pipeline_timeline
from mesh.plan import LayoutPlan
from mesh.private_api import flight_recorder_dump
from mesh.replica_check import ReplicaMismatchError, check_replicas, tied_replicas
from mesh.tensor_parallel import (
    loss_context,
    loss_value,
    reduce_partial_gradients,
    sum_token_split_gradients,
)
from mesh.tied_embeddings import TiedEmbeddings
from planning.options import model_parts
from runtime.config import Config, ConfigError, help_text, load_config
from runtime.failures import (
    disable_flight_recorder,
    enable_flight_recorder,
    explain,
    is_communication_failure,
    last_collective,
    phase,
    report_to_launcher,
    write_flight_recorder,
)
from runtime.process import (
    ControlPlane,
    destroy_process_group,
    device_time,
    init_process_group,
    memory_per_rank,
    rank_from_env,
    select_device,
    sum_over,
    world_size_from_env,
)
from runtime.run_dir import RunLock, all_on_one_node, check_run_dir, lock_run_folders
from runtime.signals import ParentWatch, resume_command
from training.evaluation import eval_due, evaluate
from training.loss import token_loss_sum
from training.metrics import MetricsWriter, format_step, peak_memory_bytes
from training.optimizer import Optimizers
from training.profiling import named_range, step_profiler
from training.rank_balance import RankBalance
from training.rank_balance import fields as balance_fields
from training.throughput import Throughput, peak_tflops


class DivergenceError(FloatingPointError):
    """The loss or the gradient norm of a step is not finite; raised before that step reaches the weights."""


class StopRequested(Exception):
    """A signal stopped the run after a step (the step was saved when checkpointing is configured)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


def restart_attempt() -> int:
    """0 on a first launch; n on torchrun's n-th restart of the workers (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def check_config(cfg: Config, world_size: int, rank: int = 0) -> tuple[LayoutPlan, Resume]:
    """Every check that needs no process group; raises the same ConfigError on every rank.

    Returns the layout plan and the resume decision (checkpoint/resume.py), each worked out once.
    """
    adopt_folder_config(cfg)  # a transformers folder in checkpoint.init_from sets [model] (its config.json)
    plan = LayoutPlan.resolve(cfg, world_size, rank)  # the config's values, then the layout's rules
    if cfg.run.memory_check:  # the estimate per rank against the machine, before anything is allocated
        check_memory(plan, cfg, memory_per_rank(cfg.training.device))
    check_data(cfg)  # tokenizer, token-file headers, vocab, dataset and validation-split sizes
    resume = find_resume(cfg, plan.model)
    # A run that resumes continues the metrics of run.dir instead of refusing them; so does a torchrun restart
    # with resume auto, even before its first checkpoint.
    resuming = resume.newest is not None or (restart_attempt() > 0 and resume.mode == "auto")
    check_run_dir(cfg.run.dir, cfg.run.overwrite, resuming=resuming)
    if cfg.checkpoint.interval > 0:
        check_writable(checkpoint_folder(cfg), checkpoint_bytes(plan.model.num_params()))
    return plan, resume


def forward_backward(parts, schedule, plan: LayoutPlan, inputs, targets, tp_enabled: bool) -> torch.Tensor:
    """One micro-batch's forward and backward; returns this rank's token-loss sum (0 off the last stage).

    The loss that is backpropagated is the token-loss sum divided by the *global* token count
    (training/loss.py), so data-parallel ranks sum their gradients and the scale is applied once.
    """
    with loss_context(tp_enabled):  # vocab-sharded cross-entropy under TP: forward *and* backward inside
        if schedule is None:
            with named_range("forward"):
                loss = token_loss_sum(parts[0](inputs), targets)
            with named_range("backward"):
                (loss / plan.global_tokens).backward()
            return loss_value(loss.detach())
        with named_range("pipeline schedule"):  # the schedule's own per-action ranges nest inside
            losses = run_schedule(schedule, list(plan.stage_ids), plan.n_stages, inputs, targets, forward_only=False)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return sum(loss_value(loss.detach()) for loss in losses) * plan.global_tokens


def train(cfg: Config) -> list[dict]:
    """Run ``cfg`` on the current world (process group optional); returns the per-step records on every rank."""
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = world_size_from_env(), rank_from_env()
    plan, resume = check_config(cfg, world_size, rank)
    t, dims, timeout_s = cfg.training, plan.dims, cfg.parallel.collective_timeout_s
    locks: list[RunLock] = []
    writer, records, checkpoints, watch, profiler = None, [], None, None, None
    recorder_variables: list[str] = []  # the flight recorder's variables this run set (removed at the end)
    signals = (STARTUP_SIGNALS or StopSignals()).install()  # SIGTERM/SIGINT stop the run after a step
    signals.announce = True  # the configuration is accepted: from here on a signal is a stop request
    try:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun: stop if torchrun dies
            watch = ParentWatch(grace_s=timeout_s + 60).start()
        device = select_device(t.device)
        # The run folders are locked before any process group starts, so that a second run on them is refused
        # in seconds; when every rank can look at the locks itself, every rank refuses at once
        # (runtime/run_dir.py, step 2).
        uses_checkpoints = cfg.checkpoint.interval > 0 or resume.candidates or resume.damaged
        folders = [("run.dir", Path(cfg.run.dir))]
        folders += [("checkpoint.folder", checkpoint_folder(cfg))] if uses_checkpoints else []
        every_rank_looks = not dist.is_initialized() and all_on_one_node(world_size)
        lock_error = lock_run_folders(folders, locks, rank, look=every_rank_looks)
        if lock_error is not None and every_rank_looks:
            raise lock_error
        recorder, recorder_variables = enable_flight_recorder(cfg.run.dir)  # before any group: torch reads them
        if device.type == "cuda" and lock_error is None:  # NCCL's watchdog dumps there on a timeout
            recorder.mkdir(parents=True, exist_ok=True)
        control = init_process_group(device, timeout_s)
        control.raise_if_any_failed(lock_error, "locking the run folders", ConfigError)
        torch.manual_seed(t.seed)
        meshes = build_mesh(
            dims,
            device,
            timeout_s,
            has_experts=plan.model.moe is not None,
            host_tensors=cfg.parallel.fsdp_cpu_offload,
            fsdp_with_tp=plan.fsdp and dims.tp > 1,
        )
        assert meshes.pp.get_local_rank() == plan.pp_rank, "the plan's pp rank must match the mesh coordinate"
        is_logger = dist.get_rank() == 0
        checkpoints = CheckpointManager(cfg, plan, resume, control, device)
        with phase("checking the checkpoint folder and the resume checkpoint", "control plane"):
            checkpoints.start()

        with phase("building and parallelizing the model", "device plane"):
            parts = model_parts(cfg, plan, meshes, device)  # mesh/parallelize.py, in its order
        schedule, timeline = None, None
        if dims.pp > 1:
            schedule, stages = build_pipeline_schedule(
                parts,
                list(plan.stage_ids),
                plan.n_stages,
                schedule=plan.pp_schedule,
                microbatches=plan.pp_microbatches,
                pp_group=meshes.pp.get_group(),
                device=device,
                loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / plan.global_tokens,
            )
            if cfg.run.pp_timeline:
                timeline = PipelineTimeline(plan.pp_rank, device)
                for stage in stages:
                    timeline.instrument(stage)
        # A tied embedding's two pipeline copies and their embedding group (every rank: it may create groups).
        tied = TiedEmbeddings.build(parts, meshes, timeout_s)
        optimizers = Optimizers(parts, cfg, replicate_group=meshes.world["dp_replicate"].get_group())
        params = [p for part in parts for p in part.parameters()]
        named_params = [(name, p) for part in parts for name, p in part.named_parameters()]
        counted = tied.counted(params)  # the gradient norm counts a tied weight once
        moe_layer_ids = [i for i in range(plan.model.n_layers) if plan.model.is_moe_layer(i)]
        data = load_data(cfg)
        # cp ranks of one dp rank read the same windows; each keeps its chunks of every sequence
        positions = load_balanced_positions(t.seq_len, meshes.cp.get_local_rank(), dims.cp) if dims.cp > 1 else None
        loader = GlobalBatchLoader(
            data.train,
            seq_len=t.seq_len,
            global_batch=t.global_batch,
            micro_batch=plan.micro_batch,
            dp_rank=meshes.dp.get_local_rank(),
            dp_size=dims.dp,
            positions=positions,
        )
        val_loader = (
            None
            if data.val is None
            else GlobalBatchLoader(
                data.val,
                seq_len=t.seq_len,
                global_batch=t.global_batch,
                micro_batch=plan.micro_batch,
                dp_rank=meshes.dp.get_local_rank(),
                dp_size=dims.dp,
                positions=positions,
            )
        )
        # Weights, optimizer, LR schedule, data position and RNG from the checkpoint (or init_from weights).
        with phase("loading the checkpoint", "checkpoint group"):
            start_step = checkpoints.restore(parts, optimizers, loader)
        if is_logger:
            local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
            mesh_lines = mesh_banner(meshes.world)
            print(plan.banner(mesh_lines, local_params, device, t.mixed_precision, data.description), flush=True)
        metrics_from = checkpoints.resumed_step
        if metrics_from is None and restart_attempt() > 0 and resume.mode == "auto":
            metrics_from = 0  # a restart before the first checkpoint replays everything
        writer = open_metrics(cfg, control, is_logger, metrics_from)
        tp_label = ", then tp (its ranks split the tokens)" if dims.tp > 1 else ""
        model_groups = "device plane: " + ", ".join(
            n for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if getattr(dims, n) > 1
        )
        throughput = Throughput(
            plan.model, t.seq_len, world_size, peak_tflops(t.peak_tflops, device, t.mixed_precision)
        )
        profiler = step_profiler(cfg, rank, device, first_step=start_step + 1)
        balance = RankBalance(rank, device)
        for step in range(start_step + 1, t.steps + 1):
            profiler.begin_step(step)
            start = device_time(device)
            balance.start(start)
            loss_sum = torch.zeros((), device=device)
            with named_range("data loading"):
                batch = loader.next_batch()
            with phase(f"step {step}: forward and backward", model_groups or "none (one process)"):
                if timeline is not None:
                    timeline.begin_step()  # after data loading: the window holds only the pipeline's work
                for index, (inputs, targets) in enumerate(batch):
                    # grad_sync=step: only the last micro-batch reduces; forward and backward inside the window
                    reduce = cfg.parallel.grad_sync == "microbatch" or index == len(batch) - 1
                    with reduction_window(parts, reduce=reduce, hsdp=dims.dp_replicate > 1):
                        loss_sum += forward_backward(
                            parts, schedule, plan, inputs.to(device), targets.to(device), dims.tp > 1
                        )
                if timeline is not None:
                    timeline.end_step()
                if dims.tp > 1:
                    reduce_partial_gradients(params)
                    if moe_layer_ids:  # each tp rank computed its MoE blocks' gradients from its own tokens
                        sum_token_split_gradients(parts, meshes.tp)
                # Pipeline + tied embeddings: the first and last stage's copies get the sum of their gradients,
                # after every micro-batch's backward and reduction, before the norm sees them.
                tied.sum_gradients()
            with phase(f"step {step}: loss sum and gradient norm", "device plane: the loss mesh (pp x dp x cp), pp"):
                # The step's global numbers, before anything changes: the loss is the global mean (sum the
                # token-loss sums over the dp and cp ranks and the pp stages; only last-stage ranks hold a
                # non-zero sum), the gradient norm the norm of the whole model's gradient.
                sum_over(loss_sum, meshes.loss)
                optimizers.prepare_gradients()  # 1-bit Adam: the replicas' exchange (mesh/onebit_adam.py)
                with named_range("gradient clipping"):
                    grad_norm = optimizers.agree_on_norm(clip_grad_norm(params, t.grad_clip, meshes.pp, counted))
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
            checkpoints.wait_staged()  # an async save's copy: the step changes the weights and Adam state it copies
            with named_range("optimizer"):
                optimizers.step()
            # MoE: global expert load of the step (metrics), and the aux-loss-free bias update from it.
            with phase(f"step {step}: MoE expert load", "device plane: the loss mesh (pp x dp x cp)" + tp_label):
                moe_load = step_expert_load(parts, moe_layer_ids, meshes.loss, meshes.tp) if moe_layer_ids else {}
            end = device_time(device)
            elapsed, compute_s = end - start, balance.elapsed(end)
            # After the step is timed (a check step's throughput stays comparable), before anything is logged or saved.
            if cfg.debug.check_replicas and step % cfg.debug.check_replicas == 0:
                with phase(f"step {step}: replica check", "device plane: each replica group; control plane"):
                    check_replicas(
                        named_params,
                        meshes.world,
                        device,
                        control,
                        step,
                        cfg.debug.check_replicas_action,
                        extra=tied_replicas(tied.copies, tied.group),
                    )
            record = {
                "step": step,
                "loss": loss,
                "grad_norm": norm,
                "lr": lr,
                "tokens_per_s": plan.global_tokens / elapsed,
                **throughput.fields(plan.global_tokens / elapsed),
                "peak_mem_bytes": peak_memory_bytes(device),
                "tokens_consumed": loader.tokens_consumed,
                **load_metrics(moe_load),
            }
            if eval_due(step, cfg.eval.interval, t.steps):
                with phase(f"step {step}: validation", model_groups or "none (one process)"):
                    record["val_loss"] = evaluate(
                        parts, schedule, val_loader, plan, meshes, steps=cfg.eval.steps, device=device
                    )
            records.append(record)
            with phase(f"saving step {step}", "checkpoint group, control plane"), named_range("checkpoint save"):
                checkpoints.maybe_save(step, parts, optimizers, loader)
            with phase(f"step {step}: agreeing whether to stop", "control plane"):
                # every rank's compute time rides on the agreement (training/rank_balance.py, step 2)
                signum, compute_times = signals.agreed_stop(control, compute_s)
                signum = signum if step < t.steps else None
            record.update(balance_fields(compute_times))
            if step % cfg.run.log_every == 0 or step == t.steps or "val_loss" in record:
                writer.log(record)
                warning = balance.check(record)
                if is_logger:
                    print(format_step(record), flush=True)
                    if warning:
                        print(warning, flush=True)
            profiler.end_step(step)
            if signum is not None:
                stop_after(cfg, step, signum, checkpoints, parts, optimizers, loader)
        with phase("finishing the last save", "checkpoint group, control plane"):
            checkpoints.finish()
        if timeline is not None:
            pp_ranks = dist.get_process_group_ranks(meshes.pp.get_group())
            write_pipeline_timeline(cfg.run.dir, plan, timeline, pp_ranks, control, is_logger)
    finally:
        if profiler is not None:
            profiler.close()  # writes the trace when the run ended inside the profiled steps
        if checkpoints is not None:
            checkpoints.close()  # a save in flight finishes writing and its thread stops, on every exit path
        if writer is not None:
            writer.close()
        for lock in locks:
            lock.release()
        if watch is not None:
            watch.stop()
        disable_flight_recorder(recorder_variables)
        signals.uninstall()
    return records


def stop_after(cfg: Config, step: int, signum: int, checkpoints, parts, optimizers, loader) -> None:
    """The ranks agreed to stop after ``step`` on a signal: save it (unless just saved), say how to resume."""
    import signal as signal_module

    name = signal_module.Signals(signum).name
    if cfg.checkpoint.interval > 0 and checkpoints.last_saved != step:
        with phase(f"saving step {step} after {name}", "checkpoint group, control plane"):
            checkpoints.save(step, parts, optimizers, loader)
    checkpoints.finish()
    if cfg.checkpoint.interval > 0:
        saved = f"step {step} is saved in {checkpoints.folder}"
        how = f"resume with: {resume_command()}"  # shell-quoted, the launcher's own options, resume auto
    else:
        saved = "nothing was saved (checkpoint.interval is 0)"
        how = "set --checkpoint.interval to save on the next stop"
    raise StopRequested(signum, f"stopped by {name} after step {step}; {saved}; {how}")


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


def explain_communication_failure(exc: BaseException, cfg: Config) -> str:
    """The one-line report of a timed-out or broken collective, after this rank's flight recorder is written to
    run.dir (gloo: nothing else writes it; runtime/failures.py, "Which collective")."""
    last, dumped = None, None
    try:
        dump = flight_recorder_dump()
        last = last_collective(dump)
        dumped = write_flight_recorder(dump, cfg.run.dir, dist.get_rank() if dist.is_initialized() else 0)
    except Exception as error:  # noqa: BLE001 - the report must come out even if the recorder cannot
        print(f"meshloom: could not write the flight recorder: {error}", file=sys.stderr, flush=True)
    return explain(exc, cfg.parallel.collective_timeout_s, last, dumped)


def say_last(message: str) -> None:
    """``message`` on stderr in one write, newline included: torchrun merges every rank's stderr into one stream,
    and ``print`` writes the text and its newline separately, so two ranks' lines could interleave mid-line."""
    sys.stderr.write(f"meshloom: {message}\n")
    sys.stderr.flush()


def fail(message: str, code: int) -> int:
    # Printed by every rank: whichever rank's output the user reads ends with the fix.
    say_last(message)
    report_to_launcher(message)
    return code


def main(argv: list[str]) -> int:
    """Exit status: 0 done; 2 bad input; 3 diverged; 4 a collective or a checkpoint save failed, or replicas
    disagree (debug.check_replicas); 128+signal after a SIGTERM/SIGINT stop."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    cfg = None
    try:
        dry, world_size, argv = parse_dry_run(argv)
        cfg = load_config(argv)
        if dry:
            adopt_folder_config(cfg)  # the config and the layout for world_size ranks, then stop (mesh/dry_run.py)
            print(dry_run(cfg, world_size), flush=True)
            return 0
        train(cfg)
    except ConfigError as exc:
        return fail(f"configuration error: {exc}", 2)
    except FloatingPointError as exc:
        return fail(f"training diverged: {exc}", 3)
    except CheckpointSaveError as exc:
        return fail(f"checkpoint save failed: {exc}", 4)
    except ReplicaMismatchError as exc:
        return fail(str(exc), 4)
    except StopRequested as exc:
        say_last(str(exc))
        return 128 + exc.signum
    except Exception as exc:
        if not is_communication_failure(exc) or cfg is None:
            raise
        return fail(explain_communication_failure(exc, cfg), 4)
    finally:
        destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Exit now: everything was closed above, and the interpreter's own teardown (hundreds of ms with torch)
    # runs with default signal handlers, so torchrun's SIGTERM to the last workers would replace their exit
    # status with -15.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
