"""Passes and progress: the banner says how many passes over the training stream a run makes and where it first
wraps, the log says when it does, ``training.epochs`` sets the steps, and each log line carries steps, tokens,
elapsed time and an ETA (a bar on a terminal, plain words in a log file)."""

from __future__ import annotations

import json

import pytest

from data.dataset import passes_done, passes_line
from launch.local_runs import DEBUG_CONFIG, run_train_cli
from training.metrics import Progress


def test_the_passes_line_and_the_wrap_step_follow_the_loader():
    # 3,872 tokens a pass (4,000 - seq_len 128), 1,024 a step: the last window of step 4 starts at 3,968 >= 3,872
    assert passes_line(4000, 128, 8, 8) == (
        "8 steps x 1,024 tokens = 2.12 passes over 3,872 training tokens; the stream first wraps at step 4"
    )
    assert [passes_done(k, 3872, 128, 8) for k in range(1, 9)] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert passes_line(20000, 128, 8, 3).endswith("0.15 passes over 19,872 training tokens; the stream never wraps")


def test_the_progress_line_is_plain_in_a_log_file_and_a_bar_on_a_terminal():
    plain = Progress(20, 0, 1024, tty=False)
    assert plain.line(5, now=plain.began + 30) == "5/20 steps | 5,120 tokens | elapsed 0:30 | ETA 1:30"
    resumed = Progress(20, 10, 1024, tty=True)  # 10 steps from a checkpoint: the pace is this run's own
    line = resumed.line(15, now=resumed.began + 3600 * 5)
    assert line == "[###############.....]  75% 15/20 steps | 15,360 tokens | elapsed 5:00:00 | ETA 5:00:00"


@pytest.fixture
def small_run(tmp_path):
    return ["--config", DEBUG_CONFIG, "--data.max_bytes", "4000", "--run.dir", str(tmp_path / "run")]


def test_epochs_set_the_steps_and_the_log_says_when_the_stream_wraps(small_run, tmp_path):
    proc = run_train_cli(1, *small_run, "--training.epochs", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(records) == 8  # ceil(2 x 3,872 / 1,024), over debug.toml's steps = 20
    out = proc.stdout
    assert "passes        8 steps x 1,024 tokens = 2.12 passes over 3,872 training tokens" in out
    assert "(training.epochs=2 set the steps)" in out
    assert "data: step 4 wrapped the training stream: pass 2 begins (the run makes 2.12)" in out
    assert "data: step 8 wrapped the training stream: pass 3 begins" in out
    assert "| 8/8 steps | 8,192 tokens | elapsed " in out and "[" not in out.split("step     8 |")[1]
