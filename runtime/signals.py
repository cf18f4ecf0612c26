"""Stopping on a signal without losing the run: SIGTERM/SIGINT end the current step, save it, and exit.

Preemption (SLURM, Kubernetes, spot instances) arrives as SIGTERM, usually with tens of seconds to spare;
Ctrl-C arrives as SIGINT. torchrun forwards SIGTERM to its workers and kills them 30 s later. So:

1. ``StopSignals.install`` replaces the handlers of SIGTERM and SIGINT (main thread only); ``python
   train.py`` installs it before its slow imports, so a signal during start-up is recorded too (torchrun
   stops the other workers with SIGTERM when one fails its config check: they still exit with their own
   code 2). The first signal only records itself; a collective or a half-written checkpoint is never
   interrupted. A signal that comes again more than ``INSIST_AFTER_S`` later exits at once with 128 + signal
   (the user insists). A repeat within that window is the same request delivered twice: SLURM's
   ``--signal`` reaches every process of a job step, and torchrun then forwards its own copy to the workers
   milliseconds later; that must not cancel the save.
2. At the end of every step the ranks agree on the control plane (``agreed_stop``: one all-gather of the
   signal numbers, the highest wins), because the signal reaches ranks at slightly different moments and all
   of them must stop after the *same* step. Each rank's step compute time rides along in the same message
   (observers/rank_balance.py), so the spread across ranks costs no collective of its own. train.py then saves that step (when checkpointing is configured),
   prints the step and the resume command (``resume_command``, step 4), and exits with 128 + signal.
3. ``ParentWatch`` covers a launcher that died without forwarding anything (SIGKILL of torchrun, a lost
   SSH session): a daemon thread notices that this process was re-parented and sends itself SIGTERM, so
   step 2 runs; if the run cannot get there (its peers are gone too) it exits after ``grace_s``. The
   launcher is the parent recorded when this module is first imported (``PARENT_AT_IMPORT``: train.py
   imports it before anything slow), not when the watch starts seconds later, by which time a launcher
   killed during start-up is already gone and the recorded "parent" would be the process that adopted the
   orphan. A worker adopted by pid 1 before even that (``launcher_gone``) is told apart from one whose
   launcher *is* pid 1 (torchrun as a container's first process) by pid 1's command line. Before the
   training loop runs (``loop_started``) there is nothing to save: the worker exits at once, saying so,
   instead of waiting for a process group whose store died with the launcher.

4. ``resume_command`` writes the command that continues the run, so that it runs as printed when pasted
   into a shell: the launcher as it was started (under torchrun, the launcher's own command line, read from
   ``/proc/<parent>/cmdline``: a worker's parent is torchrun; where that cannot be read, rebuilt from what
   torchrun exports to every worker: ``--nproc-per-node`` from LOCAL_WORLD_SIZE, ``--nnodes`` from
   GROUP_WORLD_SIZE, and the rendezvous: ``--standalone`` on one node, else c10d at MASTER_ADDR:MASTER_PORT
   with the run id TORCHELASTIC_RUN_ID), then the script and its arguments with any ``--checkpoint.resume``
   replaced by ``auto`` (a step named at the start would go back: the run has moved on), every word
   shell-quoted (a run.dir with a space stays one argument).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """A signal stopped the run after a step (the step was saved when checkpointing is configured)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class Interrupted(BaseException):
    """SIGTERM or SIGINT in a command with nothing to finish (data.prepare, checkpoint.export): raised in the
    main thread, it unwinds through every ``finally`` (worker processes ended, partial output removed), and the
    command exits 128 + the signal. A BaseException, so that no ``except Exception`` takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts_raise():
    """While inside, SIGTERM and SIGINT raise ``Interrupted`` in the main thread; the handlers before are put back."""

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in HANDLED}
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def restart_attempt() -> int:
    """0 on a first launch; n on torchrun's n-th restart of the workers (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


INSIST_AFTER_S = 2.0  # a second signal sooner than this is a duplicate delivery, not the user insisting


