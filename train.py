"""Train a Llama-style model on any parallel layout: check -> build -> a loop of train_step.

    python train.py                                   # the embedded default, one process
    torchrun --standalone --nproc-per-node 4 train.py --config configs/debug.toml --parallel.dp_shard 4
    python train.py --dry-run --world-size 16 --config configs/debug.toml --parallel.tp 4   # check a layout
    python train.py --simulate --world-size 1024 --config configs/llama3_70b.toml --pp-ranks 0,15  # measure it

Every layout trains the same model as one process: the initial weights are a function of (seed, name),
each data-parallel rank reads its slice of the same global batches, and the loss is the sum of token
losses over the global batch divided by the global token count.

The file reads top to bottom as the algorithm:

1. ``check_config``: every check that needs no process group (layout, memory, data, run.dir), on every rank;
2. ``build``: the process group and the one mesh, the model parts parallelized (mesh/parallelize.py), the
   pipeline schedule, the optimizer, the data loaders, the checkpointer (restoring a resumed run), the
   metrics writer and the run's observers (observers/base.py: hooks the loop calls whichever observers are on);
3. ``train``: for each step, ``train_step`` (training/step.py), then validation, a save, the agreement on
   whether to stop (every ``run.agree_every`` steps and on log steps), and the log line;
4. ``main``: the exit status of every way a run ends (the user-facing contract).
"""

from __future__ import annotations

from runtime.signals import StopSignals  # standard library only, so it can come first

# Under torchrun, a worker whose peer fails at start-up gets SIGTERM, maybe while it is still importing torch;
# recording signals from the very start lets every worker still finish its own checks and exit with its own
# code (runtime/signals.py, step 1).
STARTUP_SIGNALS = StopSignals().install() if __name__ == "__main__" else None

import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.folder import check_writable, checkpoint_bytes, checkpoint_folder
from checkpoint.hf_folder import adopt_folder_config
from checkpoint.manager import CheckpointManager, CheckpointSaveError
from checkpoint.resume import Resume, find_resume
from data.dataset import check_data, load_data, passes_done, resolve_epochs, stream_span
from mesh.dims import build_mesh, mesh_banner
from mesh.parallelize import build_model_parts
from mesh.private_api import flight_recorder_dump
from mesh.tied_embeddings import TiedEmbeddings
from models.local_tensor import local_tensor
from observers.base import Observers, RunContext
from observers.profiling import named_range
from observers.rank_balance import RankBalance
from observers.rank_balance import fields as balance_fields
from observers.registry import add_observers
from observers.replica_check import ReplicaMismatchError
from planning.dry_run import dry_run, parse_dry_run
from planning.layout_rules import check_memory
from planning.options import parallel_options
from planning.plan import LayoutPlan
from planning.simulate import parse_simulate, run_simulation
from runtime.config import Config, ConfigError, help_text, load_config
from runtime.failures import explain_failure, fail, is_communication_failure, phase, say_last
from runtime.process import (
    ControlPlane,
    destroy_process_group,
    enable_tf32,
    memory_per_rank,
    precision_banner,
    rank_from_env,
    world_size_from_env,
)
from runtime.run_dir import RunFolderLost, check_run_dir, folder_lost
from runtime.signals import StopRequested, loop_started, restart_attempt, resume_command
from runtime.startup import start_process
from training.evaluation import eval_due, evaluate
from training.loaders import batch_loader
from training.metrics import MetricsWriter, Progress, format_step, open_metrics
from training.mfu import Throughput, peak_tflops
from training.optimizer import Optimizers
from training.simulated_rank import simulate_rank
from training.step import StepParts, divergence_advice, pipeline_schedule, train_step


def check_config(cfg: Config, world_size: int, rank: int = 0) -> tuple[LayoutPlan, Resume]:
    """Every check that needs no process group, the same ConfigError on every rank; returns the plan and resume
    decision."""
    adopt_folder_config(cfg)  # a transformers folder in checkpoint.init_from sets [model] (its config.json)
    resolve_epochs(cfg)  # training.epochs sets training.steps from the data's size
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


