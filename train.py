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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from checkpoint.folder import check_writable, checkpoint_bytes, checkpoint_folder, locked_folders
from checkpoint.hf_folder import folder_model
from checkpoint.manager import CheckpointManager, CheckpointSaveError
from checkpoint.resume import Resume, find_resume
from data.dataset import check_data, epoch_steps, load_data, stream_span, wrap_notice
from mesh.dims import mesh_banner
from mesh.private_api import flight_recorder_dump
from models.local_tensor import local_tensor
from observers.base import RunContext
from observers.profiling import named_range
from observers.rank_balance import RankBalance
from observers.rank_balance import fields as balance_fields
from observers.registry import add_observers
from observers.replica_check import ReplicaMismatchError
from planning.dry_run import dry_run
from planning.layout_rules import check_memory
from planning.plan import LayoutPlan
from planning.simulate import run_simulation
from runtime.command_line import first_run_args, next_commands, parse_command_line
from runtime.config import ConfigError, help_text, load_config
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
from runtime.run_dir import RunFolderLost, all_on_one_node, check_run_dir, folder_lost, refuse_live_runs
from runtime.signals import StopRequested, loop_started, restart_attempt, resume_command
from runtime.startup import start_process
from training.build import build_meshes, build_step
from training.evaluation import eval_due, evaluate_step
from training.loaders import run_loaders
from training.metrics import MetricsWriter, Progress, format_step, open_metrics
from training.mfu import Throughput, peak_tflops
from training.simulated_rank import simulate_rank
from training.step import StepParts, train_step

if TYPE_CHECKING:
    from runtime.schema import Config


def check_config(cfg: Config, world_size: int, rank: int = 0) -> tuple[LayoutPlan, Resume]:
    """Every check that needs no process group, the same ConfigError on every rank; the plan and the resume."""
    model = folder_model(cfg)  # a transformers folder in checkpoint.init_from gives [model] (its config.json)
    steps = epoch_steps(cfg, model.vocab_size)  # training.epochs makes the steps from the data's size
    plan = LayoutPlan.resolve(cfg, world_size, rank, model_config=model, steps=steps)  # values, then layout rules
    if cfg.run.memory_check:  # the estimate per rank against the machine, before anything is allocated
        check_memory(plan, memory_per_rank(cfg.training.device))
    check_data(cfg, model.vocab_size, steps)  # tokenizer, token-file headers, vocab, dataset and split sizes
    if all_on_one_node(world_size):  # a live run's folders: in use, whatever else holds (several nodes: the lock)
        refuse_live_runs(locked_folders(cfg, uses_checkpoints=True))
    resume = find_resume(cfg, plan)
    # A resumed run (or a torchrun restart with resume auto) continues run.dir's metrics instead of refusing them.
    resuming = resume.newest is not None or (restart_attempt() > 0 and resume.mode == "auto")
    check_run_dir(cfg.run.dir, cfg.run.overwrite, resuming=resuming)
    if cfg.checkpoint.interval > 0:
        check_writable(checkpoint_folder(cfg), checkpoint_bytes(plan.model.num_params()))
    return plan, resume


@dataclass
class Run:
    """What ``build`` made for this rank: the step's parts, and what the loop around the step uses."""

    cfg: Config
    step: StepParts  # model parts, schedule, optimizer, loader, observers: training/step.py
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
    folders = locked_folders(cfg, uses_checkpoints=bool(resume.candidates or resume.damaged))
    device, control = start_process(cfg, folders, plan.dims.world_size, plan.rank, stack)
    precision = plan.layout.mixed_precision
    tf32 = enable_tf32(device, precision)  # fp32 on CUDA: TF32 matmuls (runtime/process.py)
    torch.manual_seed(t.seed)
    meshes = build_meshes(plan, device, timeout_s)
    assert meshes.pp.get_local_rank() == plan.pp_rank, "the plan's pp rank must match the mesh coordinate"
    checkpoints = CheckpointManager(cfg, plan, resume, control, device)
    stack.callback(checkpoints.close)  # a save in flight finishes writing and its thread stops
    with phase("checking the checkpoint folder and the resume checkpoint", "control plane"):
        checkpoints.start()
    data = load_data(cfg, plan.model.vocab_size, plan.steps)
    loader, val_loader = run_loaders(data, plan, meshes, cfg.data.allow_empty_steps)
    peak = peak_tflops(t.peak_tflops, device, "tf32" if tf32 else precision)
    throughput = Throughput(plan.model, t.seq_len, plan.dims.world_size, peak)
    with phase("building and parallelizing the model", "device plane"):
        # an async save's copy is taken before the weights change (checkpoints.wait_staged)
        step = build_step(cfg, plan, meshes, device, loader, throughput, before_update=checkpoints.wait_staged)
    # Weights, optimizer, LR schedule, data position and RNG from the checkpoint (or init_from weights).
    with phase("loading the checkpoint", "checkpoint group"):
        start_step = checkpoints.restore(step.parts, step.optimizers, loader)
    is_logger = dist.get_rank() == 0
    if is_logger:
        local = sum(local_tensor(p).numel() for m in step.parts for p in m.parameters())
        banner = precision_banner(precision, tf32)
        print(plan.banner(mesh_banner(meshes.world), local, device, banner, data.description), flush=True)
    metrics_from = checkpoints.resumed_step
    if metrics_from is None and restart_attempt() > 0 and resume.mode == "auto":
        metrics_from = 0  # a restart before the first checkpoint replays everything
    writer = open_metrics(cfg.run.dir, cfg.run.tensorboard, control, is_logger, metrics_from)
    stack.callback(writer.close)
    balance = add_run_observers(step, cfg, control, start_step, stack)
    run = Run(cfg, step, control, checkpoints, val_loader, writer, balance, start_step, is_logger)
    run.progress = Progress(plan.steps, start_step, t.global_batch * t.seq_len)
    run.span = stream_span(int(data.train.shape[0]), t.seq_len)
    return run


