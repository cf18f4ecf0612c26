"""The collective identities the docs rely on, checked on gloo."""

import torch
import torch.distributed as dist

from launch.spawn import run_on_ranks


def allreduce_vs_reducescatter_allgather() -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(4 * world, dtype=torch.float64) * (rank + 1) + rank  # a different vector per rank
    reduced = x.clone()
    dist.all_reduce(reduced)
    shard = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter_tensor(shard, x)  # rank r gets the sum of everyone's r-th chunk
    gathered = torch.empty_like(x)
    dist.all_gather_into_tensor(gathered, shard)  # every rank gets every summed chunk
    return reduced, gathered


def test_all_reduce_equals_reduce_scatter_then_all_gather():
    results = run_on_ranks(allreduce_vs_reducescatter_allgather, 4)
    expected = sum(torch.arange(16, dtype=torch.float64) * (r + 1) + r for r in range(4))
    for reduced, gathered in results:
        assert torch.equal(reduced, expected)
        assert torch.equal(gathered, expected)
