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
   and on which group, this rank's last collective, and the fix. ``train.main`` prints it and exits with
   code 4.

Which collective: torch's flight recorder
-----------------------------------------
torch keeps a ring buffer of each process's recent collectives (the *flight recorder*): for each, the group,
its sequence number on that group, the operation, the tensor sizes, and whether it finished.

4. ``enable_flight_recorder`` sets its variables before the first process group exists (the user's own
   settings win; they are removed again when the run ends): a buffer of 2,000 entries, and, for NCCL, a dump on timeout into
   ``<run.dir>/flight_recorder/rank_<rank>``. On NCCL the watchdog thread notices the timeout, writes that
   file and ends the process (SIGABRT) itself, so steps 2-3 never run there: the dump is the explanation.

5. On gloo nothing dumps by itself: ``train.main``, on a communication failure, writes the buffer to the
   same file (mesh/private_api.py: ``flight_recorder_dump``), and ``last_collective`` names the newest
   unfinished entry (or, if all finished, the newest one) in the one-line report.
6. ``python -m torch.distributed.flight_recorder.fr_trace <run.dir>/flight_recorder`` (torch's analyser)
   reads every rank's file and names the first collective on which the ranks disagree: "Culprit rank 1;
   Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does not match found
   collective type: 'all_gather'". A rank that stalled wrote no file: add ``--allow-incomplete-ranks``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import time
from pathlib import Path

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


def is_communication_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost its peer (not a bug in the caller's arguments)."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(w in text for w in _TIMEOUT_WORDS + _BROKEN_WORDS)


FLIGHT_RECORDER_DIR = "flight_recorder"  # under run.dir: one file per rank, rank_<global rank>
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_folder(run_dir: str) -> Path:
    return Path(run_dir).resolve() / FLIGHT_RECORDER_DIR


def enable_flight_recorder(run_dir: str) -> tuple[Path, list[str]]:
    """Step 4: set the flight recorder's variables before the first process group; returns its folder and the names set
    (for ``disable_flight_recorder``). A value the user set, under the old or the new name, is kept."""
    folder = flight_recorder_folder(run_dir)
    wanted = {
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(FLIGHT_RECORDER_ENTRIES),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): str(folder / "rank_"),
    }
    added = []
    for names, value in wanted.items():
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = value
            added.append(names[0])
    return folder, added


def disable_flight_recorder(added: list[str]) -> None:
    """Remove the variables ``enable_flight_recorder`` set (the groups that read them are gone)."""
    for name in added:
        os.environ.pop(name, None)


def write_flight_recorder(dump: dict, run_dir: str, rank: int) -> Path:
    """Step 5: this rank's buffer (mesh/private_api.py: flight_recorder_dump) where NCCL would put it."""
    path = flight_recorder_folder(run_dir) / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(dump))
    return path


def last_collective(dump: dict) -> str | None:
    """Step 5: the newest collective this rank had not finished per ``pg_status`` (else its newest), as words."""
    entries = [e for e in dump.get("entries", []) if not e.get("is_p2p")]
    if not entries:
        return None
    status = dump.get("pg_status", {})

    def unfinished(entry: dict) -> bool:
        done = status.get(entry["process_group"][0], {}).get("last_completed_collective", -1)
        return entry["collective_seq_id"] > done

    pending = [e for e in entries if unfinished(e)]
    entry = (pending or entries)[-1]
    name, desc = entry["process_group"]
    ranks = dump.get("pg_config", {}).get(name, {}).get("ranks", "?")
    state = "not finished" if pending else "its newest, finished"
    return (
        f"{entry['profiling_name']} #{entry['collective_seq_id']} on group {name} ({desc}, ranks {ranks}), "
        f"sizes {entry['input_sizes']}, {state}"
    )


def explain(exc: BaseException, timeout_s: float, last: str | None = None, dumped: Path | None = None) -> str:
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
    collective = f" Its last collective: {last}." if last else ""
    analyse = (
        f" Every rank's recent collectives are in {dumped.parent}: python -m "
        f"torch.distributed.flight_recorder.fr_trace {dumped.parent} names where the ranks disagree."
        if dumped
        else ""
    )
    return (
        f"rank {rank}: {what} during {_PHASE['what']} (groups: {_PHASE['groups']}): {first[:200]}.{collective}"
        " Another rank stalled or died, or issued another collective: a rank that printed no such line stalled "
        "or died (torchrun names the first rank to report, usually a healthy one)."
        f"{analyse} Fix or restart it, then resume with --checkpoint.resume auto."
    )


def report_to_launcher(message: str) -> None:
    """Under torchrun, write ``message`` to the error file it reads, so its failure summary shows our one
    line (not "<N/A>" and a hint to enable tracebacks)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        entry = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        with open(path, "w") as f:
            json.dump({"message": entry}, f)


def say_last(message: str) -> None:
    """``message`` on stderr in one write, newline included: torchrun merges every rank's stderr into one stream,
    and ``print`` writes the text and its newline separately, so two ranks' lines could interleave mid-line."""
    sys.stderr.write(f"meshloom: {message}\n")
    sys.stderr.flush()


def fail(message: str, code: int) -> int:
    """``message`` last on the console and in torchrun's error file; returns the exit status ``code``."""
    # Printed by every rank: whichever rank's output the user reads ends with the fix.
    say_last(message)
    report_to_launcher(message)
    return code


def explain_failure(exc: BaseException, timeout_s: float, run_dir: str, dump) -> str:
    """The one-line report of a timed-out or broken collective, after writing this rank's flight recorder to run_dir
    (gloo: nothing else writes it)."""
    last, dumped = None, None
    try:
        buffer = dump()
        last = last_collective(buffer)
        dumped = write_flight_recorder(buffer, run_dir, dist.get_rank() if dist.is_initialized() else 0)
    except Exception as error:  # noqa: BLE001 - the report must come out even if the recorder cannot
        print(f"meshloom: could not write the flight recorder: {error}", file=sys.stderr, flush=True)
    return explain(exc, timeout_s, last, dumped)
