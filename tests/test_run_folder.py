"""The run folder stays the run's (runtime/run_dir.py, step 3): removed or replaced under a live run, the run
stops with exit 4 and writes nothing more; a checkpoint folder equal to run.dir is one lock."""

import contextlib
import io
import shutil
import subprocess
import sys
import time

import pytest

from launch.local_runs import DEBUG_CONFIG, ROOT
from runtime.run_dir import HELD, RunLock, folder_lost


@pytest.fixture(autouse=True)
def launch_env_restored(monkeypatch):
    """An in-process run sets RANK, MASTER_PORT, ... for its world of one (runtime/process.py); put them back,
    so that a later command does not inherit this run's port."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_the_lock_notices_its_folder_removed_or_replaced(tmp_path):
    folder = tmp_path / "run"
    lock = RunLock(folder).acquire()
    try:
        assert lock in HELD and folder_lost() is None
        shutil.rmtree(folder)
        assert "was removed" in str(folder_lost())
        folder.mkdir()  # another folder under the same name
        assert "was replaced by another folder" in str(folder_lost())
    finally:
        lock.release()
    assert lock not in HELD


@pytest.mark.parametrize(
    "record",
    [b"[" * 2000 + b"]" * 2000, b"[1, 2]", b'{"pid": 1, "host": "\xff"}', b"{not json"],
    ids=["deep", "a-list", "not-utf8", "torn"],
)
def test_a_lock_file_left_unreadable_is_taken_over_without_a_traceback(record, tmp_path):
    """The lock file's record is read through runtime/files.py's JSON reader: nested past Python's recursion
    limit (a RecursionError before), not an object, not UTF-8 or torn, it names no holder and the lock is taken."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".meshloom.lock").write_bytes(record)
    lock = RunLock(folder).acquire()
    try:
        assert lock.took_over is None
    finally:
        lock.release()


def test_a_checkpoint_folder_equal_to_run_dir_is_one_lock(tmp_path):
    import train

    run = tmp_path / "run"
    args = ["--config", DEBUG_CONFIG, "--run.dir", str(run), "--checkpoint.folder", str(run)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main([*args, "--training.steps", "2", "--checkpoint.interval", "2", "--run.tensorboard", "false"])
    assert code == 0, err.getvalue()[-2000:]
    assert (run / "step-2").is_dir() and (run / "metrics.jsonl").is_file()


def test_deleting_run_dir_mid_run_stops_it_with_exit_4_and_nothing_recreated(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", DEBUG_CONFIG, "--run.dir", str(run), "--run.tensorboard", "false"]
    cmd += ["--training.steps", "2000", "--checkpoint.interval", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step-2").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        shutil.rmtree(run)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "was removed while the run was alive" in err.strip().splitlines()[-1]
    assert not run.exists(), sorted(str(p) for p in run.rglob("*"))  # nothing re-created, nothing written


@pytest.mark.parametrize("spelling", ["dotdot", "symlink"])
def test_a_checkpoint_folder_naming_run_dir_by_another_spelling_is_one_lock(spelling, tmp_path):
    """``checkpoint.folder`` written ``run/sub/..`` or as a symlink to run.dir is run.dir: folders are compared by
    their real path and locked once. Before, the second flock on the same lock file refused the run as "in use
    by another live run", naming the run's own pid."""
    import train

    run = tmp_path / "run"
    run.mkdir()
    if spelling == "dotdot":
        (run / "sub").mkdir()
        folder = run / "sub" / ".."
    else:
        folder = tmp_path / "link"
        folder.symlink_to(run, target_is_directory=True)
    args = ["--config", DEBUG_CONFIG, "--run.dir", str(run), "--checkpoint.folder", str(folder)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main([*args, "--training.steps", "2", "--checkpoint.interval", "2", "--run.tensorboard", "false"])
    assert code == 0, err.getvalue()[-2000:]
    assert "in use" not in err.getvalue()
    assert (run / "step-2").is_dir() and (run / "metrics.jsonl").is_file()


def test_a_second_run_on_a_live_folder_is_told_it_is_in_use_not_to_remove_its_checkpoints(tmp_path):
    """A second run on the run.dir of a live run that has saved: the checks that look inside the folder (newer
    checkpoints, an earlier metrics.jsonl) would tell it to remove the live run's checkpoints or to overwrite
    its metrics. It is refused first as in use, with exit 2, naming the live run's pid, whatever it asks."""
    run = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", DEBUG_CONFIG, "--run.dir", str(run), "--run.tensorboard", "false"]
    first = subprocess.Popen(
        [*cmd, "--training.steps", "2000", "--checkpoint.interval", "2"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step-2").is_dir():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        for extra in (["--checkpoint.resume", "none"], ["--checkpoint.resume", "auto"], ["--run.overwrite", "true"]):
            second = subprocess.run(
                [*cmd, "--training.steps", "4", "--checkpoint.interval", "2", *extra],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            last = second.stderr.strip().splitlines()[-1]
            assert second.returncode == 2, second.stderr[-3000:]
            assert f"is in use by another live run (pid {first.pid} " in last, (extra, last)
            assert "remove" not in last and "Traceback" not in second.stderr
        assert first.poll() is None, "the live run goes on"
    finally:
        first.kill()
        first.communicate(timeout=60)
