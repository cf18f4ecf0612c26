"""Device, backend and the default process group, chosen once per process.

cuda + nccl when a GPU is present (one GPU per local rank), otherwise cpu + gloo. A plain ``python
train.py`` (no torchrun) runs as a world of one so the code path is the same as under torchrun.
Every collective has a timeout (``parallel.collective_timeout_s``): gloo's default is 30 minutes, far too
long to notice that a peer died.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def select_device(requested: str = "auto") -> torch.device:
    """``auto``: this rank's GPU when CUDA is available, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from config import ConfigError

        raise ConfigError("training.device='cuda' but no CUDA device is visible; use training.device=auto or cpu.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device: torch.device, timeout_s: int) -> None:
    """Join (or, for a single process, create) the default process group for ``device``'s backend."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(group=None) -> None:
    dist.barrier(group=group)


def new_collective_group():
    """A second gloo group over the whole world, for collectives issued from another thread (async
    checkpoint saves): two threads must never run collectives on the same group."""
    return dist.new_group(backend="gloo")


def sum_over(tensor: torch.Tensor, mesh) -> torch.Tensor:
    """In-place sum of ``tensor`` over the ranks of ``mesh`` (a 1-D DeviceMesh)."""
    if mesh.size() > 1:
        dist.all_reduce(tensor, group=mesh.get_group())
    return tensor


def raise_if_any_rank_failed(
    error: BaseException | None, what: str, group=None, error_type: type[Exception] = RuntimeError
) -> None:
    """Every rank calls this after a step that may fail on some ranks only (e.g. rank 0 writing files).

    One all-reduce tells every rank whether any failed, so all raise together instead of the healthy ranks
    waiting in the next collective until the timeout.
    """
    failed = torch.tensor([0 if error is None else 1])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise error_type(f"another rank failed while {what}; its error message is the one to read.")