class StopSignals:
    def __init__(self):
        self.received: int | None = None
        self.received_at = 0.0
        self.announce = False  # say so on the console (once the configuration was accepted)
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if self._previous:
            return self  # installed already
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread (e.g. not in a test thread)
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            if time.monotonic() - self.received_at < INSIST_AFTER_S:
                return  # the same request, delivered twice (module docstring, step 1)
            print(
                f"meshloom: second {signal.Signals(signum).name}: exiting now, without saving",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        self.received, self.received_at = signum, time.monotonic()
        if not self.announce:
            return
        rank = os.environ.get("RANK", "0")
        print(
            f"meshloom: rank {rank} got {signal.Signals(signum).name}: stopping after this step (again to "
            "exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def agreed_stop(self, control, rider: float = 0.0) -> tuple[int | None, list[float]]:
        """The signal every rank stops for (the highest any rank received), or None to go on; and every rank's
        ``rider``, in rank order (a number that travels with the agreement: the step's compute time)."""
        rows = control.gather_floats([float(self.received or 0), rider])
        return int(max(row[0] for row in rows)) or None, [row[1] for row in rows]


# This process's parent when this module was first imported (step 3): train.py imports it first of all.
PARENT_AT_IMPORT = os.getppid()


def _is_launcher(pid: int) -> bool:
    """Whether process ``pid`` is torchrun itself (``python .../torchrun`` or ``python -m torch.distributed.run``),
    not a process that merely started it (``tini -- torchrun ...``)."""
    try:
        words = [os.fsdecode(w) for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        return False
    if not words or not (Path(words[0]).name.startswith("python") or Path(words[0]).name == "torchrun"):
        return False
    return any(Path(w).name == "torchrun" or w == TORCHRUN_MODULE for w in words[:4])


def launcher_gone(recorded: int) -> bool:
    """Whether the launcher recorded as pid ``recorded`` is gone: this process was re-parented since, or was
    already adopted by pid 1 when it recorded (step 3)."""
    return os.getppid() != recorded or (recorded == 1 and not _is_launcher(1))


class ParentWatch:
    """Send this process SIGTERM when its launcher dies (module docstring, step 3); before ``loop_started``,
    exit at once."""

    def __init__(self, grace_s: float, poll_s: float = 1.0, parent: int | None = None):
        self.parent = PARENT_AT_IMPORT if parent is None else parent
        self.grace_s, self.poll_s = grace_s, poll_s
        self.running = False  # the training loop runs: a stop saves a step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshloom-parent-watch", daemon=True)

    def start(self) -> ParentWatch:
        global WATCH
        WATCH = self
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not launcher_gone(self.parent):  # checked at once: the launcher may be gone already
            if self._stop.wait(self.poll_s):
                return
        rank = os.environ.get("RANK", "0")
        if not self.running:
            sys.stderr.write(
                f"meshloom: rank {rank}: the launcher (pid {self.parent}) is gone during start-up; exiting (no step "
                "was trained since the start, so nothing is lost; resume with --checkpoint.resume auto)\n"
            )
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)
        print(f"meshloom: rank {rank}: the launcher (pid {self.parent}) is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while not self._stop.wait(self.poll_s):
            if time.monotonic() > deadline:
                os._exit(128 + signal.SIGTERM)


WATCH: ParentWatch | None = None


def loop_started() -> None:
    """The training loop runs: from now on a launcher's death stops the run after a step, which is saved."""
    if WATCH is not None:
        WATCH.running = True


# ---- the resume command (module docstring, step 4) ---------------------------------------------------------
TORCHRUN_MODULE = "torch.distributed.run"


def resume_command(argv: list[str] | None = None, environ=None, launcher_cmdline: list[str] | None = None) -> str:
    """The shell command that continues this run from its newest checkpoint (module docstring, step 4); ``environ`` and
    ``launcher_cmdline`` let a test play a torchrun worker."""
    argv = list(sys.argv if argv is None else argv)
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:  # a torchrun worker
        cmdline = _parent_cmdline() if launcher_cmdline is None else launcher_cmdline
        launcher = _launcher_from_cmdline(cmdline, argv) or _launcher_from_env(env)
    else:
        launcher = [_as_typed("python", sys.executable)]
    return shlex.join([*launcher, *with_resume_auto(argv)])


def with_resume_auto(argv: list[str]) -> list[str]:
    """``argv`` without any ``--checkpoint.resume X`` (or ``=X``), then ``--checkpoint.resume auto``."""
    kept, i = [], 0
    while i < len(argv):
        if argv[i] == "--checkpoint.resume":
            i += 2  # the option and its value
            continue
        if not argv[i].startswith("--checkpoint.resume="):
            kept.append(argv[i])
        i += 1
    return [*kept, "--checkpoint.resume", "auto"]


def _parent_cmdline() -> list[str]:
    """The parent process's argv (Linux), empty where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [os.fsdecode(word) for word in raw.split(b"\0")[:-1]]


def _launcher_from_cmdline(cmdline: list[str], argv: list[str]) -> list[str] | None:
    """torchrun and its options as the launcher was started, or None when ``cmdline`` is not a torchrun
    that ended with this worker's own ``argv`` (torchrun runs ``python -u SCRIPT ARGS`` as each worker)."""
    if not argv or len(cmdline) <= len(argv) or cmdline[-len(argv) :] != argv:
        return None
    head = cmdline[: len(cmdline) - len(argv)]
    for i, word in enumerate(head):
        if Path(word).name == "torchrun":  # the console script, run by the interpreter of its #! line
            return [_as_typed("torchrun", word), *head[i + 1 :]]
        if word == "-m" and head[i + 1 : i + 2] == [TORCHRUN_MODULE]:  # python -m torch.distributed.run
            return [_as_typed("python", head[0]), *head[1:]]
    return None


def _launcher_from_env(env) -> list[str]:
    """torchrun's options rebuilt from the variables it exports to every worker (when its command line is
    out of reach): processes per node, nodes, rendezvous and restarts."""
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    words = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={env.get('LOCAL_WORLD_SIZE', '1')}"]
    if nodes == 1:
        words.append("--standalone")
    else:
        endpoint = f"{env.get('MASTER_ADDR', 'HOST')}:{env.get('MASTER_PORT', 'PORT')}"
        words += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={env['TORCHELASTIC_RUN_ID']}"]
    if env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        words.append(f"--max-restarts={env['TORCHELASTIC_MAX_RESTARTS']}")
    return words


def _as_typed(name: str, path: str) -> str:
    """``name`` when the shell finds exactly ``path`` under that name (a venv's ``python``), else ``path``."""
    if os.sep not in path:
        return path  # already a bare name, found on PATH
    found = shutil.which(name)
    return name if found and Path(found).absolute() == Path(path).absolute() else path
