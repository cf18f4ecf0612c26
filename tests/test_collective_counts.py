"""The collectives the data- and expert-parallel chapters promise, counted with CommDebugMode.

FSDP2 (docs/data_parallel.md, ZeRO-3 / FSDP): per unit, one all-gather before its forward, another before
its backward when the unit resharded after forward, and one reduce-scatter of its gradients. HSDP adds one
all-reduce per unit across the replicas. Expert parallelism (docs/expert_parallel.md): per MoE layer, a
count exchange and two token all-to-alls in forward, and the two reverse all-to-alls in backward.
(Tensor parallelism's counts are in tests/test_tensor_parallel.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.debug import CommDebugMode

from models.llama import ModelArgs, Transformer
from models.moe import MoEArgs
from tests.api_path import (
    api_fsdp,
    api_meshes,
    comm_counts,
    global_batch,
    loss_share,
    materialize,
    meta_model,
    my_slice,
)
from tests.harness import run_on_ranks


def fsdp_step_collectives(dp_replicate: int, dp_shard: int, policy: str) -> dict:
    model = materialize(api_fsdp(meta_model(), api_meshes(dp_replicate, dp_shard), policy))
    inputs, targets = global_batch(dist.get_world_size())
    with CommDebugMode() as forward:
        out = model(my_slice(inputs))
    with CommDebugMode() as backward:
        loss_share(out, my_slice(targets), targets.numel()).backward()
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    return {"units": units, "forward": comm_counts(forward), "backward": comm_counts(backward)}


@pytest.mark.parametrize(
    "policy, regathered",
    [("always", lambda units: units), ("default", lambda units: units - 2), ("never", lambda units: 0)],
    ids=["always", "default", "never"],
)
def test_fsdp_gathers_each_unit_before_use_and_reduce_scatters_its_gradients_once(policy, regathered):
    r = run_on_ranks(fsdp_step_collectives, 2, 1, 2, policy)[0]
    units = r["units"]
    assert units == 3  # 2 blocks + the root (embedding, final norm, head)
    assert r["forward"] == {"_allgather_base_": units}
    # `default` keeps the last block and the root gathered (their backward comes first); `never` keeps all
    expected = {"_allgather_base_": regathered(units), "_reduce_scatter_base_": units}
    assert r["backward"] == {k: v for k, v in expected.items() if v}


def test_hsdp_adds_one_all_reduce_per_unit_across_replicas():
    for r in run_on_ranks(fsdp_step_collectives, 4, 2, 2, "default"):
        units = r["units"]
        assert r["forward"] == {"_allgather_base_": units}  # inside the shard group only
        # reduce-scatter inside the shard group, then the gradient shard is all-reduced across the 2 replicas
        assert r["backward"] == {"_allgather_base_": units - 2, "_reduce_scatter_base_": units, "allreduce_": units}


MOE_ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                     moe=MoEArgs(n_experts=4, top_k=2, hidden_dim=16))  # fmt: skip


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