def add_run_observers(step: StepParts, cfg: Config, control, start_step: int, stack) -> RankBalance:
    """The run's observers (observers/registry.py) into ``step.observers``, each one only when its config key asks
    for it; closed by ``stack``. Returns the rank-balance clock, which rides on the stop agreement."""
    stack.callback(step.observers.close)  # the profiler writes a trace still open when the run ends inside it
    add_observers(step.observers, RunContext(cfg, step, control, start_step))
    return step.observers.named("rank_balance")


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
        for step in range(run.start_step + 1, run.step.plan.steps + 1):
            signum = loop_step(run, step, signals)
            if signum is not None:
                stop_after(run, step, signum)
        with phase("finishing the last save", "checkpoint group, control plane"):
            run.checkpoints.finish()
        run.step.observers.finish()  # the pipeline timeline is gathered and written
    if run.is_logger and run.checkpoints.last_saved is not None:
        print(next_commands(run.checkpoints.folder, cfg.run.dir), flush=True)
    return run.records


def loop_step(run: Run, step: int, signals: StopSignals) -> int | None:
    """One step of the loop: train, validate when due, save when due, agree on stopping, log; the signal to stop
    on, or None."""
    cfg, s, last = run.cfg, run.step, run.step.plan.steps
    s.observers.begin_step(step)
    log = step % cfg.run.log_every == 0 or step == last or eval_due(step, cfg.eval.interval, last)
    agree = log or step % cfg.run.agree_every == 0  # the stop agreement: not every step (run.agree_every)
    # training/step.py; on a log step it reads the loss and grad norm; before an agreement or a save, the
    # divergence flag (a non-finite step is never saved, and every rank stops on the same step)
    record = train_step(s, step, log, check=agree or run.checkpoints.due(step))
    if eval_due(step, cfg.eval.interval, last):
        with phase(f"step {step}: validation", s.device_groups):
            record["val_loss"] = evaluate_step(s, run.val_loader, cfg.eval.steps)
    run.records.append(record)
    with phase(f"saving step {step}", "checkpoint group, control plane"), named_range("checkpoint save"):
        run.checkpoints.maybe_save(step, s.parts, s.optimizers, s.loader)
    signum = None
    if agree:
        with phase(f"step {step}: agreeing whether to stop", "control plane"):
            # every rank's compute time rides on the agreement (observers/rank_balance.py, step 2)
            signum, compute_times = signals.agreed_stop(run.control, run.balance.compute_s)
        record.update(balance_fields(compute_times))
    wrapped = wrap_notice(step, run.span, cfg.training.seq_len, cfg.training.global_batch, last)
    if run.is_logger and wrapped:
        print(wrapped, flush=True)
    if log:
        lost = folder_lost()  # run.dir removed or replaced under the run: stop before writing (runtime/run_dir.py)
        if lost is not None:
            raise lost
        run.writer.log(record)
        lines = s.observers.after_log(record)  # the rank-balance warning
        if run.is_logger:
            print("\n".join([f"{format_step(record)} | {run.progress.line(step)}", *lines]), flush=True)
    s.observers.end_step(step)
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
        command = parse_command_line(argv)  # a run, --dry-run or --simulate (runtime/command_line.py)
        cfg = load_config(command.config_args)
        cfg = load_config(first_run_args(command.config_args, cfg.training.steps))  # no --config: save at the end
        if command.mode == "simulate":  # two steps of one rank per pipeline stage, faked (planning/simulate.py)
            print(run_simulation(cfg, command, simulate_rank, folder_model(cfg)), flush=True)
            return 0
        if command.mode == "dry-run":  # the config and the layout for world_size ranks (planning/dry_run.py)
            print(
                dry_run(cfg, command.world_size, folder_model(cfg), command.target_device(cfg.training.device)),
                flush=True,
            )
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