@dataclass
class Run:
    """What ``build`` made for this rank: the step's parts, and what the loop around the step uses."""

    cfg: Config
    step: StepParts  # model parts, schedule, optimizer, loader, extras: training/step.py
    control: ControlPlane  # the CPU group for small control messages (runtime/process.py)
    checkpoints: CheckpointManager
    val_loader: object  # the validation loader, or None
    writer: MetricsWriter
    balance: RankBalance  # each rank's step compute time, shared on the stop agreement (observers/rank_balance.py)
    start_step: int  # the last step already done (0, or the resumed checkpoint's)
    is_logger: bool
    records: list[dict] = field(default_factory=list)
    progress: Progress | None = None  # steps, tokens, elapsed and ETA on each log line
    span: int = 0  # the tokens of one pass over the training stream (data/dataset.py: stream_span)


def build(cfg: Config, plan: LayoutPlan, resume: Resume, stack: contextlib.ExitStack) -> Run:
    """Step 2 of the module docstring; everything that needs closing is closed by ``stack``, on every exit path."""
    t, timeout_s = cfg.training, cfg.parallel.collective_timeout_s
    device, control = start_process(cfg, run_folders(cfg, resume), plan.dims.world_size, plan.rank, stack)
    tf32 = enable_tf32(device, t.mixed_precision)  # fp32 on CUDA: TF32 matmuls (runtime/process.py)
    torch.manual_seed(t.seed)
    meshes = build_mesh(
        plan.dims,
        device,
        timeout_s,
        has_experts=plan.model.moe is not None,
        host_tensors=cfg.parallel.fsdp_cpu_offload,  # CPU offload: the groups also reduce host tensors
        fsdp_with_tp=plan.fsdp and plan.dims.tp > 1,
    )
    assert meshes.pp.get_local_rank() == plan.pp_rank, "the plan's pp rank must match the mesh coordinate"
    checkpoints = CheckpointManager(cfg, plan, resume, control, device)
    stack.callback(checkpoints.close)  # a save in flight finishes writing and its thread stops
    with phase("checking the checkpoint folder and the resume checkpoint", "control plane"):
        checkpoints.start()
    with phase("building and parallelizing the model", "device plane"):
        options = parallel_options(cfg, plan, meshes, device)  # typed, from the config (planning/options.py)
        parts = build_model_parts(plan.model, plan.stage_layers, plan.stage_ids, meshes, options, device)
    schedule, stages, loss_divisor = pipeline_schedule(parts, plan, meshes, device)  # None, [], None without pipelining
    # A tied embedding's two pipeline copies and their embedding group (every rank: it may create groups).
    tied = TiedEmbeddings.build(parts, meshes, timeout_s)
    optimizers = Optimizers(parts, cfg, replicate_group=meshes.world["dp_replicate"].get_group())
    data = load_data(cfg)
    loader = batch_loader(data.train, plan, meshes, data.train_documents)
    loader.allow_empty_steps = cfg.data.allow_empty_steps  # else a step with no trained token stops the run
    val_loader = None if data.val is None else batch_loader(data.val, plan, meshes, data.val_documents)
    if val_loader is not None:
        val_loader.allow_empty_steps = True  # its divisor is the sum over eval.steps batches
    # Weights, optimizer, LR schedule, data position and RNG from the checkpoint (or init_from weights).
    with phase("loading the checkpoint", "checkpoint group"):
        start_step = checkpoints.restore(parts, optimizers, loader)
    is_logger = dist.get_rank() == 0
    if is_logger:
        local = sum(local_tensor(p).numel() for m in parts for p in m.parameters())
        precision = precision_banner(t.mixed_precision, tf32)
        print(plan.banner(mesh_banner(meshes.world), local, device, precision, data.description), flush=True)
    metrics_from = checkpoints.resumed_step
    if metrics_from is None and restart_attempt() > 0 and resume.mode == "auto":
        metrics_from = 0  # a restart before the first checkpoint replays everything
    writer = open_metrics(cfg.run.dir, cfg.run.tensorboard, control, is_logger, metrics_from)
    stack.callback(writer.close)
    extras, balance = build_extras(cfg, plan, meshes, device, control, parts, stages, tied, start_step, stack)
    peak = peak_tflops(t.peak_tflops, device, "tf32" if tf32 else t.mixed_precision)
    throughput = Throughput(plan.model, t.seq_len, plan.dims.world_size, peak)
    step = StepParts(
        parts,
        schedule,
        plan,
        meshes,
        device,
        optimizers,
        loader,
        tied,
        throughput,
        extras,
        loss_divisor,
        reduce_every_microbatch=cfg.parallel.grad_sync == "microbatch",  # else only the last micro-batch
        grad_clip=t.grad_clip,
        advice=divergence_advice(cfg),
        before_update=checkpoints.wait_staged,  # an async save's copy is taken before the weights change
    )
    run = Run(cfg, step, control, checkpoints, val_loader, writer, balance, start_step, is_logger)
    run.progress = Progress(t.steps, start_step, t.global_batch * t.seq_len)
    run.span = stream_span(int(data.train.shape[0]), t.seq_len)
    return run


