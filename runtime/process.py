"""Device, backend, process groups, and the rule for which group carries which message.

cuda + nccl when a GPU is present (one GPU per local rank), otherwise cpu + gloo. A plain ``python
train.py`` (no torchrun) runs as a world of one so the code path is the same as under torchrun.

Two planes, and the rule each follows
-------------------------------------
NCCL serves CUDA tensors only (``Backend.backend_capability["nccl"] == ["cuda"]``): a CPU tensor handed to an
NCCL group fails with "No backend type associated with device type cpu". gloo forgives that on CPU, so a
mistake here would pass every CPU test and die at step 0 on a GPU. meshloom therefore sorts every
collective into one of two planes:

1. **Device plane** (tensors on the device its group serves). The model's own traffic and the numbers
   derived from it: FSDP all-gather/reduce-scatter, TP/SP, pipeline send/recv, EP all-to-all, the gradient
   norm, the loss sum, the MoE expert load. Groups: the DeviceMesh's (NCCL on GPUs, gloo on CPU). Its
   collectives live in mesh/ (the small sums: mesh/reductions.py, whose ``sum_over`` checks the tensor's device).
2. **Control plane** (CPU objects on one dedicated gloo group). Small messages that steer the run: did any
   rank fail (``raise_if_any_failed``), stop on a signal (``gather_floats``, which also carries each rank's
   step compute time), barriers around run.dir and the
   checkpoint folder, the pipeline timeline gather, shared-filesystem markers, run ids. These must work on
   every backend, must never queue behind model traffic on a GPU stream, and some carry Python objects.
   ``ControlPlane`` owns the group; nothing else in meshloom calls a collective on the default group.
3. **Checkpoint group** (a second gloo group): DCP's own collectives (planning, metadata). An async save
   runs them from a background thread while the training thread uses the control plane, and two threads
   must never issue collectives on one group.

Every group gets ``parallel.collective_timeout_s``: the default group, the control and checkpoint groups,
and every DeviceMesh sub-group (mesh/dims.py: ``mesh_backend_options``). gloo's default is 30 minutes, far too long to
notice that a peer died.

Restarts: under ``torchrun --max-restarts N`` the restarted workers reuse the launcher's store, where the
previous attempt's keys (the dead workers' gloo addresses) are still written, so torch's ``init_process_group``
would try to connect to them and fail ("connectFullMesh ... Connection refused"; upstream
pytorch/pytorch#167288). meshloom's ``init_process_group`` therefore puts each restart attempt's keys under a
prefix of its own.

Timing: CUDA kernels run asynchronously, so a wall-clock reading means nothing until the device caught up.
``device_time`` synchronizes the device first; on CPU it is plain ``time.perf_counter``. The training step
times itself without waiting: ``clock_reading`` records a CUDA event in the stream (on CPU, ``perf_counter``),
and ``seconds_between`` reads two of them once the host waits anyway (a log step's read).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import time

import torch
import torch.distributed as dist


def select_device(requested: str = "auto") -> torch.device:
    """``auto``: this rank's GPU when CUDA is available, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from runtime.config import ConfigError

        raise ConfigError("training.device='cuda' but no CUDA device is visible; use training.device=auto or cpu.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # checked by check_launch_env
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def device_type_of(requested: str = "auto", cuda_available: bool | None = None) -> str:
    """The device type ``select_device`` will choose, decided without touching the device ("cuda" or "cpu")."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return "cuda" if requested == "cuda" or (requested == "auto" and cuda) else "cpu"


def choose_precision(requested: str, device_type: str, grad_compression: str = "none") -> str:
    """``training.mixed_precision`` as the run uses it: ``auto`` is bf16 on CUDA, fp32 on CPU and with PowerSGD or 1-bit
    Adam (no bf16 path)."""
    if requested != "auto":
        return requested
    replicated = grad_compression in ("powersgd", "onebit_adam")
    return "bf16" if device_type == "cuda" and not replicated else "fp32"


def enable_tf32(device: torch.device, precision: str) -> bool:
    """fp32 on CUDA: let fp32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa inputs, fp32
    accumulation), as torchtitan and most training code do; returns whether it did. Chosen by capability: the
    per-backend ``fp32_precision`` setting where torch has it, else the older ``allow_tf32`` flags."""
    if device.type != "cuda" or precision != "fp32":
        return False
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return True


def precision_banner(precision: str, tf32: bool) -> str:
    """The banner's words for the run's precision (train.py)."""
    if precision == "bf16":
        return "bf16 compute, fp32 master weights and reductions"
    return "fp32, TF32 matmuls" if tf32 else "fp32"


def memory_per_rank(requested: str = "auto") -> tuple[int, str] | None:
    """The bytes one rank may use and whose they are: its GPU's memory, or on CPU MemAvailable shared by the host's
    ranks; None where the machine does not say."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return None  # select_device refuses this with its own message
        props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        return props.total_memory, f"of the {props.name}'s memory"
    available = host_available_bytes()
    if available is None:
        return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = f", shared by {ranks} ranks on this host" if ranks > 1 else ""
    return available // ranks, f"of this host's available memory (MemAvailable{share})"


