"""Run a function on N gloo ranks (CPU processes) and collect every rank's result or error.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes, joins them into one gloo process
group, calls ``fn(*args)`` on each and returns the list of per-rank return values. If any rank raises, the
test fails with that rank's traceback (the first failing rank's is the root cause; the others usually show
"Connection closed by peer"). If the ranks do not finish within ``timeout`` seconds, all are killed and
the test fails: a hang becomes a failure, never a stuck CI job.

Processes come from a *forkserver* that has already imported torch and meshloom, so a rank starts in a
fraction of a second instead of paying torch's ~2 s import each time. ``fn`` must be a module-level
function (it is pickled by name) and its result must be picklable by ``torch.save``.

Ranks run on the CPU unless the caller asks for GPUs (``gpus=True``, for tests marked ``gpu``): each rank
gets ``CUDA_VISIBLE_DEVICES=""`` before anything asks CUDA, so ``select_device("auto")`` picks the CPU even on
a GPU host. Without it the harness's LOCAL_RANK would send rank r to ``cuda:r`` (a one-GPU machine fails with
"invalid device ordinal"; a multi-GPU one runs the CPU parity tests on NCCL, against tolerances meant for CPU
fp32). The forkserver never touches CUDA (nothing meshloom imports asks it at import time), so the variable,
which CUDA reads once when it first starts in a process, still decides in every rank.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "train", "launch.spawn"]
_CONTEXT = None


def device_environment(gpus: bool) -> dict[str, str]:
    """The variable that decides which GPUs a rank or a launched command sees: none (the CPU) unless ``gpus``,
    then the ones this process sees."""
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {} if seen is None else {"CUDA_VISIBLE_DEVICES": seen}


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the forkserver and so by every rank
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _rank_main(
    fn, args, kwargs, rank: int, world_size: int, workdir: str, timeout: float, backend: str, devices: dict
) -> None:
    import datetime

    # First, before anything asks CUDA: the forkserver's environment is that of whichever test started it.
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update(devices)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    out = Path(workdir) / f"rank{rank}.pt"
    # A crash in native code (a segfault in a kernel or a backend thread) leaves no Python exception: have
    # faulthandler write every thread's Python stack to a file the parent reports with the exit code.
    faulthandler.enable(open(Path(workdir) / f"rank{rank}.fault", "w"), all_threads=True)  # noqa: SIM115
    try:
        store = dist.FileStore(str(Path(workdir) / "store"), world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        result = fn(*args, **kwargs)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
    finally:
        from runtime.process import destroy_process_group

        destroy_process_group()


class RankFailure(AssertionError):
    pass


def run_on_ranks(
    fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo", gpus: bool = False, **kwargs
) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    ``backend`` is the default group's backend string: ``"cuda:gloo"`` builds a group that, like NCCL, serves
    CUDA tensors only, so any collective on a CPU tensor on it fails (the NCCL stand-in of
    tests/test_nccl_standin.py). ``gpus``: let the ranks see this process's GPUs (module docstring).
    """
    import torch

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="meshloom-ranks-") as workdir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, args, kwargs, r, world_size, workdir, timeout, backend, device_environment(gpus)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world_size):
            path = Path(workdir) / f"rank{r}.pt"
            if path.exists():
                outcomes.append(torch.load(path, weights_only=False))
            else:
                code = procs[r].exitcode
                fault = Path(workdir) / f"rank{r}.fault"
                stacks = fault.read_text().strip() if fault.exists() else ""
                where = f"; faulthandler:\n{stacks}" if stacks else ""
                outcomes.append({"ok": False, "error": f"rank {r} produced no result (exit code {code}){where}"})
    errors = [(r, o["error"]) for r, o in enumerate(outcomes) if not o["ok"]]
    if hung or errors:
        lines = [f"{fn.__name__} on {world_size} ranks failed"]
        if hung:
            lines.append(f"ranks {hung} still running after {timeout:.0f} s (killed): a hang or a too-slow test")
        lines += [f"--- rank {r} ---\n{err}" for r, err in errors]
        raise RankFailure("\n".join(lines))
    return [o["result"] for o in outcomes]
