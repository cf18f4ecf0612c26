"""One rank of a simulated run: meshloom's real build and two real training steps on a fake world under fake tensors.

planning/simulate.py (``train.py --simulate``) calls this once per pipeline rank, each in a fresh process:

1. A fake world of N ranks in which this process plays the first rank of the pipeline stage (every collective
   returns at once), and the DeviceMesh built outside fake mode (FSDP2 with TP or EP concatenates meshes with
   ``nonzero()``, which fake tensors cannot run).
2. Under ``FakeTensorMode`` (shapes and dtypes, no bytes; ``fake=False``: real tensors, for tests at small shapes)
   and the meters of planning/sim_accounting.py: the real build (mesh/parallelize.py), the pipeline schedule with
   static stage metadata, the optimizer, then two training steps (step 1 creates the optimizer states) of
   training/step.py on token batches of the right shape. Expert parallelism routes by ``balanced_split_sizes``.
3. Return the training peak by category, the build's peak, and step 2's collectives per mesh dim.

Not run: the step's host reads (``read_step``; the MoE load statistics, each a small all-reduce) and the pipeline's
start-up vote (every stage is static, so its answer is known).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from planning.plan import LayoutPlan

if TYPE_CHECKING:
    from runtime.schema import Config, ModelConfig


class SimulatedLoader:
    """Token batches of the right shape and no data: what ``train_step`` reads from data/loader.py."""

    def __init__(self, plan: LayoutPlan):
        self.plan = plan
        self.trained_tokens = plan.global_tokens
        self.tokens_consumed = 0
        self.documents = None  # no document masks: the simulation reads no data, so it knows no document starts

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        plan = self.plan
        shape = (plan.micro_batch, plan.seq_len // plan.dims.cp)
        self.tokens_consumed += plan.global_tokens
        return [(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long))] * plan.accumulation


def group_dims(meshes) -> dict[str, str]:
    """Process group name -> the mesh dim (or named view) it serves."""
    names = {}
    world = meshes.world
    for dim in world.mesh_dim_names:
        names.setdefault(world[dim].get_group().group_name, dim)
    for view, mesh in meshes.all().items():
        if mesh.ndim == 1:
            names.setdefault(mesh.get_group().group_name, view)
    from mesh.private_api import flattened_meshes

    for name, mesh in flattened_meshes(world).items():
        names.setdefault(mesh.get_group().group_name, name)
    import torch.distributed as dist

    names.setdefault(dist.group.WORLD.group_name, "world")
    return names


def rank_owners(params: list, optimizers) -> tuple[set, set, set]:
    """The storage keys, now, of the parameters' local shards, their gradients and the optimizer states."""
    from planning.sim_accounting import storage_keys

    states = [v for opt in optimizers.optimizers for s in opt.state.values() for v in s.values()]
    return (
        storage_keys(params),
        storage_keys(p.grad for p in params),
        storage_keys(v for v in states if isinstance(v, torch.Tensor)),
    )


def training_step(step, n: int) -> None:
    """Step ``n`` as the simulation runs it: train_step's forward, backward, loss sum, gradient norm and update
    (training/step.py), without its host reads (module docstring)."""
    from training.step import accumulate_gradients, global_loss_and_norm

    loss = accumulate_gradients(step, step.loader.next_batch(), n)
    global_loss_and_norm(step, loss, n)
    step.optimizers.step()