@functools.cache
def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def world_size_from_env() -> int:
    return check_launch_env()[1]


def rank_from_env() -> int:
    return check_launch_env()[0]


def check_launch_env(env=None, store: bool = False) -> tuple[int, int]:
    """(rank, world size) from the launcher's variables, checked before any store is opened (a bad RANK would hang in
    connect); none set is a world of one. MASTER_ADDR/PORT are required only with ``store``."""
    from runtime.config import ConfigError, parse_int

    env = os.environ if env is None else env
    fix = "launch with torchrun (which sets them), or unset them for one process"

    def number(name: str, low: int, high: int | None = None) -> int | None:
        if name not in env:
            return None
        value = parse_int(env[name])
        if value is None or value < low or (high is not None and value >= high):
            bound = f"an integer >= {low}" + (f" and < {high}" if high is not None else "")
            raise ConfigError(f"environment variable {name}={env[name]!r} must be {bound}; {fix}.")
        return value

    world = number("WORLD_SIZE", 1, 2**31)
    if world is None and "RANK" in env:
        raise ConfigError(f"environment variable RANK={env['RANK']!r} is set but WORLD_SIZE is not; {fix}.")
    if world is None:
        return 0, 1
    rank = number("RANK", 0)
    if rank is None:
        raise ConfigError(f"environment variable WORLD_SIZE={env['WORLD_SIZE']!r} is set but RANK is not; {fix}.")
    if rank >= world:
        raise ConfigError(
            f"environment variables RANK={rank} and WORLD_SIZE={world}: a rank must be below the world size "
            f"(0..{world - 1}); {fix}."
        )
    local_world = number("LOCAL_WORLD_SIZE", 1, world + 1)
    number("LOCAL_RANK", 0, local_world)
    if store or "MASTER_ADDR" in env or "MASTER_PORT" in env:
        if (store or "MASTER_ADDR" in env) and world > 1 and not env.get("MASTER_ADDR", "").strip():
            raise ConfigError(
                f"environment variable MASTER_ADDR is {'empty' if 'MASTER_ADDR' in env else 'unset'} "
                f"with WORLD_SIZE={world}: set it to rank 0's host name or address; {fix}."
            )
        if store and world > 1 and "MASTER_PORT" not in env:
            raise ConfigError(f"environment variable MASTER_PORT is unset with WORLD_SIZE={world}; {fix}.")
        number("MASTER_PORT", 1, 65536)
    return rank, world


def device_backend(device: torch.device) -> str:
    """The device plane's backend: NCCL for CUDA, gloo for CPU, or the default group's if it serves ``device``."""
    if dist.is_initialized():
        default = str(dist.get_backend())
        if default not in ("gloo", "nccl") and device.type in dist.Backend.backend_capability.get(default, []):
            return default
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTROL: ControlPlane | None = None


