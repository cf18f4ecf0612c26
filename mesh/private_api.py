"""The one place meshloom touches private torch APIs, and the one place where torch releases differ.

meshloom supports torch 2.11 to 2.15 (pyproject.toml). Where two releases spell something differently, the
wrapper here asks the installed torch whether it *has* the newer name (``hasattr``/``getattr``) and falls back
to the older one, with a comment naming the releases; no code reads a version string. The differences:

| what                                   | releases                                                              |
|----------------------------------------|-----------------------------------------------------------------------|
| c10d ``all_gather_single`` /           | 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor``   |
| ``reduce_scatter_single``              | and warns on the old names; 2.11 has only the old ones               |
| functional ``all_gather_single`` /     | the same rename in ``_functional_collectives`` (``all_gather_tensor``  |
| ``reduce_scatter_single``              | / ``reduce_scatter_tensor`` in 2.11)                                  |
| ``DeviceMesh._unflatten(dim)``         | 2.11 refuses a dim given by its name (an inverted check): by index    |
| an FSDP unit's parameter groups        | ``_fsdp_param_groups`` (a list) in 2.13, ``_fsdp_param_group`` in 2.11 |
| the end of a pipeline stage's shape    | 2.13: ``_post_metadata_inference_cleanup`` after a real forward and   |
| inference                              | backward; 2.11: ``_shape_inference``, one no-grad forward on zeros    |
| a pipeline's first-step warm-up        | 2.11 sends to a neighbour stage on the same rank (V schedules), which |
|                                        | gloo cannot: those messages are left out (2.13 warms up another way)  |
| ``DefaultStager`` reuse                | 2.11 closes the stager's copier after each stage: one stager per save |
|                                        | (checkpoint/manager.py builds a fresh one each time, on every release)|

The private APIs it wraps, and why no public one serves:

| what                                   | why no public API serves                                              |
|----------------------------------------|-----------------------------------------------------------------------|
| ``DeviceMesh._flatten``                | a 1-D view over several mesh dims (the dp ranks, the loss ranks)      |
| ``DeviceMesh._unflatten``              | regroup the world as (pp, dp_replicate, efsdp, ep) in the *same* root |
| ``DeviceMesh._concatenate``            | (dp_replicate, dp_shard x cp) as one 2-D mesh for HSDP with cp, from  |
|                                        | existing groups (slicing a flattened dim from the root is deprecated) |
| ``DeviceMesh._get_root_mesh``          | check that every mesh of a run shares one root (tests)                |
| ``DeviceMesh._flatten_mapping``        | name the flattened meshes' groups in the simulation's collective table |
| ``Backend.Options._timeout``           | DeviceMesh passes a sub-group's timeout only through its options      |
| ``_functional_collectives``            | differentiable uneven all-to-all, and functional all-to-all,          |
|                                        | all-gather and reduce-scatter that selective activation checkpointing |
|                                        | can cache (c10d's in-place ops cannot be)                             |
| ``PipelineStage._post_metadata_inference_cleanup`` | the only hook at the end of the stage's shape inference   |
| (2.13+), ``PipelineStage._shape_inference`` (2.11) |                                                           |
| ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` | activation checkpointing that keeps the module  |
|                                        | tree (FSDP units and state-dict names see through it)                 |
| ``torch.utils.checkpoint``'s two       | selective checkpointing that passes over profiler annotations (FSDP's |
| selective-checkpoint modes, its        | ``record_function`` ranges, which a nested FSDP unit opens more often |
| ``_sac_storage_key`` and ``_CONSUMED`` | in recomputation than in forward) and serves a kept output to both    |
|                                        | recomputations of a split (zero-bubble) backward                      |
|                                        | (``selective_checkpoint_contexts``)                                   |
| ``torch.distributed._composable.replicate`` | DDP's reducer and communication hooks (PowerSGD) on the model    |
|                                        | itself: no wrapper module, so names and attributes stay the model's   |
| ``FSDPParam.offload_to_cpu``           | whether a unit really offloads (tests and the offload bench: on a CPU |
|                                        | device an offloaded shard looks like any other)                       |
| ``torch.cuda.memory._record_memory_history``, ``_dump_snapshot`` | the CUDA allocator's history, the file that     |
|                                        | pytorch.org/memory_viz opens (``profile.memory_snapshot``)            |
| ``torch.profiler._memory_profiler._CATEGORY_TO_INDEX`` | the column order of the CPU memory timeline's JSON export  |
| ``profile.profiler.kineto_results.experimental_event_tree`` | each CPU allocation and free a memory profile    |
|                                        | recorded, in order and with its time: the public memory timeline needs |
|                                        | ``record_shapes``, whose references make the build's ``to_empty`` fail |
|                                        | (``profiled_cpu_allocations``)                                        |
| c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (a global in         | the CPU allocator's running total     |
| libc10, set through ctypes)            | counts a free on a thread the profiler does not follow (gloo's        |
|                                        | workers): without it that free is lost and the total only grows       |
|                                        | (``cpu_allocator_counts_every_thread``)                               |
| ``torch._C._autograd._top_saved_tensors_default_hooks`` | the saved-tensor hooks active now, so that SP's re-gather |
|                                        | hooks hand every other tensor on to them (mesh/tensor_parallel.py)    |
| ``aten._scaled_dot_product_flash_attention_for_cpu`` (CPU),          | one fused attention kernel call that  |
| ``aten._scaled_dot_product_flash_attention`` and                     | also returns each query row's         |
| ``aten._scaled_dot_product_efficient_attention`` (CUDA), and their   | log-sum-exp, and its backward given   |
| ``_backward`` ops                                                    | a merged output and log-sum-exp: ring |
|                                        | attention's blocks (mesh/context_parallel.py); SDPA returns neither   |
| ``tensor._utils.compute_local_shape_and_global_offset`` | the block of the full tensor that this rank's   |
|                                        | piece is (shape and offset), so an import reads only that block; DCP  |
|                                        | uses it for the same purpose                                          |
| ``torch._functorch.config``'s          | a compiled block whose backward runs twice (a zero-bubble schedule's  |
| ``donated_buffer``                     | input-gradient pass keeps the graph for its weight-gradient pass) must |
|                                        | not let the first run write into the saved activations; no public     |
|                                        | switch (``keep_compiled_backward_inputs``)                            |
| ``torch._functorch.config``'s          | AOTAutograd's on-disk cache keys a compiled block by its graph before |
| ``enable_autograd_cache``              | DTensor is desugared, without the process-group names desugaring      |
|                                        | writes into it: off (``key_compiled_graphs_by_group``)                |
| ``DTensor._local_tensor``              | a DTensor's local shard without an autograd op, inside SP's re-gather |
|                                        | pack hook (``dtensor_local_storage``)                                 |
| ``torch._C._distributed_c10d._dump_fr_trace``, ``distributed_c10d._world.pg_names`` | the flight recorder's |
|                                        | buffer on gloo (NCCL dumps it itself on a timeout), and every group's |
|                                        | name and ranks, which gloo leaves out of the dump                     |
| ``torch._dynamo.maybe_mark_dynamic``   | the experts' token count left symbolic in their compiled graph: no    |
|                                        | recompile when it changes (``mark_rows_dynamic``)                     |
| ``torch._dynamo.utils.counters``       | how many frames dynamo has compiled in this process: recompiles after |
|                                        | the first step (``compiled_frames``); torch.compiler has no counter   |

One exception lives outside this file: ``torch._grouped_mm`` (all experts of an MoE layer in one grouped
matmul) is wrapped in models/kernels.py, because models/ is single-device code that never imports mesh/.

Prefer public APIs everywhere else. When torch renames or removes one of these, ``tests/test_private_api.py``
fails here, loudly, instead of a training run failing somewhere deep inside a collective. (The docs tooling
has its own such place, measure/schedule_ir.py, for the pipeline schedules' action lists that the pictures draw;
selective activation checkpointing names ops of torch's ``_c10d_functional`` namespace, which are op
identifiers, not Python APIs.)
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


# ---- DeviceMesh ------------------------------------------------------------------------------------------
def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str, options) -> DeviceMesh:
    """A 1-D view over ``dims`` of ``mesh``, registered on the root under ``name``; ``options`` from
    mesh_backend_options."""
    return mesh[dims]._flatten(name, backend_override=options)


def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...], options) -> DeviceMesh:
    """``mesh`` with dim ``dim`` split into ``names`` of ``sizes`` (row-major, so rank order is kept)."""
    # The dim goes by its index: torch 2.11's _unflatten refuses every dim *name* that the mesh has (its check
    # is inverted); an index works in every release.
    index = mesh.mesh_dim_names.index(dim)
    return mesh._unflatten(index, sizes, names, backend_override=dict.fromkeys(names, options))


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (views of one root, disjoint dims), reusing their groups."""
    return DeviceMesh._concatenate(meshes)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced, flattened or unflattened from (itself for a root)."""
    return mesh._get_root_mesh()


def flattened_meshes(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    """The 1-D meshes flattened from ``mesh``'s root, by name (DTensor reduces over them: the gradient norm over
    ``dp_shard_cp_tp``). The root keeps them in ``_flatten_mapping`` on torch 2.11 to 2.13; {} where it does not."""
    return dict(getattr(root_mesh(mesh), "_flatten_mapping", {}))


def backend_options(backend: str, timeout_s: float):
    """Process-group options with our timeout: DeviceMesh reads a sub-group's timeout only from ``options._timeout``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if "nccl" in backend:  # "nccl", or "cuda:nccl,cpu:gloo" (whose gloo half takes the timeout DeviceMesh
        # reads from these options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return backend, options
    return backend, torch._C._distributed_c10d.Backend.Options(backend, timeout)