def run_folders(cfg: Config, resume: Resume) -> list[tuple[str, Path]]:
    """The (field, folder) pairs this run locks: run.dir, and the checkpoint folder when the run uses one."""
    folders = [("run.dir", Path(cfg.run.dir))]
    if cfg.checkpoint.interval > 0 or resume.candidates or resume.damaged:
        folders.append(("checkpoint.folder", checkpoint_folder(cfg)))
    return folders


def build_extras(
    cfg, plan, meshes, device, control, parts, stages, tied, start_step, stack
) -> tuple[Observers, RankBalance]:
    """The run's observers (observers/registry.py), each one only when its config key asks for it, and the
    rank-balance clock among them, by name; closed by ``stack``."""
    observers = Observers()
    stack.callback(observers.close)  # the profiler writes a trace still open when the run ends inside it
    add_observers(observers, RunContext(cfg, plan, meshes, device, control, parts, stages, tied, start_step))
    return observers, observers.named("rank_balance")


def train(cfg: Config) -> list[dict]:
    """Run ``cfg`` on the current world (process group optional); returns the per-step records on every rank."""
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = world_size_from_env(), rank_from_env()
    plan, resume = check_config(cfg, world_size, rank)
    signals = (STARTUP_SIGNALS or StopSignals()).install()  # SIGTERM/SIGINT stop the run after a step
    signals.announce = True  # the configuration is accepted: from here on a signal is a stop request
    with contextlib.ExitStack() as stack:
        stack.callback(signals.uninstall)
        run = build(cfg, plan, resume, stack)
        loop_started()  # a launcher that dies from here on stops the run after a saved step (runtime/signals.py)
        for step in range(run.start_step + 1, cfg.training.steps + 1):
            signum = loop_step(run, step, signals)
            if signum is not None:
                stop_after(run, step, signum)
        with phase("finishing the last save", "checkpoint group, control plane"):
            run.checkpoints.finish()
        run.step.extras.finish()  # the pipeline timeline is gathered and written
    return run.records