def init_process_group(device: torch.device, timeout_s: float) -> ControlPlane:
    """Join (or create) the default group, then the control plane; a harness's existing group is kept. No collective
    runs on the default group directly."""
    global _CONTROL
    if not dist.is_initialized():
        if "RANK" in os.environ:
            check_launch_env(store=True)  # every variable the store and the group read, before they read them
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if "RANK" not in os.environ:
            # plain `python train.py`: a world of one on a free port, given to torch directly; written into
            # os.environ it would outlive this run in the process (a test's later run, or a command it starts,
            # would inherit a port that is no longer ours)
            kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        timeout = datetime.timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # under torchrun: one store prefix per restart attempt
            rank, world = rank_from_env(), world_size_from_env()
            agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=not agent_hosts_store and rank == 0,
                timeout=timeout,
                multi_tenant=not agent_hosts_store,
            )
            attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
            kwargs.update(store=dist.PrefixStore(f"meshloom/attempt-{attempt}", store), rank=rank, world_size=world)
        dist.init_process_group(device_backend(device), timeout=timeout, **kwargs)
    if _CONTROL is None:
        _CONTROL = ControlPlane(timeout_s)
    return _CONTROL


def destroy_process_group() -> None:
    global _CONTROL
    _CONTROL = None
    if dist.is_initialized():
        dist.destroy_process_group()


def new_cpu_group(timeout_s: float, desc: str):
    """A gloo group over the whole world with our timeout (every rank must call it, in the same order);
    ``desc`` names it in the flight recorder's dumps (runtime/failures.py)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), group_desc=desc)


def all_gather_objects(obj, group) -> list:
    """Every rank's ``obj`` on every rank, over a CPU (gloo) ``group`` (the control or checkpoint group)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class ControlPlane:
    """Small CPU messages on one gloo group over the whole world (rule 2 of the module docstring)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.group = new_cpu_group(timeout_s, "meshloom_control_plane")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        return all_gather_objects(obj, self.group)

    def broadcast_object(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def max_int(self, value: int) -> int:
        """The largest ``value`` of any rank, on every rank."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (as many on every rank), in rank order, on every rank: one all-gather of a
        small CPU tensor and one read of it (the stop agreement and the ranks' step times share it)."""
        mine = torch.tensor(values, dtype=torch.float64)
        # dist.all_gather (a list of outputs) has one name in every supported torch; the single-tensor form
        # was renamed in 2.13 (mesh/private_api.py), and runtime/ sits below mesh/.
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows).tolist()

    def any_true(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        return bool(self.max_int(1 if flag else 0))

    def raise_if_any_failed(
        self, error: BaseException | None, what: str, error_type: type[Exception] = RuntimeError
    ) -> None:
        """Every rank calls this after work that may fail on some ranks only: they exchange errors and all raise the
        failing rank's (a ConfigError stays exit 2), instead of the others waiting out the timeout."""
        from runtime.config import ConfigError

        mine = None if error is None else (type(error).__name__, isinstance(error, ConfigError), str(error))
        everyone = self.all_gather_object(mine)
        if error is not None:
            raise error
        for rank, reported in enumerate(everyone):
            if reported is None:
                continue
            name, is_config_error, message = reported
            if is_config_error:
                raise ConfigError(f"{message} (reported by rank {rank})")
            raise error_type(f"rank {rank} failed while {what}: {name}: {message}")


# ---- timing ----------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    """Wait until ``device`` finished the work queued so far (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_reading(device: torch.device) -> float | torch.cuda.Event | HostEvent:
    """A point on the device's timeline without waiting for it: on CUDA an event recorded in the current stream,
    on CPU ``time.perf_counter()``. Two readings give seconds with ``seconds_between``."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


class HostEvent:
    """The CPU stand-in of ``torch.cuda.Event(enable_timing=True)``, with only the part of its API meshloom uses:
    ``record``, ``synchronize`` and ``elapsed_time`` (milliseconds). It has no arithmetic, as a CUDA event has
    none: code that times with ``clock_reading`` and runs on CPU with it runs on CUDA too (tests/test_throughput.py)."""

    def __init__(self, enable_timing: bool = True):
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.at is not None and end.at is not None, "elapsed_time() needs two recorded events"
        return (end.at - self.at) * 1000.0


def seconds_between(start: float | torch.cuda.Event | HostEvent, end: float | torch.cuda.Event | HostEvent) -> float:
    """Seconds from ``start`` to ``end`` (``clock_reading``s); on CUDA it waits until the device has passed
    ``end``: read it where the host waits for the device anyway."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def device_time(device: torch.device) -> float:
    """``time.perf_counter()`` once the device is idle: differences of two readings time real work."""
    synchronize(device)
    return time.perf_counter()
