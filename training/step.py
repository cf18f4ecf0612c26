"""One optimizer step on any layout: the numbered steps of ``train_step``.

1. Read this rank's slice of the next global batch (data/loader.py) and start the step's clock (a CUDA event on a
   GPU, ``time.perf_counter`` on CPU: no wait for the device).
2. Forward and backward of each micro-batch (``forward_backward``); the loss that is backpropagated is the
   token-loss sum divided by the *global* token count (training/loss.py), so data-parallel ranks sum their
   gradients and the scale is applied once. With ``grad_sync = step`` only the last micro-batch's backward
   reduces (savers/reduce_once_per_step.py: ``reduction_window``; forward and backward inside the window).
3. The gradients TP leaves partial are summed (norm weights under sequence parallelism, MoE blocks whose tp
   ranks computed from their own tokens), and a tied embedding's two pipeline copies get the sum of theirs.
4. The step's global numbers, before anything changes: the loss is the global mean (sum the token-loss sums
   over the dp and cp ranks and the pp stages; only last-stage ranks hold a non-zero sum), the gradient norm
   the norm of the whole model's gradient (clipped to ``grad_clip``).
5. A loss or norm that is not finite never reaches the weights, and stops every rank together
   (``DivergenceError``): every rank holds the same global numbers. The decision is made on the device: the
   flag ``first_bad`` (the first non-finite step, 0 while none) is updated without a host read, and the
   optimizer step obeys it (``found_inf``, as fused AdamW does under a GradScaler: the step is skipped and its
   counter rolled back; every later step too). The host reads it only on a *check* step (``read_step``): a log
   step (the loss and norm themselves, of this step and of the unlogged steps before it, and the flag, in one
   ``tolist``; a non-finite step stops before its optimizer step), a stop-agreement step or a save step
   (train.py: the flag alone). So an ordinary step has no host read at all, a non-finite step is never saved,
   and the run stops within ``run.agree_every`` steps. Optimizers that cannot obey the flag (1-bit Adam) check
   every step.
6. The optimizer step (after an async save's copy is taken: the step changes what it copies), then the MoE
   layers' global expert load and their aux-loss-free bias update from it (on the device, obeying the flag;
   the load is read to the host on log steps only).
7. The step's clock stops; the observers' ``after_step`` hooks run (observers/base.py); the record is returned. On a
   log step the records of the steps since the last log get their loss, norm and tokens/s (read in step 5 and
   from the clock, whose events the device has passed by then); on other steps they wait, so a record is
   complete once a later log step (the last step is always one) has run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mesh.dims import MESH_DIMS
from mesh.expert_parallel import load_metrics, step_expert_load
from mesh.grad_clip import clip_grad_norm
from mesh.moe_token_split import sum_token_split_gradients
from mesh.pipeline import build_pipeline_schedule, run_schedule
from mesh.private_api import compiled_frames
from mesh.reductions import sum_over
from mesh.tensor_parallel import loss_context, loss_value, reduce_partial_gradients
from observers.profiling import named_range
from runtime.failures import phase
from runtime.process import clock_reading, seconds_between
from savers.reduce_once_per_step import reduction_window
from training.loaders import to_device
from training.loss import LossDivisor, divisor, token_loss_sum
from training.metrics import peak_memory_bytes

if TYPE_CHECKING:
    from torch import nn

    from data.loader import GlobalBatchLoader
    from mesh.dims import Meshes
    from mesh.tied_embeddings import TiedEmbeddings
    from observers.base import Observer
    from planning.plan import LayoutPlan
    from runtime.schema import Config
    from training.mfu import Throughput
    from training.optimizer import Optimizers


class DivergenceError(FloatingPointError):
    """The loss or the gradient norm of a step is not finite; raised before that step reaches the weights."""


@dataclass
class UnloggedSteps:
    """The steps trained since the last host read (the step's ledger): read together on the next log step."""

    records: list = field(default_factory=list)  # (record, loss, norm, since, start, end) of each such step
    last_end: Any = None  # the previous step's end reading: tokens/s is timed from it (step 7)
    first_bad: Any = None  # step 5's flag on the device: the first non-finite step, 0 while none


@dataclass
class StepParts:
    """What was built for one rank's step (training/build.py: ``build_step``), and the steps not yet logged."""

    parts: list[nn.Module]  # this rank's model parts (the whole model, or its pipeline stages)
    schedule: Any  # the pipeline schedule, or None
    plan: LayoutPlan
    meshes: Meshes
    device: torch.device
    optimizers: Optimizers
    loader: GlobalBatchLoader
    tied: TiedEmbeddings  # a tied embedding's pipeline copies (none without them)
    throughput: Throughput
    observers: Observer  # the run's observers as one (observers/base.py: Observers)
    loss_divisor: LossDivisor | None = None  # what the pipeline schedule's loss divides by (``pipeline_schedule``)
    stages: list = field(default_factory=list)  # the pipeline stages of this rank (none without pipelining)
    grad_clip: float = 1.0
    advice: str = ""  # what a DivergenceError suggests (``divergence_advice``)
    before_update: Callable[[], None] = lambda: None  # the checkpointer's wait for an async save's copy
    unlogged: UnloggedSteps = field(default_factory=UnloggedSteps)
    params: list = field(init=False)
    counted: list = field(init=False)
    moe_layer_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.params = [p for part in self.parts for p in part.parameters()]
        self.counted = self.tied.counted(self.params)  # the gradient norm counts a tied weight once
        args = self.plan.model
        self.moe_layer_ids = [i for i in range(args.n_layers) if args.is_moe_layer(i)]

    @property
    def device_groups(self) -> str:
        """The device-plane groups a forward and backward uses (for runtime/failures.py's report)."""
        dims = self.plan.dims
        names = [n for n in MESH_DIMS if getattr(dims, n) > 1]
        return "device plane: " + ", ".join(names) if names else "none (one process)"


def divergence_advice(cfg: Config, precision: str) -> str:
    """The fix a DivergenceError names: the fields of ``cfg`` that make a step diverge less easily (``precision``:
    the layout's resolved training.mixed_precision)."""
    t = cfg.training
    return (
        f"Lower training.lr (now {t.lr})"
        + (", set training.grad_clip" if t.grad_clip <= 0 else "")
        + (", or try training.mixed_precision=fp32" if precision == "bf16" else "")
        + ", then resume with --checkpoint.resume auto."
    )


def pipeline_schedule(
    parts, plan: LayoutPlan, meshes: Meshes, device: torch.device
) -> tuple[Any, list, LossDivisor | None]:
    """The pipeline schedule over this rank's stages, the stages, and its loss divisor (the step's global trained
    tokens, set each step by ``forward_backward``); ``(None, [], None)`` without pipelining."""
    if plan.dims.pp == 1:
        return None, [], None
    scale = LossDivisor(plan.global_tokens)
    schedule, stages = build_pipeline_schedule(
        parts,
        list(plan.stage_ids),
        plan.layout.n_stages,
        schedule=plan.layout.pp_schedule,
        microbatches=plan.layout.pp_microbatches,
        pp_group=meshes.pp.get_group(),
        device=device,
        loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / scale.tokens,
        shapes=plan.stage_shapes(meshes.tp),  # static stage metadata: no shape inference at the first step
    )
    return schedule, stages, scale


def forward_backward(
    parts,
    schedule,
    plan: LayoutPlan,
    inputs,
    targets,
    *,
    backward: bool = True,
    dtype: torch.dtype | None = None,
    trained_tokens: int | None = None,
    documents: torch.Tensor | None = None,
    loss_divisor: LossDivisor | None = None,
) -> torch.Tensor:
    """One micro-batch's forward and (with ``backward``) backward; returns this rank's token-loss sum (0 off the last
    stage). ``trained_tokens``: the step's global trained targets; ``documents``: for every stage's forward."""
    tokens = plan.global_tokens if trained_tokens is None else divisor(trained_tokens)
    if loss_divisor is not None:  # the pipeline schedule's loss function reads it (``pipeline_schedule``)
        loss_divisor.tokens = tokens
    with loss_context(plan.dims.tp > 1):  # vocab-sharded cross-entropy under TP: forward *and* backward inside
        if schedule is None:
            with named_range("forward"):
                extra = {} if documents is None else {"documents": documents}
                loss = token_loss_sum(parts[0](inputs, **extra), targets)
            if backward:
                with named_range("backward"):
                    (loss / tokens).backward()
            return loss_value(loss.detach()).to(dtype or loss.dtype)
        with named_range("pipeline schedule"):  # the schedule's own per-action ranges nest inside
            losses = run_schedule(
                schedule, list(plan.stage_ids), plan.layout.n_stages, inputs, targets, not backward, documents
            )
        if not losses:
            return torch.zeros((), device=inputs.device, dtype=dtype)
        # the schedule's loss function divides by the step's trained-token count: multiplied back here
        return sum(loss_value(loss.detach()).to(dtype or loss.dtype) for loss in losses) * tokens


def accumulate_gradients(s: StepParts, batch, step: int) -> torch.Tensor:
    """Steps 2-3: every micro-batch's forward and backward, then the gradient sums TP and tied copies need."""
    plan, dims = s.plan, s.plan.dims
    loss_sum = torch.zeros((), device=s.device)
    with phase(f"step {step}: forward and backward", s.device_groups):
        s.observers.before_forward_backward()  # after data loading: the pipeline timeline's window
        for index, (inputs, targets) in enumerate(batch):
            reduce = s.plan.layout.grad_sync == "microbatch" or index == len(batch) - 1
            with reduction_window(s.parts, reduce=reduce, hsdp=dims.dp_replicate > 1):
                inputs, targets = to_device((inputs, targets), s.device)  # pinned, non-blocking on CUDA
                trained = s.loader.trained_tokens  # the global count of trained targets (data/loader.py)
                docs = None if s.loader.documents is None else s.loader.documents[index].to(s.device)
                loss_sum += forward_backward(
                    s.parts,
                    s.schedule,
                    plan,
                    inputs,
                    targets,
                    trained_tokens=trained,
                    documents=docs,
                    loss_divisor=s.loss_divisor,
                )
        s.observers.after_forward_backward()
        if dims.tp > 1:
            reduce_partial_gradients(s.params)
            if s.moe_layer_ids:  # each tp rank computed its MoE blocks' gradients from its own tokens
                sum_token_split_gradients(s.parts, s.meshes.tp, experts=s.meshes.experts_replicated_over_tp)
        # Pipeline + tied embeddings: the first and last stage's copies get the sum of their gradients, after
        # every micro-batch's backward and reduction, before the norm sees them.
        s.tied.sum_gradients()
    return loss_sum


def global_loss_and_norm(s: StepParts, loss_sum: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: the global mean loss and the clipped model's gradient norm, the same on every rank, on the device."""
    with phase(f"step {step}: loss sum and gradient norm", "device plane: the loss mesh (pp x dp x cp), pp"):
        sum_over(loss_sum, s.meshes.loss)
        s.optimizers.prepare_gradients()  # 1-bit Adam: the replicas' exchange (savers/onebit_adam.py)
        with named_range("gradient clipping"):
            grad_norm = s.optimizers.agree_on_norm(clip_grad_norm(s.params, s.grad_clip, s.meshes.pp, s.counted))
        return loss_sum / divisor(s.loader.trained_tokens), grad_norm


def read_step(s: StepParts, loss: torch.Tensor, norm: torch.Tensor, log: bool) -> tuple[int, list[float]]:
    """Step 5's one host read on a check step: (the first non-finite step or 0, the losses and norms read). On a
    log step, the loss and norm of every unlogged step and of this one, then the flag, in one ``tolist`` (the
    unlogged steps' pairs first, this step's last); otherwise the flag alone, and nothing else read."""
    if not log:
        return int(s.unlogged.first_bad), []
    pairs = [t for _, loss_, norm_, *_ in s.unlogged.records for t in (loss_, norm_)]
    # float64: the flag is a step number, exact in float64, and the loss and norm lose nothing
    values = torch.stack([*(t.double() for t in (*pairs, loss, norm)), s.unlogged.first_bad.double()]).tolist()
    return int(values.pop()), values


def flag_non_finite(s: StepParts, loss: torch.Tensor, norm: torch.Tensor, step: int) -> torch.Tensor:
    """Step 5 on the device: ``first_bad`` becomes ``step`` if this step is the first non-finite one; returns the
    optimizer's ``found_inf`` (1.0 once any step was non-finite: nothing from then on is applied)."""
    ledger = s.unlogged
    if ledger.first_bad is None:
        ledger.first_bad = torch.zeros((), dtype=torch.int64, device=loss.device)
    finite = torch.isfinite(loss) & torch.isfinite(norm)
    first_now = torch.full_like(ledger.first_bad, step)
    ledger.first_bad = torch.where(finite | (ledger.first_bad > 0), ledger.first_bad, first_now)
    return (ledger.first_bad > 0).float()


def diverged(s: StepParts, bad: int, step: int, pair: tuple, values: list[float]) -> DivergenceError:
    """The error for the first non-finite step ``bad`` (<= ``step``, whose loss and norm are ``pair``), with
    that step's loss and norm: from ``values`` (a log step's read) or read now (the run stops anyway)."""
    steps = [r["step"] for r, *_ in s.unlogged.records] + [step]
    index = steps.index(bad)
    if values:
        bad_loss, bad_norm = values[2 * index : 2 * index + 2]
    else:
        pairs = [(loss, norm) for _, loss, norm, *_ in s.unlogged.records] + [pair]
        bad_loss, bad_norm = torch.stack([t.double() for t in pairs[index]]).tolist()
    return DivergenceError(
        f"at step {bad} the loss is {bad_loss} and the gradient norm {bad_norm}; the step was not applied "
        f"and nothing was saved after step {bad - 1}. {s.advice}"
    )


def train_step(s: StepParts, step: int, log: bool = True, check: bool = False) -> dict:
    """Steps 1-7 of the module docstring; returns the step's record (metrics.jsonl's fields so far). ``log``: the
    loop logs this step, so the step reads its loss and norm (and those of the unlogged steps before it);
    ``check``: the loop agrees on stopping or saves after this step, so the step reads the divergence flag."""
    start = clock_reading(s.device)
    s.observers.step_started(time.perf_counter())
    with named_range("data loading"):
        batch = s.loader.next_batch()
    loss, norm = global_loss_and_norm(s, accumulate_gradients(s, batch, step), step)
    found_inf = flag_non_finite(s, loss, norm, step)
    values: list[float] = []
    if log or check or not s.optimizers.obeys_found_inf:
        bad, values = read_step(s, loss, norm, log)
        if bad:  # every rank read the same flag: all stop here, before this step's update or a save
            raise diverged(s, bad, step, (loss, norm), values)
    lr = s.optimizers.lr
    s.before_update()  # an async save's copy: the step changes the weights and Adam state it copies
    with named_range("optimizer"):
        if s.optimizers.obeys_found_inf:
            s.optimizers.skip_if(found_inf)  # skipped on the device once a step was non-finite (step 5)
        s.optimizers.step()
    # MoE: global expert load of the step (metrics), and the aux-loss-free bias update from it.
    tp_label = ", then tp (its ranks split the tokens)" if s.plan.dims.tp > 1 else ""
    with phase(f"step {step}: MoE expert load", "device plane: the loss mesh (pp x dp x cp)" + tp_label):
        moe_load = (
            step_expert_load(s.parts, s.moe_layer_ids, s.meshes.loss, s.meshes.tp, read=log, skip=found_inf)
            if s.moe_layer_ids
            else {}
        )  # read on log steps only; the bias update obeys the divergence flag on the device
    end = clock_reading(s.device)
    s.observers.step_timed(time.perf_counter())
    s.observers.after_step(step)  # after the step is timed (a check step's throughput stays comparable)
    record = {
        "step": step,
        "loss": None,  # these three on a log step (``fill_records``)
        "grad_norm": None,
        "lr": lr,
        "tokens_per_s": None,
        "window_tokens_per_s": None,
        "peak_mem_bytes": peak_memory_bytes(s.device),
        "tokens_consumed": s.loader.tokens_consumed,
        **load_metrics(moe_load),
    }
    if s.plan.layout.compile:  # a count that grows after the first steps means recompiling
        record["compiled_frames"] = compiled_frames()
    since = (
        start if s.unlogged.last_end is None else s.unlogged.last_end
    )  # the loop's whole iteration, as torchtitan times it
    s.unlogged.last_end = end
    s.unlogged.records.append((record, loss, norm, since, start, end))
    if log:
        fill_records(s, values)
    return record


def fill_records(s: StepParts, values: list[float]) -> None:
    """Step 7 on a log step: the unlogged records and this one get loss, norm and tokens/s, timed end to end between
    steps (as torchtitan); ``window_tokens_per_s`` times train_step alone."""
    for index, (record, _, _, since, start, end) in enumerate(s.unlogged.records):
        tokens_per_s = s.plan.global_tokens / seconds_between(since, end)
        window = s.plan.global_tokens / seconds_between(start, end)
        record.update(loss=values[2 * index], grad_norm=values[2 * index + 1], tokens_per_s=tokens_per_s)
        record["window_tokens_per_s"] = window
        record.update(s.throughput.fields(tokens_per_s))
    s.unlogged.records.clear()
