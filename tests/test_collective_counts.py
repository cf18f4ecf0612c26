"""The collectives the data- and expert-parallel chapters promise, counted with CommDebugMode.

FSDP2 (docs/data_parallel.md, ZeRO-3 / FSDP): per unit, one all-gather before its forward, another before
its backward when the unit resharded after forward, and one reduce-scatter of its gradients. HSDP adds one
all-reduce per unit across the replicas. Expert parallelism (docs/expert_parallel.md): per MoE layer, a
count exchange and two token all-to-alls in forward, and the two reverse all-to-alls in backward.
Gradient accumulation with ``parallel.grad_sync step`` (docs/dp_savers.md section 2): one reduction per
unit and step instead of one per micro-batch (on HSDP: the all-reduce across replicas), and on PowerSGD's
replicated model only when the forward runs inside the window too.
(Tensor parallelism's counts are in tests/test_tensor_parallel.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from launch.spawn import run_on_ranks
from mesh.private_api import fsdp_units
from models.llama import ModelArgs, Transformer
from models.moe import MoEArgs
from tests.api_path import (
    PER_RANK,
    api_fsdp,
    api_meshes,
    comm_counts,
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


def fsdp_step_collectives(dp_replicate: int, dp_shard: int, policy: str) -> dict:
    model = materialize(api_fsdp(meta_model(), api_meshes(dp_replicate, dp_shard), policy))
    inputs, targets = global_batch(dist.get_world_size())
    with CommDebugMode() as forward:
        out = model(my_slice(inputs))
    with CommDebugMode() as backward:
        loss_share(out, my_slice(targets), targets.numel()).backward()
    return {"units": fsdp_units(model), "forward": comm_counts(forward), "backward": comm_counts(backward)}


@pytest.mark.parametrize(
    "policy, regathered",
    [("always", lambda units: units), ("default", lambda units: units - 2), ("never", lambda units: 0)],
    ids=["always", "default", "never"],
)
def test_fsdp_gathers_each_unit_before_use_and_reduce_scatters_its_gradients_once(policy, regathered):
    r = run_on_ranks(fsdp_step_collectives, 2, 1, 2, policy)[0]
    units = r["units"]
    # 2 blocks, the embedding, the final norm with the head (mesh/data_parallel.py: vocabulary_units); the root
    # keeps only buffers, so it has no parameters to gather
    assert units == 4
    assert r["forward"] == {"_allgather_base_": units}
    # `default` keeps the last block and the norm + head gathered (their backward comes first); `never` keeps all
    expected = {"_allgather_base_": regathered(units), "_reduce_scatter_base_": units}
    assert r["backward"] == {k: v for k, v in expected.items() if v}


def test_hsdp_adds_one_all_reduce_per_unit_across_replicas():
    for r in run_on_ranks(fsdp_step_collectives, 4, 2, 2, "default"):
        units = r["units"]
        assert r["forward"] == {"_allgather_base_": units}  # inside the shard group only
        # reduce-scatter inside the shard group, then the gradient shard is all-reduced across the 2 replicas
        assert r["backward"] == {"_allgather_base_": units - 2, "_reduce_scatter_base_": units, "allreduce_": units}


MOE_ARGS = ModelArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    multiple_of=32,
    moe=MoEArgs(n_experts=4, top_k=2, hidden_dim=16),
)


def expert_parallel_collectives() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mesh.expert_parallel import apply_expert_parallel

    with torch.device("meta"):
        model = Transformer(MOE_ARGS)
    apply_expert_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))
    materialize(model)
    inputs, targets = global_batch(dist.get_world_size())
    with CommDebugMode() as forward:
        out = model(my_slice(inputs))
    with CommDebugMode() as backward:
        loss_share(out, my_slice(targets), targets.numel()).backward()
    return {"forward": comm_counts(forward), "backward": comm_counts(backward)}


def test_expert_parallel_exchanges_counts_then_two_all_to_alls_each_way():
    layers = MOE_ARGS.n_layers  # every layer is an MoE layer
    for r in run_on_ranks(expert_parallel_collectives, 2):
        # all functional all_to_all_single: the integer count exchange, then the two autograd token exchanges
        assert r["forward"] == {"all_to_all_single": 3 * layers}
        assert r["backward"] == {"all_to_all_single": 2 * layers}


# ---- gradient accumulation: one reduction per step with grad_sync=step (savers/reduce_once_per_step.py) ----------------------

K = 3  # micro-batches accumulated per step


def accumulate_counting_reductions(
    dp_replicate: int, dp_shard: int, grad_sync: str, powersgd: bool = False, forward_outside: bool = False
) -> dict:
    """K micro-batches through meshloom's FSDP (or PowerSGD's replicated model), each inside reduction_window
    (``forward_outside``: only the backward inside, the common mistake); returns the gradient reductions by
    (collective, group) and the full gradients."""
    from measure.grad_traffic import GradientTraffic
    from savers.powersgd import apply_powersgd
    from savers.reduce_once_per_step import reduction_window

    meshes = api_meshes(dp_replicate, dp_shard)
    if powersgd:
        model = apply_powersgd(materialize(meta_model()), meshes.world["dp_replicate"], 1, torch.device("cpu"))
    else:
        model = materialize(api_fsdp(meta_model(), meshes))
    inputs, targets = global_batch(dist.get_world_size() * K)  # PER_RANK * K sequences per rank
    mine = slice(PER_RANK * K * dist.get_rank(), PER_RANK * K * (dist.get_rank() + 1))
    with GradientTraffic() as traffic:
        for i, (x, y) in enumerate(zip(inputs[mine].chunk(K), targets[mine].chunk(K), strict=True)):
            reduce = grad_sync == "microbatch" or i == K - 1
            out = model(x) if forward_outside else None
            with reduction_window([model], reduce=reduce, hsdp=dp_replicate > 1 and not powersgd):
                out = model(x) if out is None else out
                loss_share(out, y, targets.numel()).backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters()}
    return {"calls": {f"{n}@{g}": c for (n, g), c in traffic.calls.items()}, "grads": grads}


def one_process_gradients(world: int) -> dict:
    model = plain_model()
    inputs, targets = global_batch(world * K)
    loss_share(model(inputs), targets, targets.numel()).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "dp_replicate, dp_shard, per_step",
    [
        (1, 2, {"microbatch": {"reduce_scatter@shard": 4 * K}, "step": {"reduce_scatter@shard": 4}}),
        (
            2,
            2,
            {
                "microbatch": {"reduce_scatter@shard": 4 * K, "all_reduce@replicate": 4 * K},
                "step": {"reduce_scatter@shard": 4 * K, "all_reduce@replicate": 4},
            },
        ),
    ],
    ids=["fsdp2", "hsdp2x2"],
)
def test_step_sync_reduces_each_unit_once_per_step_instead_of_once_per_micro_batch(dp_replicate, dp_shard, per_step):
    world = dp_replicate * dp_shard
    expected = one_process_gradients(world)
    for grad_sync, calls in per_step.items():
        result = run_on_ranks(accumulate_counting_reductions, world, dp_replicate, dp_shard, grad_sync)[0]
        # 4 units (2 blocks, the embedding, the norm + head): FSDP reduce-scatters each unit K times, or once (K-1 fewer); HSDP keeps
        # the reduce-scatter inside the shard group per micro-batch and all-reduces across replicas once.
        assert result["calls"] == calls, grad_sync
        for name, grad in expected.items():
            assert rel_error(result["grads"][name], grad) < 1e-5, (grad_sync, name)  # the same summed gradient


def test_powersgd_replica_reduces_once_per_step_only_when_the_forward_is_inside_the_window():
    world = 2
    inside, outside = (
        run_on_ranks(accumulate_counting_reductions, world, world, 1, "step", True, forward_outside)[0]
        for forward_outside in (False, True)
    )
    # PowerSGD's first iterations reduce exactly: one all-reduce of DDP's one bucket per reducing backward.
    assert inside["calls"] == {"all_reduce@replicate": 1}
    for name, grad in one_process_gradients(world).items():
        assert rel_error(inside["grads"][name], grad) < 1e-5, name
    # DDP arms the reduction in the forward: with only the backward inside, every micro-batch reduces. K = 3
    # reductions: PowerSGD's two exact ones (one all-reduce each), then its first compressed one (three: the
    # uncompressed 1-D gradients, then P, then Q).
    assert outside["calls"] == {"all_reduce@replicate": 1 + 1 + 3}