# ---- c10d collectives renamed in torch 2.13 ----------------------------------------------------------------
# torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to ``all_gather_single`` and
# ``reduce_scatter_single`` and prints a FutureWarning on the old names; 2.11 has only the old names.
def all_gather_into(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Every rank's ``input`` concatenated along dim 0 into ``output`` (c10d, in place)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


# The reduce-scatter FSDP2 calls, under the name this torch has (measure/grad_traffic.py wraps it to count it).
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def _functional(new: str, old: str):
    """The functional collective ``new`` (torch 2.13+), or ``old``, its name in 2.11 (2.13 warns on ``old``)."""
    from torch.distributed import _functional_collectives as funcol

    return getattr(funcol, new, None) or getattr(funcol, old)


# ---- functional collectives ----------------------------------------------------------------------------
def all_to_all_autograd(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all (the public ``all_to_all_single`` autograd one is deprecated)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, output_splits, input_splits, group))


def all_to_all_functional(x: torch.Tensor, group) -> torch.Tensor:
    """Even all-to-all that returns a new tensor (no in-place output), so that selective activation
    checkpointing can save its result and never repeat it when the block is recomputed."""
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    return wait_tensor(all_to_all_single(x, None, None, group))


def all_gather_functional(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 into a new tensor (rank order); selective checkpointing can cache its result."""
    from torch.distributed._functional_collectives import wait_tensor

    return wait_tensor(_functional("all_gather_single", "all_gather_tensor")(x, 0, group))


def reduce_scatter_functional(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks, then rank r keeps chunk r of dim 0: the reverse of ``all_gather_functional``."""
    from torch.distributed._functional_collectives import wait_tensor

    return wait_tensor(_functional("reduce_scatter_single", "reduce_scatter_tensor")(x, "sum", 0, group))


def all_reduce_functional(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` into a new tensor (functional: selective activation checkpointing caches it)."""
    from torch.distributed._functional_collectives import all_reduce, wait_tensor

    return wait_tensor(all_reduce(x, "sum", group))


def all_gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new leading dim, in rank order (functional, like the above)."""
    size = dist.get_world_size(group)
    return all_gather_functional(x.contiguous(), group).view(size, *x.shape)


# ---- pipelining ----------------------------------------------------------------------------------------
def after_shape_inference(stage, callback) -> None:
    """Call ``callback()`` right after ``stage`` finished torch's shape inference, which routes tokens: torch 2.13+ runs
    a real forward and backward, torch 2.11 a no-grad forward on zeros."""
    name = "_post_metadata_inference_cleanup"
    if not hasattr(stage, name):  # torch 2.11
        name = "_shape_inference"
    inference = getattr(stage, name)

    def inference_then_callback(*args, **kwargs):
        result = inference(*args, **kwargs)
        callback()
        return result

    setattr(stage, name, inference_then_callback)


def no_warm_up_messages_to_self(stage) -> None:
    """Leave a stage's links to a same-rank neighbour out of torch 2.11's warm-up: gloo cannot send to itself ("Pair is
    not connected"). torch 2.13+ never calls this."""
    warm_up = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warm_up is None:
        return
    me = dist.get_rank()
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in warm_up() if op.peer != me]


def step_without_outputs(schedule):
    """``schedule.step`` keeping no last-stage outputs (``return_outputs=False`` where the release has the keyword)."""
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        return functools.partial(schedule.step, return_outputs=False)
    return schedule.step


def skip_warm_up_vote(schedule) -> None:
    """Simulation only: set torch 2.13's warm-up vote to "every stage static" without voting (a fake world cannot read
    it). A release without the vote (2.11) keeps its own warm-up."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def static(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static


@contextlib.contextmanager
def own_fake_mode_for_sharding_propagation():
    """Give each DTensor sharding propagation its own fake mode, so a memory meter on the ambient one does not count its
    global-shape temporaries."""
    from torch.distributed.tensor import _sharding_prop

    if not hasattr(_sharding_prop, "detect_fake_mode"):  # a release that never reuses it
        yield
        return
    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


# ---- fake worlds (the simulation, measure/schedule_ir.py) ---------------------------------------------------
@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A process group of ``world_size`` in which this process plays ``rank`` and nothing is ever sent (torch's
    testing backend ``fake``, registered by importing ``FakeStore``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group (run it outside torchrun)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh_ranks(mesh: DeviceMesh) -> set[int]:
    """Every global rank of ``mesh``, read on real tensors outside every dispatch mode (under --simulate's fake
    mode, ``tolist`` on the mesh tensor would need a data-dependent shape)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return set(mesh.mesh.flatten().tolist())


@contextlib.contextmanager
def meshes_outside_fake_mode():
    """Make DeviceMeshes (FSDP2's ``_concatenate`` under TP/EP) on real tensors, outside every fake mode: they call
    ``nonzero()``."""
    from torch.utils._python_dispatch import _disable_current_modes

    concatenate = DeviceMesh._concatenate

    def outside(device_mesh_list):
        with _disable_current_modes():
            return concatenate(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(outside)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)


@contextlib.contextmanager
def eager_functional_collectives():
    """Run functional collectives eagerly under a fake mode (else they wait at once), so selective checkpointing saves
    what a real rank saves."""
    from torch.distributed import _functional_collectives as funcol

    tracing = getattr(funcol, "_are_we_tracing", None)
    if tracing is None:  # a release without the check: nothing to change
        yield
        return
    funcol._are_we_tracing = lambda: False
    try:
        yield
    finally:
        funcol._are_we_tracing = tracing


# ---- torch.compile ---------------------------------------------------------------------------------------
def keep_compiled_backward_inputs() -> None:
    """Make compiled backwards leave their saved activations intact, so that one can run twice.

    AOTAutograd compiles a block's backward as one graph that returns the input and the weight gradients together,
    at its first call. If that call frees the graph (a full backward), it lets inductor write into the saved
    activations that nothing else holds ("donated buffers"), and refuses every later call that keeps the graph
    ("compiled with non-empty donated buffers which requires ... retain_graph=False"), since a second run would read
    overwritten values. A zero-bubble schedule runs the backward twice, its input-gradient pass with
    ``retain_graph=True`` and its weight-gradient pass again; DualPipeV also runs full backwards, and which comes
    first decides. Process-wide, like the flag; ``hasattr``: a release without donated buffers needs nothing.
    """
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False


def key_compiled_graphs_by_group() -> None:
    """Turn AOTAutograd's cache off, so a compiled graph is never served to a run whose process groups are named
    differently.

    AOTAutograd's cache (on disk, shared by every process of the machine's user) keys a graph by dynamo's graph,
    where a DTensor's mesh appears by its shape and ranks; desugaring the DTensors then writes each collective's
    process-group name into the compiled code (``all_gather_into_tensor(x, 2, '27')``). Group names are numbers
    given in creation order, so two layouts with the same tp mesh name it differently: a graph cached by one run
    (HSDP x TP, 8 ranks) failed in the next (pp 2 x cp 2 x tp 2) with "Could not resolve the process group
    registered under the name 27", every run after, until the cache was cleared. Inductor's own FX graph cache
    stays on: its key is the desugared graph, names included. Process-wide; ``hasattr``: 2.11-2.15 have the flag.
    """
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = False


def splits_compiled_backward() -> bool:
    """Whether torch's pipelining computes a zero-bubble weight-gradient pass through a compiled block's backward.

    The weight pass (``pipelining._backward.stage_backward_weight``) starts from the autograd nodes where the input
    pass stopped. torch 2.11 reads only output 0 of each such node (``GradientEdge(node, 0)``, its gradients
    summed), which a compiled block's backward node, with several outputs, refuses ("Attribute '_input_metadata' is
    invalid"); 2.13 reads every output (``GradientEdge(node, i)``), in the release whose input pass also gained
    ``_autograd_grad_for_inputs``, the attribute tested here (2.13-2.15 have it; 2.11 does not).
    """
    from torch.distributed.pipelining import _backward

    return hasattr(_backward, "_autograd_grad_for_inputs")


def mark_rows_dynamic(x: torch.Tensor) -> None:
    """Let a compiled graph that ``x`` enters take any size of dim 0 (no recompile when it changes). The "maybe" form
    (2.11-2.15) never raises where dynamo must specialise, e.g. on 0 or 1 rows; it only allows."""
    torch._dynamo.maybe_mark_dynamic(x, 0)


def compiled_frames() -> int:
    """How many times dynamo has compiled a Python frame in this process so far: each frame's first compilation and
    every recompilation (a guard that failed: a new shape, a changed attribute). Read before and after a step, the
    difference is that step's compilation; a steady step adds none."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


# ---- activation checkpointing ----------------------------------------------------------------------------
def checkpoint_wrapper(module, **kwargs):
    """torch's non-reentrant activation-checkpoint wrapper (its module path is private in 2.13)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


# Profiler annotations: ``record_function`` ranges are ops to the dispatcher but compute nothing.
_ANNOTATIONS = {
    torch.ops.profiler._record_function_enter.default,
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def selective_checkpoint_contexts(policy_fn):
    """torch's selective-checkpoint (forward, recompute) contexts for ``policy_fn``, with two changes.

    1. Profiler annotations run without being counted. torch replays a recomputation by each op's call index
       (the 3rd ``mm`` of the recomputation is the 3rd of the forward). FSDP's hooks open ``record_function``
       ranges, and a unit nested inside a checkpointed block (the MoE experts' unit under ep or the token split)
       opens a different number of them in recomputation (its pre-forward in backward, its prefetch) than in
       forward: replay then fails ("_record_function_enter_new ... not found in storage"). They compute nothing.
       (Newer torch releases leave them out themselves: upstream "Exclude all-gather internals from selective
       checkpointing".) FSDP's all-gather ops inside the region are counted; they are never saved, and a
       recomputation issues at most as many as the forward did (the unit stays gathered from its recomputation
       to its backward), so their replay indexes always exist.
    2. A kept output is served to every recomputation, not only the first. torch marks it consumed once served
       ("Trying to backward an extra time"), but a split backward recomputes twice: a zero-bubble schedule's
       input-gradient pass, then its weight-gradient pass (``retain_graph``). The outputs are freed with the
       block's graph, after its last backward pass, instead of when the first recomputation took them."""
    from torch.utils import checkpoint as ckpt

    forward, recompute = ckpt.create_selective_checkpoint_contexts(policy_fn)
    forward.__class__ = _passing_over_annotations(type(forward), replay=False)
    recompute.__class__ = _passing_over_annotations(type(recompute), replay=True)
    return forward, recompute


@functools.cache
def _passing_over_annotations(mode_class, replay: bool):
    """``mode_class`` (one of torch's two selective-checkpoint modes) with annotations run straight through; with
    ``replay`` (the recompute mode) a kept output stays kept after it is served."""
    from torch.utils import checkpoint as ckpt

    # how torch files an op's outputs: by op and, for compiled regions, by region (2.13); by op alone before
    storage_key = getattr(ckpt, "_sac_storage_key", lambda func, args: func)
    consumed = getattr(ckpt, "_CONSUMED", None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ANNOTATIONS:
            return func(*args, **(kwargs or {}))
        # torch 2.11 keeps an op's outputs as a list the recomputation pops in order (no call index, nothing to
        # keep for a second recomputation); 2.13 and later replay by call index (``func_counter``)
        if not replay or not hasattr(self, "func_counter"):
            return mode_class.__torch_dispatch__(self, func, types, args, kwargs)
        key = storage_key(func, args)
        index, entries = self.func_counter[key], self.storage.get(key)
        kept = entries.get(index) if entries else None
        out = mode_class.__torch_dispatch__(self, func, types, args, kwargs)
        if kept is not None and consumed is not None and entries.get(index) is consumed:
            entries[index] = kept
        return out

    return type(mode_class.__name__, (mode_class,), {"__torch_dispatch__": __torch_dispatch__})


# ---- DDP without a wrapper module ------------------------------------------------------------------------
def replicate_with_ddp(model, group, device: torch.device, **ddp_kwargs):
    """DDP over ``group`` applied to ``model`` in place (composable ``replicate``): names and class stay, unlike
    ``DistributedDataParallel``'s ``.module``."""
    from torch.distributed._composable import replicate

    return replicate(model, process_group=group, device_id=device, **ddp_kwargs)


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13+: a list of groups per unit
    if groups is None:  # torch 2.11: one group (or None) per unit
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def fsdp_units(model) -> int:
    """The FSDP units of ``model`` that hold parameters: one per ``fully_shard`` call (modules sharded together
    as a list share one state; a root left with buffers only has no parameter group)."""
    from torch.distributed.fsdp import FSDPModule

    states = {id(s): s for m in model.modules() if isinstance(m, FSDPModule) for s in [m._get_fsdp_state()]}
    return sum(1 for state in states.values() if any(g.fsdp_params for g in _param_groups(state)))


def offloads_to_host(module) -> bool:
    """True when every parameter of FSDP unit ``module`` is managed with FSDP2's CPU offload."""
    params = [p for group in _param_groups(module._get_fsdp_state()) for p in group.fsdp_params]
    return bool(params) and all(p.offload_to_cpu for p in params)


def group_timeout(group, device_type: str = "cpu") -> datetime.timedelta:
    """The timeout a process group was created with (for tests: every group must carry ours)."""
    return group._get_backend(torch.device(device_type)).options._timeout


# ---- memory snapshots ------------------------------------------------------------------------------------
def record_memory_history(enabled: bool, max_entries: int = 200_000) -> None:
    """Start (or stop) recording every CUDA allocation and free, with its Python stack, for a snapshot."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator's state and recorded history as a pickle that pytorch.org/memory_viz opens."""
    torch.cuda.memory._dump_snapshot(path)


def memory_timeline_categories() -> list[str | None]:
    """Column names of ``profile.export_memory_timeline``'s JSON rows (a private dict's order; first None)."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names: list[str | None] = [None] * (len(_CATEGORY_TO_INDEX) + 1)
    for category, index in _CATEGORY_TO_INDEX.items():
        names[index + 1] = "unknown" if category is None else category.name.lower().replace("_", " ")
    return names


def profiled_cpu_allocations(prof) -> list[tuple[int, int, int]]:
    """(time in nanoseconds since the epoch, bytes: positive allocated, negative freed, the allocator's total after
    it) of every CPU allocation and free that ``prof`` (a finished ``torch.profiler.profile(profile_memory=True)``)
    recorded, in time order. The CPU allocator reports each one (c10's ``ProfiledCPUMemoryReporter``) with its
    running total of the blocks it has seen allocated since profiling began and not yet freed (a free of an older
    block is not reported, nor one on a thread the profile does not follow: open ``cpu_allocator_counts_every_thread``
    so that the total still counts it). Read the total, not a sum of the sizes in time order: a free on another
    profiled thread is stamped after the total is updated, so a reallocation of its block can come first in time."""
    from torch._C._profiler import _EventType

    out, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            fields = node.typed[1]
            out.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(out)


@contextlib.contextmanager
def cpu_allocator_counts_every_thread():
    """While open, the CPU allocator's running total (``profiled_cpu_allocations``' third field) counts every
    thread's allocations and frees, not only those of threads a memory profile follows; yields whether it could.

    c10's ``ProfiledCPUMemoryReporter`` updates its total only where ``memoryProfilingEnabled()``, a thread-local
    answer, or the ``caffe2_report_cpu_memory_usage`` flag holds. A block allocated on a profiled thread and freed
    on another (gloo's worker threads drop a finished Work, and with it a collective's buffer, when the main thread
    has already let go of it) is then never subtracted: the total stays higher by that block for the rest of the
    profile. The flag has no Python setter; it is an exported global of libc10, found by name (absent: False)."""
    import ctypes
    import os

    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:
        names = ("libc10.so", "libc10.dylib", "c10.dll")
        library = next(os.path.join(folder, n) for n in names if os.path.exists(os.path.join(folder, n)))
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(library), "FLAGS_caffe2_report_cpu_memory_usage")
    except (StopIteration, OSError, ValueError):
        yield False
        return
    was = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = was


# ---- autograd --------------------------------------------------------------------------------------------
def outer_saved_tensors_hooks():
    """The (pack, unpack) of the innermost active ``saved_tensors_hooks``, or None (they do not nest)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def dtensor_local_storage(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor without an autograd op, safe inside a ``saved_tensors_hooks`` pack function."""
    return t._local_tensor


# ---- fused attention kernels that also return the log-sum-exp (mesh/lse_attention.py picks and calls) -----
def sdpa_flash_cpu(q, k, v, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def sdpa_flash_cpu_backward(grad_out, q, k, v, out, lse, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal)


def sdpa_flash(q, k, v, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)


def sdpa_flash_backward(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, causal: bool, rng_state, unused):
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused
    )


def sdpa_efficient(q, k, v, causal: bool):
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)


def sdpa_efficient_backward(grad_out, q, k, v, out, lse, seed, offset, causal: bool):
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal
    )


# ---- flight recorder -------------------------------------------------------------------------------------
def flight_recorder_dump() -> dict:
    """This process's flight-recorder buffer in the format of torch's analyser (``fr_trace``), with Python stacks. torch
    2.13 registers only NCCL groups' names and ranks (``pg_config``); gloo's are filled in here."""
    import pickle

    dump = pickle.loads(
        torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    )
    known = {
        name for name, config in dump.get("pg_config", {}).items() if name and config.get("ranks") not in ("[]", "")
    }
    groups = {
        name: {"name": name, "desc": group.group_desc, "ranks": str(dist.get_process_group_ranks(group))}
        for group, name in dist.distributed_c10d._world.pg_names.items()
        if name not in known
    }
    dump["pg_config"] = {**{k: v for k, v in dump.get("pg_config", {}).items() if k in known}, **groups}
    return dump


# ---- DTensor: which block of the full tensor this rank holds ----------------------------------------------
def contiguous_block(param) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, offset) of this rank's piece of DTensor ``param``, or None when it is not one block
    (``_StridedShard``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(type(p) not in (Shard, Replicate) for p in param.placements):
        return None
    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


def static_stage_arguments(examples: dict) -> dict:
    """The static-metadata arguments this torch's ``PipelineStage`` takes (``input_grads``/``output_grads``: 2.13, not
    2.11)."""
    from torch.distributed.pipelining import PipelineStage

    accepted = inspect.signature(PipelineStage.__init__).parameters
    return {name: value for name, value in examples.items() if name in accepted}
