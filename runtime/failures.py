"""When a collective fails: say which operation was waiting, on which group, and what to do, in one line.

A rank that stalls (a hung data loader, a stopped process, a GPU fault) or dies leaves its peers waiting in
the next collective. Every group meshloom creates carries ``parallel.collective_timeout_s``
(runtime/process.py), so the wait ends with an exception after that long; a peer that *died* closes its
sockets, which its peers see at once. Either way the exception text is backend noise ("Timed out waiting
20000ms for recv operation to complete", "Connection closed by peer"), and torchrun's summary names the
first rank that *reported* a failure: a healthy one.

1. ``phase(what, groups)`` records what this rank is doing and which groups that involves ("step 5:
   forward and backward" on the device plane of dims dp_shard, tp; "saving step-4" on the checkpoint
   group). It costs an assignment, so it wraps whole phases, not single collectives.
2. ``is_communication_failure`` recognises a timed-out or broken collective among the exceptions that
   reach ``train.main``.
3. ``explain`` turns it into one line: rank, what timed out (or broke), after how long, during which phase
   and on which group, and the fix. ``train.main`` prints it and exits with code 4.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch.distributed as dist

_PHASE = {"what": "starting up", "groups": "the default group", "since": time.monotonic()}

# Phrases of the messages gloo, NCCL and the c10d stores raise when a peer stalls or dies (specific enough
# not to match an unrelated RuntimeError such as CUDA's "launch timed out").
_TIMEOUT_WORDS = ("timed out waiting", "collective operation timeout", "wait timeout", "socket timeout")
_BROKEN_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connectfullmesh failed",
    "nccl communicator was aborted",
)


def set_phase(what: str, groups: str) -> None:
    _PHASE.update(what=what, groups=groups, since=time.monotonic())


@contextlib.contextmanager
def phase(what: str, groups: str):
    """Record ``what`` this rank is doing, and on which ``groups``, while the block runs."""
    before = dict(_PHASE)
    set_phase(what, groups)
    yield  # on an exception the phase stays set: ``explain`` reports where it happened
    _PHASE.update(before)


def current_phase() -> dict:
    return dict(_PHASE)


def is_communication_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (not a bug in the caller's arguments)."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(w in text for w in _TIMEOUT_WORDS + _BROKEN_WORDS)


def explain(exc: BaseException, timeout_s: float) -> str:
    """One line for the console: which operation, which group, how long, and the fix."""
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    timed_out = any(w in text.lower() for w in _TIMEOUT_WORDS) or "timeout" in type(exc).__name__.lower()
    rank = dist.get_rank() if dist.is_initialized() else "?"
    waited = time.monotonic() - _PHASE["since"]
    what = (
        f"a collective timed out after parallel.collective_timeout_s={timeout_s:g} s"
        if timed_out
        else f"a peer closed its connection after {waited:.0f} s"
    )
    return (
        f"rank {rank}: {what} during {_PHASE['what']} (groups: {_PHASE['groups']}): {first[:200]}. "
        "Another rank stalled or died: it is the one that printed no such line (torchrun names the first "
        "rank to report, usually a healthy one). Fix or restart it, then resume with --checkpoint.resume auto."
    )


def report_to_launcher(message: str) -> None:
    """Under torchrun, write ``message`` to the error file it reads, so its failure summary shows our one
    line (not "<N/A>" and a hint to enable tracebacks)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        entry = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        with open(path, "w") as f:
            json.dump({"message": entry}, f)
