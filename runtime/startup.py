"""A rank's start, before the mesh: watch the launcher, lock the run folders, arm the flight recorder, then the
process group.

``start_process`` does these in order, and hands every one of them to the caller's ``ExitStack`` so that each
is undone on every exit path:

1. Under torchrun, a thread watches the launcher and stops this worker if torchrun dies (runtime/signals.py).
2. The device is chosen once (cuda when present, else cpu; runtime/process.py).
3. The run folders are locked before any process group starts, so that a second run on them is refused in
   seconds; when every rank can look at the locks itself, every rank refuses at once (runtime/run_dir.py,
   step 2). Otherwise rank 0's verdict is shared on the control plane after the group starts (step 2c).
4. Torch's flight recorder is switched on before any group exists (torch reads its variables then); on CUDA
   its folder is made, since NCCL's watchdog dumps there on a timeout (runtime/failures.py).
5. The process group: the device plane's backend and the CPU control plane (runtime/process.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from runtime.config import ConfigError
from runtime.failures import disable_flight_recorder, enable_flight_recorder
from runtime.process import ControlPlane, init_process_group, select_device
from runtime.run_dir import RunLock, all_on_one_node, lock_run_folders
from runtime.signals import ParentWatch

if TYPE_CHECKING:
    import torch

    from runtime.schema import Config


def start_process(
    cfg: Config, folders: list[tuple[str, Path]], world_size: int, rank: int, stack: contextlib.ExitStack
) -> tuple[torch.device, ControlPlane]:
    """Steps 1-5 of the module docstring; returns the device and the control plane."""
    timeout_s = cfg.parallel.collective_timeout_s
    if "TORCHELASTIC_RUN_ID" in os.environ:  # 1. launched by torchrun: stop if torchrun dies
        stack.callback(ParentWatch(grace_s=timeout_s + 60).start().stop)
    device = select_device(cfg.training.device)  # 2.
    locks: list[RunLock] = []
    stack.callback(lambda: [lock.release() for lock in locks])
    every_rank_looks = not dist.is_initialized() and all_on_one_node(world_size)
    lock_error = lock_run_folders(folders, locks, rank, look=every_rank_looks)  # 3.
    if lock_error is not None and every_rank_looks:
        raise lock_error
    recorder, variables = enable_flight_recorder(cfg.run.dir)  # 4. before any group: torch reads them
    stack.callback(disable_flight_recorder, variables)
    if device.type == "cuda" and lock_error is None:  # NCCL's watchdog dumps there on a timeout
        recorder.mkdir(parents=True, exist_ok=True)
    control = init_process_group(device, timeout_s)  # 5.
    control.raise_if_any_failed(lock_error, "locking the run folders", ConfigError)
    return device, control
