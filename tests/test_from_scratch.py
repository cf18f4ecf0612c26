"""Each from-scratch sketch in examples/ computes what meshloom's API path computes: outputs and gradients.

The sketches use plain torch.distributed; the API path is mesh/ (FSDP2, parallelize_module, pipelining,
ExpertParallel). Both run on the same 2 gloo ranks, from the same weights, on the same data. Tolerances:
both sides do the same fp32 arithmetic; where they differ it is in the order of a few sums (two-rank
reductions, split matmuls), which moves O(1) values by ~1e-7, so 1e-6 relative fails on any real difference
(a missing reduction, a wrong shard, a double scale) while allowing for that order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from examples.ddp_from_scratch import BucketedDDP
from examples.moe_from_scratch import expert_parallel
from examples.pipeline_1f1b_from_scratch import one_f_one_b
from examples.ring_attention_from_scratch import gathered_attention, positions, ring_attention_forward
from examples.tp_from_scratch import parallel_mlp, shard_mlp
from examples.zero1_from_scratch import ZeRO1AdamW
from examples.zero3_from_scratch import ShardedUnit
from launch.spawn import run_on_ranks
from models.moe import GroupedExperts, MoE, MoEArgs
from tests.api_path import (
    PER_RANK,
    RTOL,
    SEQ,
    TINY,
    api_cp_attention,
    api_expert_parallel,
    api_fsdp,
    api_meshes,
    api_pipeline,
    api_stage,
    api_tensor_parallel,
    comm_counts,
    count_calls,
    full,
    global_batch,
    loss_share,
    materialize,
    meta_model,
    my_slice,
    plain_model,
    rel_error,
)

# Run on the oldest and the newest supported torch too (.ci/compat).
pytestmark = pytest.mark.compat

# ---- DDP: buckets of all-reduces vs FSDP2 on the replicate dim ------------------------------------------------


def ddp_vs_replicate() -> dict:
    inputs, targets = global_batch(dist.get_world_size())
    tokens = targets.numel()
    sketch = BucketedDDP(plain_model(), bucket_bytes=64 * 1024)
    out_sketch = sketch(my_slice(inputs))
    loss_share(out_sketch, my_slice(targets), tokens).backward()
    launched = sketch.finish_gradient_sync()

    api = materialize(api_fsdp(meta_model(), api_meshes(dp_replicate=2, dp_shard=1)))
    out_api = api(my_slice(inputs))
    with CommDebugMode() as backward:
        loss_share(out_api, my_slice(targets), tokens).backward()
    grads_api = dict(api.named_parameters())
    return {
        "output": rel_error(out_sketch, full(out_api)),
        "grads": max(rel_error(p.grad, full(grads_api[n].grad)) for n, p in sketch.module.named_parameters()),
        "sketch all-reduces": launched,
        "api backward": comm_counts(backward),
    }


def test_ddp_sketch_equals_fsdp_on_the_replicate_dim():
    for r in run_on_ranks(ddp_vs_replicate, 2):
        assert r["output"] < RTOL and r["grads"] < RTOL, r
        # Both sum the gradients with all-reduces: one per bucket in the sketch, one per FSDP unit in meshloom (2
        # blocks, the embedding, the norm with the head: mesh/data_parallel.py's vocabulary units; the root keeps
        # only buffers); a shard group of size 1 needs no all-gather and no reduce-scatter.
        assert r["api backward"] == {"allreduce_": 4} and r["sketch all-reduces"] >= 2


# ---- ZeRO-1: sharded AdamW state vs FSDP2 + AdamW ------------------------------------------------------------

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


def zero1_vs_fsdp() -> dict:
    inputs, targets = global_batch(dist.get_world_size())
    tokens = targets.numel()
    sketch = plain_model()
    zero = ZeRO1AdamW(sketch.parameters(), **ADAMW)
    out_sketch = sketch(my_slice(inputs))
    loss_share(out_sketch, my_slice(targets), tokens).backward()
    zero.step()

    api = materialize(api_fsdp(meta_model(), api_meshes(dp_replicate=1, dp_shard=2)))
    optimizer = torch.optim.AdamW(api.parameters(), **ADAMW)
    out_api = api(my_slice(inputs))
    loss_share(out_api, my_slice(targets), tokens).backward()
    summed_slice = zero.slice.grad.clone()
    api_grad = torch.cat([full(p.grad).flatten() for p in api.parameters()])
    optimizer.step()
    rank, size = dist.get_rank(), zero.size
    api_params = dict(api.named_parameters())
    return {
        "output": rel_error(out_sketch, full(out_api)),
        # the slice of the summed gradient this rank updates, against the same slice of FSDP's gradient
        "grads": rel_error(summed_slice[: api_grad.numel() - rank * size], api_grad[rank * size : (rank + 1) * size]),
        "params after one step": max(rel_error(p, full(api_params[n])) for n, p in sketch.named_parameters()),
        "moments here / one process": (zero.state_numel(), 2 * sum(p.numel() for p in sketch.parameters())),
    }


def test_zero1_sketch_equals_fsdp_with_adamw():
    for r in run_on_ranks(zero1_vs_fsdp, 2):
        # AdamW divides by sqrt(v): a 1e-9 gradient difference on a near-zero gradient can move a parameter by
        # a sizeable fraction of lr (TORCH_CPU_FACTS.md); here the gradients agree to round-off, so do params.
        assert r["output"] < RTOL and r["grads"] < RTOL and r["params after one step"] < RTOL, r
        held, total = r["moments here / one process"]
        assert abs(held - total / 2) <= 2  # half the Adam state (the last slice is padded)


# ---- ZeRO-3: gather, run, free, reduce-scatter vs FSDP2 (reshard after forward) -------------------------------


def zero3_vs_fsdp() -> dict:
    inputs, targets = global_batch(dist.get_world_size())
    tokens = targets.numel()
    sketch = plain_model()
    units = {"tok_embeddings": sketch.tok_embeddings, "norm": sketch.norm, "output": sketch.output}
    units.update({f"layers.{k}": block for k, block in sketch.layers.items()})
    for name, module in units.items():  # replace every unit by its sharded wrapper; Transformer.forward is unchanged
        parent, _, attr = name.rpartition(".")
        setattr(sketch.get_submodule(parent) if parent else sketch, attr, ShardedUnit(module))
    # The sketch recomputes each unit inside backward, which CommDebugMode's module tracker cannot follow.
    with count_calls("all_gather_into_tensor", "reduce_scatter_tensor") as forward:
        out_sketch = sketch(my_slice(inputs))
    with count_calls("all_gather_into_tensor", "reduce_scatter_tensor") as backward:
        loss_share(out_sketch, my_slice(targets), tokens).backward()
    sketch_counts = (forward, backward)

    api = materialize(api_fsdp(meta_model(), api_meshes(dp_replicate=1, dp_shard=2), reshard_after_forward="always"))
    with CommDebugMode() as forward:
        out_api = api(my_slice(inputs))
    with CommDebugMode() as backward:
        loss_share(out_api, my_slice(targets), tokens).backward()
    api_grads = dict(api.named_parameters())
    errors = []
    for name in units:
        wrapper = sketch.get_submodule(name)
        gathered = torch.empty(wrapper.shard.numel() * dist.get_world_size())
        dist.all_gather_into_tensor(gathered, wrapper.shard.grad)
        expected = torch.cat([full(api_grads[f"{name}.{n}"].grad).flatten() for n in wrapper.names])
        errors.append(rel_error(gathered[: wrapper.numel], expected))
    return {
        "output": rel_error(out_sketch, full(out_api)),
        "grads": max(errors),
        "sketch": sketch_counts,
        "api": (comm_counts(forward), comm_counts(backward)),
        "units": len(units),
    }


def test_zero3_sketch_equals_fsdp_resharding_after_forward():
    for r in run_on_ranks(zero3_vs_fsdp, 2):
        assert r["output"] < RTOL and r["grads"] < RTOL, r
        # Per unit: one all-gather in forward, one more in backward, one reduce-scatter. The sketch has 5 units
        # (embedding, 2 blocks, norm, head), meshloom 4 (embedding, 2 blocks, the norm with the head as one unit:
        # the norm's few weights ride with the head's gather; the root keeps only buffers).
        n = r["units"]
        assert r["sketch"] == (
            {"all_gather_into_tensor": n, "reduce_scatter_tensor": 0},
            {"all_gather_into_tensor": n, "reduce_scatter_tensor": n},
        )
        assert r["api"] == ({"_allgather_base_": 4}, {"_allgather_base_": 4, "_reduce_scatter_base_": 4})


# ---- Megatron TP MLP: f and g by hand vs ColwiseParallel / RowwiseParallel -----------------------------------


def tp_mlp_vs_parallelize_module() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = plain_model().layers["0"].feed_forward  # the full weights, to cut by hand
    x = torch.randn(PER_RANK, SEQ, TINY.dim, generator=torch.Generator().manual_seed(5))  # the same x on every rank
    pieces = [
        w.detach().clone().requires_grad_()
        for w in shard_mlp(reference.w1.weight, reference.w3.weight, reference.w2.weight, rank, world)
    ]
    x_sketch = x.clone().requires_grad_()
    with CommDebugMode() as forward:
        out_sketch = parallel_mlp(x_sketch, *pieces)
    with CommDebugMode() as backward:
        out_sketch.square().sum().backward()
    sketch_counts = (comm_counts(forward), comm_counts(backward))

    model = meta_model()
    api_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    mlp = materialize(model).layers["0"].feed_forward
    x_api = x.clone().requires_grad_()
    with CommDebugMode() as forward:
        out_api = mlp(x_api)
    with CommDebugMode() as backward:
        out_api.square().sum().backward()
    local = [mlp.w1.weight.grad.to_local(), mlp.w3.weight.grad.to_local(), mlp.w2.weight.grad.to_local()]
    return {
        "output": rel_error(out_sketch, out_api),
        "input grad": rel_error(x_sketch.grad, x_api.grad),
        "weight grads": max(rel_error(p.grad, g) for p, g in zip(pieces, local, strict=True)),
        "sketch": sketch_counts,
        "api": (comm_counts(forward), comm_counts(backward)),
    }


def test_tp_sketch_equals_colwise_rowwise_parallel():
    for r in run_on_ranks(tp_mlp_vs_parallelize_module, 2):
        assert r["output"] < RTOL and r["input grad"] < RTOL and r["weight grads"] < RTOL, r
        assert r["sketch"] == ({"allreduce_": 1}, {"allreduce_": 1})  # g forward, f backward
        assert r["api"] == ({"all_reduce": 1}, {"all_reduce": 1})  # the same two, issued by DTensor


# ---- 1F1B: send/recv by hand vs torch.distributed.pipelining's Schedule1F1B ----------------------------------


def pipeline_vs_schedule(microbatches: int = 4) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, targets = global_batch(world)  # pure pipeline: both ranks see the whole batch
    tokens = targets.numel()
    loss_fn = lambda logits, t: loss_share(logits, t, tokens)  # noqa: E731
    stage = lambda: api_stage(TINY, [rank], rank == 0, rank == world - 1)  # noqa: E731
    sketch = stage()
    mb = inputs.shape[0] // microbatches
    losses, _ = one_f_one_b(
        sketch, list(inputs.chunk(microbatches)), list(targets.chunk(microbatches)), loss_fn, (mb, SEQ, TINY.dim)
    )

    api = stage()
    schedule = api_pipeline(api, rank, world, microbatches, loss_fn)
    api_losses: list = []
    schedule.step(*((inputs,) if rank == 0 else ()), **({"target": targets, "losses": api_losses} if rank else {}))
    api_grads = dict(api.named_parameters())
    return {
        "losses": [(a.item(), b.item()) for a, b in zip(losses, api_losses, strict=True)],
        "grads": max(rel_error(p.grad, api_grads[n].grad) for n, p in sketch.named_parameters()),
    }


def test_1f1b_sketch_equals_torch_schedule():
    results = run_on_ranks(pipeline_vs_schedule, 2)
    assert results[0]["losses"] == [] and len(results[1]["losses"]) == 4  # only the last stage has losses
    for sketch_loss, api_loss in results[1]["losses"]:
        assert sketch_loss == pytest.approx(api_loss, rel=RTOL)
    for r in results:
        assert r["grads"] < RTOL, r


# ---- MoE: dispatch and combine by hand vs ExpertParallel ------------------------------------------------------

MOE = MoEArgs(n_experts=4, top_k=2, hidden_dim=16)


def moe_vs_expert_parallel() -> dict:
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    api = MoE(TINY.dim, MOE, shared_hidden_dim=TINY.hidden_dim)
    for p in api.parameters():
        torch.nn.init.normal_(p, std=0.2)
    sketch = copy.deepcopy(api)
    n_local = MOE.n_experts // ep
    mine = slice(rank * n_local, (rank + 1) * n_local)
    local = GroupedExperts(TINY.dim, MOE.hidden_dim, n_local)  # this rank's experts, as plain parameters
    for name in ("w1", "w2", "w3"):
        getattr(local, name).data.copy_(getattr(sketch.experts, name).data[mine])
    sketch.experts.forward = lambda x, counts: expert_parallel(x, counts, local)

    api_expert_parallel(api.experts, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)))
    x = torch.randn(PER_RANK, SEQ, TINY.dim, generator=torch.Generator().manual_seed(10 + rank))  # own tokens
    results = {}
    for name, moe in (("sketch", sketch), ("api", api)):
        xr = x.clone().requires_grad_()
        with CommDebugMode() as forward:
            out = moe(xr)
        with CommDebugMode() as backward:
            out.square().sum().backward()
        results[name] = (out, xr.grad, moe.router.gate.weight.grad, (comm_counts(forward), comm_counts(backward)))
    api_experts = [getattr(api.experts, w).grad.to_local() for w in ("w1", "w2", "w3")]
    return {
        "output": rel_error(results["sketch"][0], results["api"][0]),
        "input grad": rel_error(results["sketch"][1], results["api"][1]),
        "router grad": rel_error(results["sketch"][2], results["api"][2]),
        "expert grads": max(
            rel_error(getattr(local, w).grad, g) for w, g in zip(("w1", "w2", "w3"), api_experts, strict=True)
        ),
        "sketch": results["sketch"][3],
        "api": results["api"][3],
    }


def test_moe_sketch_equals_expert_parallel():
    for r in run_on_ranks(moe_vs_expert_parallel, 2):
        for key in ("output", "input grad", "router grad", "expert grads"):
            assert r[key] < RTOL, (key, r)
        # the count exchange and two token all-to-alls forward; the two reverse all-to-alls backward
        assert r["sketch"] == ({"alltoall_base_": 3}, {"alltoall_base_": 2})
        # meshloom: the count exchange and two autograd token exchanges, all functional collectives (so that
        # selective activation checkpointing can keep their outputs)
        assert r["api"] == ({"all_to_all_single": 3}, {"all_to_all_single": 2})


# ---- context parallelism: gathered K/V and the ring by hand vs mesh/context_parallel.py -----------------------


def context_parallel_vs_api() -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(6)  # the same full sequence on every rank; the sketch has heads == kv heads
    q, k, v = (torch.randn(2, 4, 8 * cp, 8, generator=gen)[:, :, positions(8 * cp, rank, cp)] for _ in "qkv")
    weight = torch.randn(2, 4, 8, 8, generator=gen)  # multiplies this rank's 8 outputs per head
    sketch = [t.clone().requires_grad_() for t in (q, k, v)]
    out_sketch = gathered_attention(*sketch)
    (out_sketch * weight).sum().backward()
    result = {"ring forward": rel_error(ring_attention_forward(q, k, v), out_sketch.detach())}
    for algorithm in ("allgather", "ring"):
        api = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]  # meshloom's (b, n, heads, d)
        out_api = api_cp_attention(*api, algorithm).transpose(1, 2)
        (out_api * weight).sum().backward()
        result[algorithm] = [rel_error(out_api, out_sketch)] + [
            rel_error(a.grad.transpose(1, 2), s.grad) for a, s in zip(api, sketch, strict=True)
        ]
    return result


def test_context_parallel_sketch_equals_both_algorithms():
    for r in run_on_ranks(context_parallel_vs_api, 2):
        assert r["ring forward"] < RTOL, r
        for algorithm in ("allgather", "ring"):
            assert max(r[algorithm]) < RTOL, (algorithm, r[algorithm])  # output, dq, dk, dv
