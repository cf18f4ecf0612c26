"""A launcher killed at any moment, even during its workers' start-up, leaves no orphan (runtime/signals.py,
step 3): the workers notice within 30 s and exit saying so."""

import os
import time

from launch.local_runs import TorchrunLaunch
from runtime.signals import ParentWatch, launcher_gone


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_launcher_is_the_parent_at_import_and_pid_1_is_not_a_launcher():
    assert not launcher_gone(os.getppid())
    assert launcher_gone(os.getppid() + 100000)  # re-parented since it was recorded
    assert launcher_gone(1) == (os.getppid() != 1 or "torchrun" not in open("/proc/1/cmdline").read())
    assert ParentWatch(grace_s=1).parent != os.getpid()


def test_workers_whose_launcher_is_killed_1_s_after_spawn_exit_within_30_s(tmp_path):
    run = TorchrunLaunch(
        tmp_path, 2, "--parallel.dp_shard", "2", "--training.steps", "2000", "--run.dir", str(tmp_path)
    )
    deadline = time.monotonic() + 120
    while len(workers := run.workers()) < 2:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.text()[-3000:]
        time.sleep(0.05)
    time.sleep(1.0)
    run.proc.kill()  # SIGKILL: torchrun forwards nothing, and its store goes with it
    run.wait(timeout=30)
    killed = time.monotonic()
    while any(alive(pid) for pid in workers.values()) and time.monotonic() - killed < 60:
        time.sleep(0.2)
    seconds = time.monotonic() - killed
    orphans = [pid for pid in workers.values() if alive(pid)]
    for pid in orphans:
        os.kill(pid, 9)
    assert not orphans, f"orphaned workers still running {seconds:.0f} s after the launcher died"
    assert seconds < 30, seconds
    text = run.text()
    assert text.count("is gone during start-up; exiting") == 2 or "is gone; stopping" in text, text[-3000:]
