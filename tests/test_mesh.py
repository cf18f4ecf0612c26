"""One root mesh: every view meshloom uses (dp, fsdp, tp, pp, loss, ep, expert_fsdp) is cut from the world
mesh, so no communicator exists twice; and every group carries the configured timeout."""

import datetime

import pytest
import torch
import torch.distributed as dist

from launch.spawn import run_on_ranks

TIMEOUT_S = 37  # an unusual number, so a group with a default timeout cannot match by accident


def mesh_facts(dp_replicate: int, dp_shard: int, ep: int, tp: int) -> dict:
    from mesh.dims import ParallelDims, build_mesh
    from mesh.private_api import group_timeout, root_mesh
    from runtime.process import init_process_group, new_cpu_group

    control = init_process_group(torch.device("cpu"), TIMEOUT_S)
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, world_size=dist.get_world_size())
    meshes = build_mesh(dims, torch.device("cpu"), TIMEOUT_S, has_experts=True)
    groups = [m.get_group(i) for m in meshes.all().values() for i in range(m.ndim)]
    return {
        "roots": {name: root_mesh(m) is meshes.world for name, m in meshes.all().items()},
        "ep_ranks": dist.get_process_group_ranks(meshes.ep.get_group()),
        "expert_fsdp_dims": meshes.expert_fsdp.mesh_dim_names,
        "timeouts": {group_timeout(g) for g in [*groups, control.group, new_cpu_group(TIMEOUT_S, "test")]},
    }


@pytest.mark.parametrize(
    "layout, ep_groups",
    [
        ((1, 4, 2, 1), [[0, 1], [2, 3]]),
        ((2, 2, 2, 1), [[0, 1], [2, 3]]),
        ((1, 2, 2, 2), [[0, 1], [2, 3]]),
        ((1, 2, 4, 2), [[0, 1, 2, 3]]),
    ],
    ids=["fsdp4-ep2", "hsdp2x2-ep2", "fsdp2-ep2-tp2", "fsdp2-ep4-tp2"],
)
def test_every_mesh_shares_one_root_and_the_timeout(layout, ep_groups):
    results = run_on_ranks(mesh_facts, 4, *layout)
    for rank, facts in enumerate(results):
        assert all(facts["roots"].values()), facts["roots"]
        assert set(facts["roots"]) >= {"world", "dp", "fsdp", "tp", "pp", "loss", "ep", "expert_fsdp"}
        # ep groups are runs of consecutive ranks of (dp_shard, cp, tp) (= efsdp x ep, row-major): the tp pairs
        # {0, 1} and {2, 3} when tp = 2 and ep = 2
        assert facts["ep_ranks"] in ep_groups and rank in facts["ep_ranks"]
        assert facts["timeouts"] == {datetime.timedelta(seconds=TIMEOUT_S)}
    assert results[0]["expert_fsdp_dims"] == (("experts_dp_replicate", "efsdp") if layout[0] > 1 else ("efsdp",))