def loop_step(run: Run, step: int, signals: StopSignals) -> int | None:
    """One step of the loop: train, validate when due, save when due, agree on stopping, log; the signal to stop
    on, or None."""
    cfg, s, last = run.cfg, run.step, run.cfg.training.steps
    s.extras.begin_step(step)
    log = step % cfg.run.log_every == 0 or step == last or eval_due(step, cfg.eval.interval, last)
    agree = log or step % cfg.run.agree_every == 0  # the stop agreement: not every step (run.agree_every)
    # training/step.py; on a log step it reads the loss and grad norm; before an agreement or a save, the
    # divergence flag (a non-finite step is never saved, and every rank stops on the same step)
    record = train_step(s, step, log, check=agree or run.checkpoints.due(step))
    if eval_due(step, cfg.eval.interval, last):
        with phase(f"step {step}: validation", s.device_groups):
            record["val_loss"] = evaluate(
                s.parts,
                s.schedule,
                run.val_loader,
                s.plan,
                s.meshes,
                steps=cfg.eval.steps,
                device=s.device,
                loss_divisor=s.loss_divisor,
            )
    run.records.append(record)
    with phase(f"saving step {step}", "checkpoint group, control plane"), named_range("checkpoint save"):
        run.checkpoints.maybe_save(step, s.parts, s.optimizers, s.loader)
    signum = None
    if agree:
        with phase(f"step {step}: agreeing whether to stop", "control plane"):
            # every rank's compute time rides on the agreement (observers/rank_balance.py, step 2)
            signum, compute_times = signals.agreed_stop(run.control, run.balance.compute_s)
        record.update(balance_fields(compute_times))
    t = cfg.training
    wraps = passes_done(step, run.span, t.seq_len, t.global_batch)
    if run.is_logger and wraps > passes_done(step - 1, run.span, t.seq_len, t.global_batch):
        total = t.steps * t.global_batch * t.seq_len / run.span
        print(
            f"data: step {step} wrapped the training stream: pass {wraps + 1} begins (the run makes {total:.2f})",
            flush=True,
        )
    if log:
        lost = folder_lost()  # run.dir removed or replaced under the run: stop before writing (runtime/run_dir.py)
        if lost is not None:
            raise lost
        run.writer.log(record)
        lines = s.extras.after_log(record)  # the rank-balance warning
        if run.is_logger:
            print("\n".join([f"{format_step(record)} | {run.progress.line(step)}", *lines]), flush=True)
    s.extras.end_step(step)
    return signum if step < last else None


def stop_after(run: Run, step: int, signum: int) -> None:
    """The ranks agreed to stop after ``step`` on a signal: save it (unless just saved), say how to resume."""
    cfg, checkpoints, s = run.cfg, run.checkpoints, run.step
    name = signal.Signals(signum).name
    if cfg.checkpoint.interval > 0 and checkpoints.last_saved != step:
        with phase(f"saving step {step} after {name}", "checkpoint group, control plane"):
            checkpoints.save(step, s.parts, s.optimizers, s.loader)
    checkpoints.finish()
    if cfg.checkpoint.interval > 0:
        saved = f"step {step} is saved in {checkpoints.folder}"
        how = f"resume with: {resume_command()}"  # shell-quoted, the launcher's own options, resume auto
    else:
        saved = "nothing was saved (checkpoint.interval is 0)"
        how = "set --checkpoint.interval to save on the next stop"
    raise StopRequested(signum, f"stopped by {name} after step {step}; {saved}; {how}")


def main(argv: list[str]) -> int:
    """Exit status: 0 done; 2 bad input; 3 diverged; 4 a collective or a checkpoint save failed, or replicas
    disagree (debug.check_replicas); 128+signal after a SIGTERM/SIGINT stop."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    cfg = None
    try:
        simulation, argv = parse_simulate(argv)  # --simulate --world-size N ... (planning/simulate.py)
        dry, world_size, argv = parse_dry_run(argv)
        cfg = load_config(argv)
        if simulation:
            adopt_folder_config(cfg)
            print(run_simulation(cfg, simulation, simulate_rank), flush=True)
            return 0
        if dry:
            adopt_folder_config(cfg)  # the config and the layout for world_size ranks, then stop (planning/dry_run.py)
            print(dry_run(cfg, world_size), flush=True)
            return 0
        train(cfg)
    except ConfigError as exc:
        return fail(f"configuration error: {exc}", 2)
    except FloatingPointError as exc:
        return fail(f"training diverged: {exc}", 3)
    except CheckpointSaveError as exc:
        return fail(f"checkpoint save failed: {exc}", 4)
    except (ReplicaMismatchError, RunFolderLost) as exc:
        return fail(str(exc), 4)
    except StopRequested as exc:
        say_last(str(exc))
        return 128 + exc.signum
    except Exception as exc:
        if not is_communication_failure(exc) or cfg is None:
            raise
        return fail(explain_failure(exc, cfg.parallel.collective_timeout_s, cfg.run.dir, flight_recorder_dump), 4)
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
