"""Every private torch API meshloom uses (mesh/private_api.py) still exists and behaves as relied upon.

If torch renames or changes one of them, this file fails first, naming the API, instead of a training run
failing deep inside a collective. Each check exercises the behaviour meshloom depends on, not just the name.
"""

import contextlib
import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from launch.spawn import run_on_ranks

# Run on the oldest and the newest supported torch too (.ci/compat).
pytestmark = pytest.mark.compat


def private_apis_on_two_ranks() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mesh import private_api as api

    options = api.backend_options("gloo", 41)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"), backend_override={"a": options, "b": options})
    flat = api.flatten_mesh(mesh, ("a", "b"), "ab", options)
    split = api.unflatten_mesh(mesh, "a", (1, 2), ("a1", "a2"), options)
    rank = dist.get_rank()
    x = torch.tensor([float(rank), 10.0 + rank], requires_grad=True)
    moved = api.all_to_all_autograd(x, [1, 1], [1, 1], mesh["a"].get_group())
    (moved * torch.tensor([1.0, 2.0])).sum().backward()
    counts = api.all_to_all_functional(torch.tensor([rank, 10 + rank]), mesh["a"].get_group())
    gathered = api.all_gather_functional(torch.tensor([[rank, 10 + rank]]), mesh["a"].get_group())
    scattered = api.reduce_scatter_functional(torch.tensor([[1, rank], [2, 10 * rank]]), mesh["a"].get_group())
    joined = api.concatenate_meshes([split["a1"], split["a2"]])
    from torch.distributed.tensor import DTensor, Shard

    sharded = DTensor.from_local(torch.arange(2.0) + rank, mesh["a"], (Shard(0),))
    local = api.dtensor_local_storage(sharded)
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    uneven = distribute_tensor(torch.zeros(5, 3), mesh["a"], (Shard(0),))  # rows 0-2 and 3-4
    columns = distribute_tensor(torch.zeros(4, 6), mesh["a"], (Shard(1),))
    strided = distribute_tensor(torch.zeros(8, 2), mesh["a"], (_StridedShard(0, split_factor=2),))
    return {
        "blocks": [api.contiguous_block(t) for t in (uneven, columns, strided)],
        "local_read": (
            type(local) is torch.Tensor,
            local.tolist(),
            local.untyped_storage().data_ptr() == sharded.to_local().untyped_storage().data_ptr(),
        ),
        "flat_size": flat.size(),
        "split_names": split.mesh_dim_names,
        "roots": [api.root_mesh(m) is mesh for m in (flat, split, split["a2"], mesh["a"])],
        "timeout": api.group_timeout(split["a2"].get_group()),
        "moved": moved.detach().tolist(),
        "grad": x.grad.tolist(),
        "counts": counts.tolist(),
        "gathered": gathered.tolist(),
        "scattered": scattered.tolist(),
        "joined": (joined.mesh_dim_names, tuple(joined.shape), api.root_mesh(joined) is mesh),
        "joined_group": dist.get_process_group_ranks(joined.get_group("a2")),
    }


def test_mesh_and_functional_collective_apis():
    r0, r1 = run_on_ranks(private_apis_on_two_ranks, 2)
    assert r0["flat_size"] == 2 and r0["split_names"] == ("a1", "a2", "b")
    assert all(r0["roots"]) and all(r1["roots"])
    assert r0["timeout"] == datetime.timedelta(seconds=41)
    # all-to-all: element j of rank i goes to rank j; its gradient comes back the reverse way
    assert r0["moved"] == [0.0, 1.0] and r1["moved"] == [10.0, 11.0]
    assert r0["grad"] == [1.0, 1.0] and r1["grad"] == [2.0, 2.0]
    assert r0["counts"] == [0, 1] and r1["counts"] == [10, 11]
    # functional all-gather along dim 0 in rank order, and reduce-scatter: sum, then rank r keeps row r
    assert r0["gathered"] == r1["gathered"] == [[0, 10], [1, 11]]
    assert r0["scattered"] == [[2, 1]] and r1["scattered"] == [[4, 10]]
    # two views of one root joined into one mesh that reuses their groups (context parallel HSDP's fsdp mesh)
    assert r0["joined"] == (("a1", "a2"), (1, 2), True) and r0["joined_group"] == [0, 1]
    # a DTensor's local shard, read without an autograd op: a plain tensor on the same storage
    assert r0["local_read"] == (True, [0.0, 1.0], True) and r1["local_read"] == (True, [1.0, 2.0], True)
    # which block of the full tensor each rank holds (checkpoint/hf.py reads only that block); none for a
    # strided shard, whose rows are not one block
    assert r0["blocks"] == [((3, 3), (0, 0)), ((4, 3), (0, 0)), None]
    assert r1["blocks"] == [((2, 3), (3, 0)), ((4, 3), (0, 3)), None]


