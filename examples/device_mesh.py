"""DeviceMesh: the ranks arranged as a grid with named dims, and a process group per row and per column.

    torchrun --standalone --nproc-per-node 4 examples/device_mesh.py     (a 2 x 2 grid; 2 ranks give 1 x 2)

``init_device_mesh("cpu", (a, b), mesh_dim_names=("dp", "tp"))`` lays ranks 0 .. a*b-1 out row by row:
rank r sits at (r // b, r % b). ``mesh["tp"]`` is this rank's row (the ranks that share its dp coordinate)
and ``mesh["dp"]`` its column; each is a 1-D mesh backed by its own process group, so a collective on
``mesh["tp"].get_group()`` involves only this rank's row. ``python -m docs.figures mesh --dp-shard 2
--tp 2`` draws the same grid for meshloom's four dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def run() -> dict:
    world = dist.get_world_size()
    cols = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh("cpu", (world // cols, cols), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=mesh["tp"].get_group())  # sums over my row only
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=mesh["dp"].get_group())  # sums over my column only
    return {
        "grid": mesh.mesh.tolist(),  # rank numbers, row-major
        "coordinate (dp, tp)": mesh.get_coordinate(),
        "my tp group": dist.get_process_group_ranks(mesh["tp"].get_group()),
        "my dp group": dist.get_process_group_ranks(mesh["dp"].get_group()),
        "sum over tp": x.item(),
        "sum over dp": y.item(),
    }


if __name__ == "__main__":
    from _launch import main

    main(run)