def simulate_rank(
    cfg: Config,
    world_size: int,
    pp_rank: int,
    fake: bool = True,
    comm_debug: bool = False,
    model_config: ModelConfig | None = None,
    device_type: str | None = None,
) -> dict:
    """Steps 1-3 for one pipeline rank: its measured peak by category and step 2's collectives (``fake=False``: real
    tensors on a fake world; ``comm_debug``: CommDebugMode counts; ``model_config``: a transformers folder's
    [model], checkpoint/hf_folder.py; ``device_type``: the device kind planned for, whose ``mixed_precision = auto``
    the plan resolves, default runtime/command_line.py's ``planned_device``: the tensors are CPU fakes either way)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.debug import CommDebugMode

    from mesh.expert_parallel import balanced_split_sizes, use_split_sizes
    from mesh.private_api import (
        eager_functional_collectives,
        fake_world,
        meshes_outside_fake_mode,
        own_fake_mode_for_sharding_propagation,
        skip_warm_up_vote,
    )
    from planning.sim_accounting import Collectives, LiveBytes
    from runtime.command_line import planned_device
    from training.build import build_meshes, build_step

    device_type = device_type or planned_device(None, cfg.training.device)
    first = LayoutPlan.resolve(cfg, world_size, rank=0, model_config=model_config, device_type=device_type)
    rank = pp_rank * (world_size // first.dims.pp)
    plan = LayoutPlan.resolve(cfg, world_size, rank=rank, model_config=model_config, device_type=device_type)
    device = torch.device("cpu")
    started = time.perf_counter()
    with fake_world(world_size, rank), contextlib.ExitStack() as stack:
        meshes = build_meshes(plan, device, cfg.parallel.collective_timeout_s)
        fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True)) if fake else None
        stack.enter_context(own_fake_mode_for_sharding_propagation())
        stack.enter_context(meshes_outside_fake_mode())
        stack.enter_context(eager_functional_collectives())
        stack.enter_context(use_split_sizes(balanced_split_sizes))
        memory = stack.enter_context(LiveBytes(fake_mode, cpu_casts=device_type == "cpu"))
        stack.enter_context(memory.following_resizes())
        comms = stack.enter_context(Collectives(group_dims(meshes)))
        comms.counting = False
        torch.manual_seed(cfg.training.seed)
        step = build_step(cfg, plan, meshes, device, SimulatedLoader(plan))
        if step.schedule is not None:
            skip_warm_up_vote(step.schedule)
        # logits: what the head returns, and the loss's copies of it (planning/sim_accounting.py)
        for part in step.parts:
            if getattr(part, "output", None) is not None:
                memory.watch_head(part.output)
        optimizers = step.optimizers
        memory.owners = lambda: rank_owners(step.params, optimizers)
        build_peak = memory.reset_peak()  # the build's peak (one full parameter at a time), reported beside
        torch_counts = {}
        for n in (1, 2):  # step 1 creates the optimizer states; step 2 is the steady state
            comms.counting = n == 2
            # torch's own collective counter beside ours on step 2, for tests (it does not count send/recv)
            with CommDebugMode() if comm_debug and n == 2 else contextlib.nullcontext() as counter:
                training_step(step, n)
            if counter is not None:
                torch_counts = {str(op): c for op, c in counter.get_comm_counts().items()}
        comms.counting = False
        categories = memory.finish()
        peak = memory.peak
    return {
        "pp_rank": pp_rank,
        "rank": rank,
        "stages": list(plan.stage_ids),
        "simulated_peak_bytes": peak,
        "build_peak_bytes": build_peak,
        "categories": categories,
        "collectives": comms.table(),
        **({"torch_comm_counts": torch_counts} if comm_debug else {}),
        "seconds": round(time.perf_counter() - started, 1),
    }


def real_rank(cfg: Config) -> dict:
    """What ``simulate_rank`` measures, on a real rank of a real process group (tests check the simulation against it):
    the same build and two steps with real tensors and real routing, step 2's collectives per mesh dim as the process
    group itself recorded them (its flight recorder, mesh/private_api.py), not as the simulation's meters see them;
    send and recv, which gloo does not record, from the meter (a backend that records them, NCCL, is read instead).

    With ``profile.memory_snapshot`` also ``peak_bytes``: the peak of live tensor bytes over the two steps, by the
    CPU allocator's own record of every allocation and free under torch.profiler (``profile_memory``), not the
    simulation's meter; recorded from the build on, as the simulation meters it, so the tensors the build leaves
    (the parameters) are counted, and its peak taken from step 1 on."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from mesh.private_api import cpu_allocator_counts_every_thread, flight_recorder_dump, profiled_cpu_allocations
    from planning.sim_accounting import Collectives, recorded_collectives
    from training.build import build_meshes, build_step

    world_size, rank = dist.get_world_size(), dist.get_rank()
    plan = LayoutPlan.resolve(cfg, world_size, rank=rank, device_type="cpu")
    device = torch.device("cpu")
    meshes = build_meshes(plan, device, cfg.parallel.collective_timeout_s)
    # only allocations: record_shapes (the memory timeline's categories) holds references that fail the build
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    profiler = profiler if cfg.profile.memory_snapshot else contextlib.nullcontext()
    # gloo's worker threads free some collectives' buffers (the last reference to a finished Work), threads the
    # profiler does not follow: without this the allocator's total never subtracts them (mesh/private_api.py)
    every_thread = cpu_allocator_counts_every_thread() if cfg.profile.memory_snapshot else contextlib.nullcontext()
    with every_thread as counts_every_thread, profiler:
        torch.manual_seed(cfg.training.seed)
        step = build_step(cfg, plan, meshes, device, SimulatedLoader(plan))
        names = group_dims(meshes)
        point_to_point = Collectives(names)  # gloo's flight recorder leaves send and recv out: counted by the meter
        steps_from = time.time_ns()  # the profiler's clock: nanoseconds since the epoch
        training_step(step, 1)
        last = max((e["record_id"] for e in flight_recorder_dump()["entries"]), default=-1)
        with point_to_point:
            training_step(step, 2)
    memory = {}
    if cfg.profile.memory_snapshot:
        allocations = profiled_cpu_allocations(profiler)
        _, first, total = allocations[0]
        before = total - first  # the allocator's blocks of an earlier profile in this process, still alive
        memory = {
            "peak_bytes": max(total for t, _, total in allocations if t >= steps_from) - before,
            "counts_every_thread": counts_every_thread,
        }
    entries = [e for e in flight_recorder_dump()["entries"] if e["record_id"] > last]
    collectives = recorded_collectives(entries, names)
    for row in point_to_point.table():
        if row["kind"] in ("send", "recv") and not any(e["is_p2p"] for e in entries):
            into = collectives.setdefault(row["dim"], {"count": 0, "bytes": 0})
            into["count"] += row["count"]
            into["bytes"] += row["bytes"]
    return {"rank": rank, "stages": list(plan.stage_ids), "collectives": collectives, **memory}