def shape_inference_hook_on_one_rank(microbatches: int) -> dict:
    from torch.distributed.pipelining import ScheduleGPipe

    from mesh.private_api import after_shape_inference

    class CountingLinear(torch.nn.Linear):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return super().forward(x)

    module = CountingLinear(4, 4)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    seen = []

    def forget():  # what mesh/pipeline.py does with the MoE counters
        seen.append(module.calls)
        module.calls = 0

    after_shape_inference(stage, forget)
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=lambda y, t: ((y - t) ** 2).sum())
    schedule.step(torch.randn(2 * microbatches, 4), target=torch.zeros(2 * microbatches, 4), losses=[])
    return {"inference_forwards": seen, "forwards_after": module.calls}


def test_the_pipeline_shape_inference_hook_runs_once_after_torchs_inference_and_before_the_real_steps():
    # torch 2.13+ infers shapes with a real forward and backward (_post_metadata_inference_cleanup marks the
    # end); 2.11 with one no-grad forward on zeros (_shape_inference). Either way: one inference forward,
    # then the callback, then exactly one forward per micro-batch.
    (r,) = run_on_ranks(shape_inference_hook_on_one_rank, 1, 3)
    assert r == {"inference_forwards": [1], "forwards_after": 3}


def v_shaped_pipeline_step() -> list[float]:
    """Rank body: four Linear stages on two ranks in a V (rank 0: stages 0 and 3, rank 1: 1 and 2), one step."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from mesh.private_api import no_warm_up_messages_to_self

    rank = dist.get_rank()
    torch.manual_seed(0)
    modules = [torch.nn.Linear(4, 4) for _ in range(4)]
    stages = [PipelineStage(modules[i], i, 4, torch.device("cpu")) for i in (rank, 3 - rank)]
    for stage in stages:
        no_warm_up_messages_to_self(stage)
    schedule = get_schedule_class("ZBVZeroBubble")(
        stages, n_microbatches=2, loss_fn=lambda y, t: (y**2).sum(), scale_grads=False
    )
    losses = []
    if rank == 0:
        schedule.step(torch.ones(4, 4), target=torch.zeros(4, 4), losses=losses)
    else:
        schedule.step()
    return [float(loss) for loss in losses]


def test_a_v_shaped_pipeline_warms_up_without_messages_to_its_own_rank():
    # torch 2.11 sent its warm-up messages between stages 1 and 2 although both sit on rank 1; gloo refused
    losses, nothing = run_on_ranks(v_shaped_pipeline_step, 2)
    assert len(losses) == 2 and all(loss > 0 for loss in losses) and nothing == []


def test_checkpoint_wrapper_keeps_names_loadable():
    from mesh.private_api import checkpoint_wrapper

    block = torch.nn.Sequential(torch.nn.Linear(4, 4))
    wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
    assert set(wrapped.state_dict()) == set(block.state_dict())  # its state-dict hook strips the prefix
    x = torch.randn(2, 4, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None


def replicate_and_offload_on_two_ranks() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from mesh import private_api as api

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    names = [n for n, _ in model.named_parameters()]
    api.replicate_with_ddp(model, dist.group.WORLD, torch.device("cpu"), broadcast_buffers=False)
    model.set_requires_gradient_sync(False)  # read by the next forward: no all-reduce in this backward
    x = torch.full((1, 4), float(dist.get_rank() + 1))
    model(x).sum().backward()
    local = model[0].weight.grad.clone()
    mesh = init_device_mesh("cpu", (2,))
    offloaded = fully_shard(torch.nn.Linear(4, 4), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    plain = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    return {
        "names": [n for n, _ in model.named_parameters()] == names,
        "is_sequential": isinstance(model, torch.nn.Sequential),
        "local_grad_row": local[0].tolist(),
        "offloads": (api.offloads_to_host(offloaded), api.offloads_to_host(plain)),
    }


def test_ddp_replicate_in_place_and_the_offload_flag():
    r0, r1 = run_on_ranks(replicate_and_offload_on_two_ranks, 2)
    assert r0["names"] and r0["is_sequential"]  # no wrapper module: same class, same parameter names
    # gradient sync off: each rank keeps its own gradient (its input was rank + 1 everywhere)
    assert r0["local_grad_row"] == [1.0] * 4 and r1["local_grad_row"] == [2.0] * 4
    assert r0["offloads"] == (True, False)


def test_profiled_cpu_allocations_report_each_block_and_the_allocators_total():
    from torch.profiler import ProfilerActivity, profile

    from mesh.private_api import profiled_cpu_allocations

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        first = torch.empty(1000, dtype=torch.float32)
        del first
        second = torch.empty(3000, dtype=torch.uint8)
        del second
    sizes = [nbytes for _, nbytes, _ in profiled_cpu_allocations(prof)]
    totals = [total for _, _, total in profiled_cpu_allocations(prof)]
    assert sizes == [4000, -4000, 3000, -3000]
    # the allocator's running total after each event (blocks of an earlier profile in this process may remain)
    assert totals == [totals[0], totals[0] - 4000, totals[0] - 1000, totals[0] - 4000] and totals[0] >= 4000


def test_the_allocators_total_counts_a_free_on_a_thread_the_profile_does_not_follow():
    import threading

    from torch.profiler import ProfilerActivity, profile

    from mesh.private_api import cpu_allocator_counts_every_thread, profiled_cpu_allocations

    def totals(every_thread: bool) -> list[int]:
        held = []
        counting = cpu_allocator_counts_every_thread() if every_thread else contextlib.nullcontext(True)
        with counting as counts, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            held.append(torch.empty(1 << 16, dtype=torch.uint8))
            worker = threading.Thread(target=held.clear)  # as gloo's worker drops a finished Work's buffer
            worker.start()
            worker.join()
            after = torch.empty(1000, dtype=torch.uint8)
            del after
        assert counts
        events = profiled_cpu_allocations(prof)
        return [total - (events[0][2] - events[0][1]) for _, _, total in events]

    # the worker's free is not an event either way; without the flag the total never subtracts it
    assert totals(False) == [1 << 16, (1 << 16) + 1000, 1 << 16]
    assert totals(True) == [1 << 16, 1000, 0]


def test_memory_snapshot_and_timeline_apis():
    import inspect

    from mesh.private_api import memory_timeline_categories

    # profile.memory_snapshot on CUDA: start/stop the allocator history, then dump it (exercised on a GPU by
    # tests/test_gpu.py::test_profiled_gpu_run_writes_a_memory_snapshot_and_logs_mfu; a CPU wheel has no CUDA
    # allocator).
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert list(record)[0] == "enabled" and "max_entries" in record
    assert list(inspect.signature(torch.cuda.memory._dump_snapshot).parameters)[0] == "filename"
    # the CPU memory timeline's columns, in torch's order
    names = memory_timeline_categories()
    assert names[0] is None and names[-1] == "unknown"
    assert set(names[1:-1]) == {
        "parameter",
        "optimizer state",
        "input",
        "temporary",
        "activation",
        "gradient",
        "autograd detail",
    }


def test_outer_saved_tensors_hooks_finds_the_pair_it_shadows_and_a_dtensor_local_read_saves_nothing():
    """mesh/tensor_parallel.py's re-gather hooks hand every tensor they do not keep to the pair they shadow
    (``outer_saved_tensors_hooks``); saved_tensors_hooks do not nest, so without it they would drop them."""
    from mesh.private_api import outer_saved_tensors_hooks

    assert outer_saved_tensors_hooks() is None  # no pair is active
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outer = outer_saved_tensors_hooks()
        assert outer is not None and outer[0] is pack
        x = torch.ones(3, requires_grad=True)
        (x * x).sum().backward()  # mul saves both inputs through the active pair
    assert packed == [torch.Size([3])] * 2 and x.grad.tolist() == [2.0] * 3
    assert outer_saved_tensors_hooks() is None


def blockwise_attention_against_sdpa(device: str, dtype: torch.dtype) -> dict:
    """Two key blocks (the first full, the second causal) through ``attention_with_lse``, merged by their LSE,
    and each block's backward run with the merged output and LSE, against SDPA over all keys at once.

    Grouped heads (4 query heads, 2 kv heads), fewer queries than keys: ring attention's off-diagonal step.
    Returns the largest difference of the output and of dq, dk, dv, relative to the largest reference value.
    """
    import torch.nn.functional as F

    from mesh.lse_attention import attention_with_lse, attention_with_lse_backward

    gen = torch.Generator(device=device).manual_seed(0)
    b, heads, kv_heads, n, d = 2, 4, 2, 24, 16
    q = torch.randn(b, heads, n, d, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(b, kv_heads, 2 * n, d, generator=gen, device=device).to(dtype) for _ in "kv")
    grad = torch.randn(b, heads, n, d, generator=gen, device=device).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(n, 2 * n, dtype=torch.bool, device=device).tril(n)  # all of block 0; block 1 causal
    reference = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    reference.backward(grad)

    blocks = [(slice(0, n), False), (slice(n, 2 * n), True)]
    parts = [attention_with_lse(q, k[:, :, keys], v[:, :, keys], causal) for keys, causal in blocks]
    (out_a, lse_a, _), (out_b, lse_b, _) = parts
    acc = torch.promote_types(dtype, torch.float32)  # the merge's dtype (fp64 stays fp64)
    lse = torch.logaddexp(lse_a.to(acc), lse_b.to(acc))
    out = (out_a.to(acc) * (lse_a - lse).exp()[..., None] + out_b.to(acc) * (lse_b - lse).exp()[..., None]).to(dtype)
    dq, dk, dv = torch.zeros_like(q, dtype=acc), [], []
    for (keys, causal), (_, _, state) in zip(blocks, parts, strict=True):
        dq_block, dk_block, dv_block = attention_with_lse_backward(
            grad, q, k[:, :, keys], v[:, :, keys], out, lse, causal, state
        )
        dq += dq_block.to(acc)
        dk.append(dk_block)
        dv.append(dv_block)

    def rel(a, e):
        return ((a.float() - e.float()).abs().max() / e.float().abs().max()).item()

    return {
        "out": rel(out, reference),
        "dq": rel(dq, leaves[0].grad),
        "dk": rel(torch.cat(dk, 2), leaves[1].grad),
        "dv": rel(torch.cat(dv, 2), leaves[2].grad),
        "lse_dtype": lse_a.dtype,
        "lse_shape": tuple(lse_a.shape),
    }


def test_fused_attention_with_lse_merges_blocks_into_sdpa_on_cpu():
    from mesh.lse_attention import fused_attention_kernel

    assert fused_attention_kernel(torch.zeros(1, 1, 1, 8)) == "cpu_flash"
    # fp64: rounding only (~1e-16); 1e-12 fails on any wrong mask, scale or merge
    r = blockwise_attention_against_sdpa("cpu", torch.float64)
    assert max(r["out"], r["dq"], r["dk"], r["dv"]) < 1e-12, r
    assert r["lse_shape"] == (2, 4, 24)  # one value per query row and head, kv heads read as grouped
    # bf16: the kernel returns an fp32 LSE; the outputs differ from SDPA's by bf16 rounding (measured <= 7.3e-3,
    # one bf16 step is 2^-7 = 7.8e-3 of a value near 1); 3e-2 allows a few steps and fails on a wrong block
    r = blockwise_attention_against_sdpa("cpu", torch.bfloat16)
    assert r["lse_dtype"] == torch.float32 and max(r["out"], r["dq"], r["dk"], r["dv"]) < 3e-2, r


def test_grouped_mm_matches_a_loop_over_groups_and_takes_an_expanded_gradient():
    """models/kernels.py wraps torch._grouped_mm, the one private torch API outside mesh/private_api.py."""
    from models.kernels import grouped_mm, grouped_mm_works

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(7, 8, generator=gen, requires_grad=True)
    b = torch.randn(3, 8, 16, generator=gen, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # group 1 is empty
    out = grouped_mm(a, b, offs)
    assert torch.equal(out, torch.cat([a[:2] @ b[0], a[2:7] @ b[2]]))
    out.sum().backward()  # an expanded (stride 0) gradient: torch's own backward refuses it
    assert torch.allclose(b.grad[1], torch.zeros(8, 16)) and torch.allclose(
        b.grad[2], a[2:].sum(0)[:, None].expand(8, 16)
    )
    assert torch.allclose(a.grad, torch.cat([b[0].sum(1).expand(2, 8), b[2].sum(1).expand(5, 8)]).detach())
    assert grouped_mm_works(torch.device("cpu"), torch.float32, ((8, 16), (16, 8)))
    # fp64 is refused by the kernel (CPU: fp32, bf16, fp16): the MoE experts then loop, with a warning
    with pytest.warns(UserWarning, match="experts run one after another"):
        assert not grouped_mm_works(torch.device("cpu"), torch.float64, ((8, 16), (16, 8)))


def flight_recorder_on_two_ranks() -> dict:
    import time

    from mesh.private_api import flight_recorder_dump

    group = dist.new_group(backend="gloo", group_desc="meshloom_test")
    dist.all_reduce(torch.ones(3), group=group)
    # The recorder marks a collective completed from gloo's work thread, which may lag the caller under load
    # (seen once: -1 right after the all-reduce returned); give it a few seconds before reading the status.
    deadline = time.monotonic() + 10
    while True:
        dump = flight_recorder_dump()
        [name] = {e["process_group"][0] for e in dump["entries"] if e["process_group"][1] == "meshloom_test"}
        if dump["pg_status"][name]["last_completed_collective"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {
        "ops": [e["profiling_name"] for e in dump["entries"] if e["process_group"][0] == name],
        "config": dump["pg_config"][name],
        "completed": dump["pg_status"][name]["last_completed_collective"],
        "frames": any(f["name"] == "flight_recorder_on_two_ranks" for f in dump["entries"][-1]["frames"]),
    }


def test_the_flight_recorder_dump_holds_gloo_collectives_with_their_groups():
    # runtime/failures.py reads these fields; torch's analyser needs pg_config, which gloo leaves empty
    for r in run_on_ranks(flight_recorder_on_two_ranks, 2):
        assert r["ops"] == ["gloo:all_reduce"] and r["completed"] == 1 and r["frames"]
        assert r["config"]["desc"] == "meshloom_test" and r["config"]["ranks"] == "[0, 1]"


def test_keep_compiled_backward_inputs_turns_donated_buffers_off():
    import torch._functorch.config as functorch_config

    from mesh.private_api import keep_compiled_backward_inputs

    with functorch_config.patch(donated_buffer=True):  # the flag exists in this release, and the wrapper clears it
        keep_compiled_backward_inputs()
        assert functorch_config.donated_buffer is False


def test_key_compiled_graphs_by_group_turns_aotautograds_cache_off():
    import torch._functorch.config as functorch_config

    from mesh.private_api import key_compiled_graphs_by_group

    # the flag exists in this release, and the wrapper clears it
    with functorch_config.patch(enable_autograd_cache=True):
        key_compiled_graphs_by_group()
        assert functorch_config.enable_autograd_cache is False


def block_with_a_donated_buffer(x, w):
    return (torch.relu(x @ w) @ w).sin()  # saves an intermediate that nothing else holds: a donated buffer


@pytest.mark.slow  # three compilations with inductor's caches off (a cached backward may carry another donation)
def test_a_compiled_backward_run_twice_needs_its_saved_activations_kept():
    """A zero-bubble schedule runs a compiled block's backward twice: the input-gradient pass with
    ``retain_graph=True``, then the weight-gradient pass. Once a full backward (DualPipeV has both) compiled it with
    donated buffers, torch refuses the first of those (the pinned limitation); with ``keep_compiled_backward_inputs``
    both passes run and give the eager gradients."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from mesh.private_api import keep_compiled_backward_inputs

    block = block_with_a_donated_buffer
    torch.manual_seed(0)
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    dx_eager, dw_eager = torch.autograd.grad(block(x, w).sum(), (x, w))
    with functorch_config.patch(donated_buffer=True), inductor_config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        compiled = torch.compile(block)
        torch.autograd.grad(compiled(x, w).sum(), x)  # a full backward compiles it, donating its saved buffers
        with pytest.raises(RuntimeError, match="donated buffers"):
            torch.autograd.grad(compiled(x, w).sum(), x, retain_graph=True)
        keep_compiled_backward_inputs()
        torch._dynamo.reset()
        compiled = torch.compile(block)
        torch.autograd.grad(compiled(x, w).sum(), x)
        out = compiled(x, w).sum()
        (dx,) = torch.autograd.grad(out, x, retain_graph=True)  # the input-gradient pass
        (dw,) = torch.autograd.grad(out, w)  # the weight-gradient pass runs the same backward again
    torch._dynamo.reset()
    torch.testing.assert_close(dx, dx_eager)
    torch.testing.assert_close(dw, dw_eager)


def test_a_row_count_marked_dynamic_compiles_once_and_the_frame_counter_sees_recompiles():
    from mesh.private_api import compiled_frames, mark_rows_dynamic

    def double(x):
        return x * 2

    marked, unmarked = torch.compile(double, backend="eager"), torch.compile(lambda x: x * 3, backend="eager")
    start = compiled_frames()
    for rows in (4, 5, 7):
        x = torch.ones(rows, 3)
        mark_rows_dynamic(x)
        assert torch.equal(marked(x), x * 2)
    assert compiled_frames() - start == 1  # one graph for every row count
    start = compiled_frames()
    for rows in (4, 5):
        unmarked(torch.ones(rows, 3))
    assert compiled_frames() - start == 2  # unmarked, the second count recompiles: the counter sees it
