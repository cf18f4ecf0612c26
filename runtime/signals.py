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
2. At the end of every step the ranks agree on the control plane (``agreed_stop``: one all-reduce of the
   signal number, MAX), because the signal reaches ranks at slightly different moments and all of them
   must stop after the *same* step. train.py then saves that step (when checkpointing is configured),
   prints the step and the resume command, and exits with 128 + signal.
3. ``ParentWatch`` covers a launcher that died without forwarding anything (SIGKILL of torchrun, a lost
   SSH session): a daemon thread notices that this process was re-parented and sends itself SIGTERM, so
   step 2 runs; if the run cannot get there (its peers are gone too) it exits after ``grace_s``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

HANDLED = (signal.SIGTERM, signal.SIGINT)
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

    def agreed_stop(self, control) -> int | None:
        """The signal every rank stops for (the highest any rank received), or None to go on."""
        return control.max_int(self.received or 0) or None


class ParentWatch:
    """Send this process SIGTERM when its launcher dies (module docstring, step 3)."""

    def __init__(self, grace_s: float, poll_s: float = 1.0):
        self.parent = os.getppid()
        self.grace_s, self.poll_s = grace_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshloom-parent-watch", daemon=True)

    def start(self) -> ParentWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if os.getppid() != self.parent:
                print(
                    f"meshloom: rank {os.environ.get('RANK', '0')}: the launcher (pid {self.parent}) is gone; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + self.grace_s
                while not self._stop.wait(self.poll_s):
                    if time.monotonic() > deadline:
                        os._exit(128 + signal.SIGTERM)
                return
