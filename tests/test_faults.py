"""Faults an operator meets, each ending the way docs/troubleshooting.md promises.

- A stalled rank (SIGSTOP) makes every surviving rank print one line naming the operation and the groups it
  was waiting on, and exit, within the collective timeout (plus a second or two); the job then ends after
  torchrun's own grace: in torch 2.13 it waits a fixed 30 s for a failed job's other workers before it
  SIGKILLs them (``--shutdown-timeout`` only applies to a signalled launcher), and a stopped worker never
  exits on its own.
- SIGTERM to the launcher (preemption) mid-step or mid-save: the ranks finish the step, save it, say how to
  resume and exit with 128 + 15; resuming continues the uninterrupted run's loss curve exactly.
- A worker killed with SIGKILL under ``torchrun --max-restarts 1 ... --checkpoint.resume auto``: torchrun
  restarts the workers, they resume the newest checkpoint, and the run ends on the uninterrupted curve.
- The launcher killed with SIGKILL: its workers notice, save, and exit (no orphans).

Every test drives the real command line (torchrun over train.py) and has hard deadlines.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint.folder import published
from launch.local_runs import DEBUG_CONFIG, ROOT, TorchrunLaunch, read_metrics, run_train_cli
from tests.training_runs import assert_same_curve

TIMEOUT_S = 15  # parallel.collective_timeout_s in these tests
TORCHRUN_GRACE_S = 30  # torchrun 2.13 waits this long after a worker failed before it SIGKILLs the others
SLACK_S = 5  # noticing the failure, exiting, torchrun's 0.1 s monitor interval: measured ~1-3 s here


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def reference(shared_runs):
    """The uninterrupted 12-step run every interrupted one must end on (one process: fsdp2 matches it)."""
    return shared_runs.records({"training.steps": 12})


# ---- a stalled rank ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stalled_rank_ends_a_dp2_x_tp2_job_within_the_timeout(tmp_path):
    run = TorchrunLaunch(
        tmp_path,
        4,
        "--parallel.dp_shard",
        "2",
        "--parallel.tp",
        "2",
        "--training.steps",
        "500",
        "--parallel.collective_timeout_s",
        str(TIMEOUT_S),
        "--run.dir",
        str(tmp_path / "run"),
    )
    run.wait_for(r"step +3 \|")
    stalled, start = 3, time.monotonic()
    os.kill(run.workers()[stalled], signal.SIGSTOP)
    noticed = run.seconds_until(r"meshloom: rank \d: ", timeout=TIMEOUT_S + 60)
    code, _ = run.wait(timeout=TIMEOUT_S + TORCHRUN_GRACE_S + 60)
    ended = time.monotonic() - start
    assert noticed < TIMEOUT_S + SLACK_S, f"the first rank reported after {noticed:.0f} s"
    # what is left is torchrun's: its grace for the stopped worker, counted from the first worker's exit
    assert code != 0 and ended - noticed < TORCHRUN_GRACE_S + SLACK_S, f"noticed {noticed:.0f} s, ended {ended:.0f} s"
    text = run.text()
    for rank in (0, 1, 2):  # every surviving rank says what it was doing, on which groups
        line = re.search(
            rf"meshloom: rank {rank}: (a collective timed out|a peer closed).* during (.+?) \(groups: ", text
        )
        assert line, f"rank {rank} printed no failure line:\n{text[-4000:]}"
    assert f"meshloom: rank {stalled}:" not in text
    assert "timed out after parallel.collective_timeout_s=15 s" in text


@pytest.mark.slow
def test_a_rank_stalled_mid_save_ends_the_job_within_the_timeout(tmp_path):
    run = TorchrunLaunch(
        tmp_path,
        2,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        "50",
        "--checkpoint.interval",
        "2",
        "--parallel.collective_timeout_s",
        str(TIMEOUT_S),
        "--run.dir",
        str(tmp_path / "run"),
        env={"PAUSE_BEFORE_PUBLISH": "4:3"},
        script="tests/pause_before_publish.py",  # train.py, pausing rank 0 just before it publishes step 4
    )
    run.wait_for("pausing 3 s before publishing")  # rank 0 is inside the save of step 4
    start = time.monotonic()
    os.kill(run.workers()[1], signal.SIGSTOP)
    noticed = run.seconds_until(r"meshloom: rank 0: ", timeout=TIMEOUT_S + 60)
    code, _ = run.wait(timeout=TIMEOUT_S + TORCHRUN_GRACE_S + 60)
    ended = time.monotonic() - start
    pause = 3  # rank 0 waits for rank 1 only once its publishing pause is over
    assert noticed < pause + TIMEOUT_S + SLACK_S, f"rank 0 reported after {noticed:.0f} s"
    assert code != 0 and ended - noticed < TORCHRUN_GRACE_S + SLACK_S, f"noticed {noticed:.0f} s, ended {ended:.0f} s"
    assert re.search(r"meshloom: rank 0: a collective timed out after .* during saving step 4", run.text()), run.text()[
        -3000:
    ]
    # the step that was being saved was published before the stall hit the agreement; nothing half-written stays
    assert 4 in published(tmp_path / "run" / "checkpoints")


# ---- SIGTERM (preemption) -------------------------------------------------------------------------------------


def interrupted_then_resumed(
    tmp_path,
    reference,
    *,
    pause: str | None,
    wait_pattern: str,
    saving=("--checkpoint.interval", "4"),
    run_printed: bool = False,
) -> None:
    """SIGTERM to the launcher once ``wait_pattern`` shows, then resume: on one process (another layout), or,
    with ``run_printed``, by running the printed resume command as it is, in a shell (the run.dir then has a
    space in its name, and the first launch names an explicit ``--checkpoint.resume none``)."""
    run_dir = tmp_path / ("a run" if run_printed else "run")
    common = ["--parallel.dp_shard", "2", "--training.steps", "12", "--run.dir", str(run_dir)]
    first = ["--checkpoint.resume", "none"] if run_printed else []
    # with a pause: train.py through a wrapper that pauses rank 0 just before it publishes that step's checkpoint
    paused = {"env": {"PAUSE_BEFORE_PUBLISH": pause}, "script": "tests/pause_before_publish.py"} if pause else {}
    run = TorchrunLaunch(tmp_path, 2, *common, *saving, *first, **paused)
    run.wait_for(wait_pattern)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    code, _ = run.wait(timeout=60)
    elapsed = time.monotonic() - sent
    text = run.text()
    assert elapsed < 30, f"took {elapsed:.0f} s after SIGTERM"
    stopped = re.search(
        r"meshloom: stopped by SIGTERM after step (\d+); step \1 is saved in .*; resume with: .*"
        r"--checkpoint.resume auto",
        text,
    )
    assert stopped, text[-4000:]
    step = int(stopped.group(1))
    assert re.search(r"exitcode\s*:\s*143", text) or code != 0, text[-3000:]
    assert step in published(run_dir / "checkpoints") and step < 12
    # the workers print no traceback; torchrun prints one of its own (SignalException) as it exits
    assert text.count("Traceback") == text.count("SignalException: Process") <= 1, text[-4000:]
    if run_printed:
        # The printed line, pasted into a shell as it is: the launcher's own options, the quoted run.dir.
        printed = re.search(r"resume with: (.*)", text).group(1)
        assert "torch.distributed.run --standalone --nproc-per-node=2" in printed and "..." not in printed
        assert printed.endswith("--checkpoint.resume auto") and "--checkpoint.resume none" not in printed
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(printed, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed {run_dir / 'checkpoints' / f'step-{step}'} at step {step}" in proc.stdout
    else:
        # Resume on another layout (one process): the whole metrics.jsonl is the uninterrupted curve.
        proc = run_train_cli(
            1, "--config", DEBUG_CONFIG, *common[2:], "--checkpoint.interval", "4", "--checkpoint.resume", "auto"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_curve(read_metrics(run_dir), reference)


def test_sigterm_mid_run_saves_the_step_and_the_printed_command_resumes_the_curve(tmp_path, reference):
    interrupted_then_resumed(tmp_path, reference, pause=None, wait_pattern=r"step +5 \|", run_printed=True)


def test_the_resume_command_names_the_launcher_and_quotes_every_word():
    """The three sources of runtime/signals.py: resume_command (the CLI test above runs one printed line)."""
    import shlex

    from runtime.signals import resume_command

    argv = ["train.py", "--run.dir", "runs/a b", "--checkpoint.resume", "7", "--training.steps", "40"]
    expected_tail = "train.py --run.dir 'runs/a b' --training.steps 40 --checkpoint.resume auto"
    # torchrun's console script, read from the launcher's own command line (the worker's parent)
    launcher = ["/opt/py/bin/python", "/opt/py/bin/torchrun", "--nnodes", "1", "--nproc-per-node", "4", "--standalone"]
    torchrun_env = {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1"}
    line = resume_command(argv, torchrun_env, launcher_cmdline=launcher + argv)
    assert line == "/opt/py/bin/torchrun --nnodes 1 --nproc-per-node 4 --standalone " + expected_tail
    assert shlex.split(line)[-6:-4] == ["--run.dir", "runs/a b"]
    # where that command line is out of reach (or is not torchrun's): rebuilt from torchrun's variables
    multinode = {**torchrun_env, "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
    line = resume_command(argv, {**multinode, "TORCHELASTIC_MAX_RESTARTS": "3"}, launcher_cmdline=[])
    assert line == (
        "torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=abc "
        "--max-restarts=3 " + expected_tail
    )
    # no torchrun: this interpreter
    assert resume_command(["train.py", "--checkpoint.resume=none"], {}).endswith(" train.py --checkpoint.resume auto")


def test_sigterm_with_async_saves_every_step_publishes_that_step_once(tmp_path, reference):
    # the stop lands on a step whose async save is still in flight: it is published once, not saved again
    saving = ("--checkpoint.interval", "1", "--checkpoint.async", "true", "--checkpoint.keep_last", "2")
    interrupted_then_resumed(tmp_path, reference, pause=None, wait_pattern=r"step +5 \|", saving=saving)


@pytest.mark.slow
def test_sigterm_mid_save_finishes_that_save_and_stops(tmp_path, reference):
    interrupted_then_resumed(tmp_path, reference, pause="4:3", wait_pattern="pausing 3 s before publishing")


# ---- restarts and a dead launcher ----------------------------------------------------------------------------


def test_a_killed_worker_is_restarted_and_the_run_ends_on_the_uninterrupted_curve(tmp_path, reference):
    run_dir = tmp_path / "run"
    run = TorchrunLaunch(
        tmp_path,
        2,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        "12",
        "--checkpoint.interval",
        "3",
        "--checkpoint.resume",
        "auto",
        "--run.dir",
        str(run_dir),
        restarts=1,
    )
    run.wait_for(r"step +5 \|")
    os.kill(run.workers()[1], signal.SIGKILL)
    code, _ = run.wait(timeout=240)
    text = run.text()
    assert code == 0, text[-4000:]
    assert re.search(r"checkpoint: resumed .*step-\d+ at step \d+", text), "the restarted workers must resume"
    assert_same_curve(read_metrics(run_dir), reference)


def test_workers_whose_launcher_was_killed_save_and_exit(tmp_path):
    run_dir = tmp_path / "run"
    run = TorchrunLaunch(
        tmp_path,
        2,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        "2000",
        "--checkpoint.interval",
        "1000",
        "--run.dir",
        str(run_dir),
    )
    run.wait_for(r"step +3 \|")
    workers = run.workers()
    assert sorted(workers) == [0, 1]
    run.proc.kill()  # SIGKILL: torchrun forwards nothing
    run.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers.values()), "orphaned workers are still running"
    text = run.text()
    assert "the launcher (pid" in text and "is gone; stopping" in text, text[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+); step \1 is saved", text)
    assert stopped and int(stopped.group(1)) in published(run_dir / "checkpoints"), text[-3000:]


# ---- a full disk during a save --------------------------------------------------------------------------------


def train_with_a_full_disk_at(step: int, run_dir: str):
    """Rank body: rank 1's writes of checkpoint ``step`` fail with ENOSPC, as on a full disk."""
    import errno

    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from checkpoint.manager import CheckpointSaveError
    from launch.local_runs import run_training

    original = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if dist.get_rank() == 1 and str(self.path).endswith(f"step-{step}.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path) + "/__1_0.distcp")
        return original(self, plan, planner)

    FileSystemWriter.write_data = full_disk
    try:
        run_training({"parallel.dp_shard": 2, "checkpoint.interval": 2}, run_dir)
    except CheckpointSaveError as exc:
        return str(exc)
    return None


def test_a_full_disk_during_a_save_removes_the_partial_save_and_says_so(tmp_path):
    from launch.spawn import run_on_ranks

    messages = run_on_ranks(train_with_a_full_disk_at, 2, 4, str(tmp_path / "run"), timeout=180)
    for message in messages:  # every rank stops with the same one-line explanation
        assert message and message.startswith("saving step 4 to ") and "failed on rank 1: the disk is full" in message
        assert "removed the partial step-4.tmp" in message and "the newest good checkpoint is step-2" in message
    folder = tmp_path / "run" / "checkpoints"
    assert list(published(folder)) == [2] and not (folder / "step-4.tmp").exists()


# ---- the supervisor (multi-node restarts) -------------------------------------------------------------------


def supervise(tmp_path, *train_args: str, relaunches: int = 2) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "launch.supervise",
        "--max-relaunches",
        str(relaunches),
        "--wait",
        "1",
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "train.py",
        "--config",
        DEBUG_CONFIG,
        "--run.tensorboard",
        "false",
        *train_args,
    ]
    log = open(tmp_path / "supervise.log", "w")  # noqa: SIM115 - the test reads it back
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def test_the_supervisor_relaunches_a_failed_run_until_it_completes(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc = supervise(
        tmp_path,
        "--parallel.dp_shard",
        "2",
        "--training.steps",
        "12",
        "--checkpoint.interval",
        "3",
        "--checkpoint.resume",
        "auto",
        "--run.dir",
        str(run_dir),
    )
    log = tmp_path / "supervise.log"
    deadline = time.monotonic() + 180
    while not re.search(r"step +5 \|", log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    launcher = next(p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_child_torchrun(p, proc.pid))
    worker = next(p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == int(launcher.name))
    os.kill(int(worker.name), signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "meshloom supervise: failed (exit code 1); relaunch 1 of 2" in text
    assert re.search(r"checkpoint: resumed .*step-\d+ at step \d+", text)
    assert_same_curve(read_metrics(run_dir), reference)


def test_the_supervisor_does_not_relaunch_bad_input(tmp_path):
    proc = supervise(
        tmp_path, "--parallel.dp_shard", "3", "--checkpoint.resume", "auto", "--run.dir", str(tmp_path / "run")
    )
    assert proc.wait(timeout=120) == 2
    text = (tmp_path / "supervise.log").read_text()
    assert "meshloom supervise: bad input (exit code 2); a relaunch would not help" in text
    assert "relaunch 1" not in text
    missing_resume = subprocess.run(
        [sys.executable, "-m", "launch.supervise", "--", "python", "train.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing_resume.returncode == 2 and "--checkpoint.resume auto" in missing_resume.stderr


def _parent(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _is_child_torchrun(proc_dir: Path, supervisor: int) -> bool:
    try:
        return _parent(proc_dir) == supervisor and b"torch.distributed.run" in (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False


# ---- a checkpoint folder that became read-only (run as a user without root's override of permissions) -------


def test_a_checkpoint_folder_made_read_only_mid_run_fails_the_save_naming_the_permission(tmp_path):
    """The folder was writable at start; SIGTERM asks for a save after it became read-only. The save fails on
    creating step-N.tmp: exit 4 with "permission denied" and the fix for it, no advice to free space, and no
    claim about a partial step-N.tmp, which never existed."""
    from launch.local_runs import train_command, unprivileged

    prefix = unprivileged([])
    if prefix is None:
        pytest.skip("this process runs as root and cannot drop its override of file permissions (no setpriv)")
    folder = tmp_path / "ckpt"
    args = ["--config", DEBUG_CONFIG, "--run.tensorboard", "false", "--training.steps", "500"]
    args += ["--checkpoint.interval", "400", "--checkpoint.folder", str(folder), "--run.dir", str(tmp_path / "run")]
    log = tmp_path / "log.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, *train_command(1, *args)], cwd=ROOT, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + 180
            while not re.search(r"step +2 \|", log.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            folder.chmod(0o555)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            folder.chmod(0o755)
    text = log.read_text()
    assert code == 4, text[-3000:]
    line = next(line for line in text.splitlines() if line.startswith("meshloom: checkpoint save failed"))
    assert "failed on rank 0: permission denied" in line and "(EACCES)" in line, line
    assert "Make the folder writable for this user again" in line and "--checkpoint.resume auto" in line
    assert "Free space" not in line and "removed the partial" not in line and "could not remove" not in line
    assert "Traceback" not in text and not list(folder.glob("step-*"))


def sigterm_at_step_5(run_dir: str) -> tuple[str, list[int]]:
    """Rank body: SIGTERM to this process during step 5 of a run that agrees every 4 steps and logs only at the
    end; (the stop's message, the saved steps)."""
    import train
    from launch.local_runs import run_training
    from runtime.signals import StopRequested

    plain = train.train_step

    def signalled(s, step, *args, **kwargs):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return plain(s, step, *args, **kwargs)

    train.train_step = signalled
    overrides = {"training.steps": 20, "run.log_every": 100, "run.agree_every": 4, "checkpoint.interval": 100}
    try:
        run_training(overrides, run_dir)
    except StopRequested as exc:
        return str(exc), sorted(published(Path(run_dir) / "checkpoints"))
    raise AssertionError("the run did not stop")


def test_sigterm_between_agreements_stops_at_the_next_one_and_saves_it(tmp_path):
    # run.agree_every 4: the ranks agree after steps 4, 8, ... (and on log steps); a SIGTERM during step 5 stops
    # the run after step 8, within agree_every steps, and step 8 is saved
    from launch.spawn import run_on_ranks

    for message, saved in run_on_ranks(sigterm_at_step_5, 2, str(tmp_path), timeout=180):
        assert message.startswith("stopped by SIGTERM after step 8; step 8 is saved"), message
        assert saved == [8]
