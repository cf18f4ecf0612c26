"""``python -m bench.gpu_check``, the one command for a GPU machine, checked on a machine without one: it says
so and exits 0 with every check "not run"; and its machinery (a process per check, a hard limit per check that
kills the check's whole process group, a report of every outcome) works, run here on stand-in checks."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_check import CHECKS, TOTAL_S, Check, run_checks
from launch.local_runs import ROOT


def test_without_a_gpu_it_says_so_and_exits_0_with_nothing_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no GPU visible" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ran"] is False and report["gpu"] is None
    assert [(c["name"], c["status"]) for c in report["checks"]] == [(c.name, "not run") for c in CHECKS]
    assert "nothing was run or measured" in (tmp_path / "report.md").read_text()


def test_the_checks_fit_in_8_minutes():
    assert sum(c.budget_s for c in CHECKS) <= TOTAL_S == 8 * 60
    names = [c.name for c in CHECKS]
    for wanted in ("gpu-tests", "throughput-1b", "ring-attention-16k", "moe-experts", "async-save"):
        assert wanted in names


# ---- stand-in checks: run in a child process each, by name ----------------------------------------------------
def passes() -> dict:
    return {"summary": "measured 42", "value": 42}


def fails() -> dict:
    raise AssertionError("the figure is wrong")


def hangs() -> dict:
    """Starts a grandchild that sleeps (as a check's spawned ranks would), then hangs itself."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(os.environ["GPU_CHECK_TEST_PIDS"]).write_text(str(sleeper.pid))
    time.sleep(600)
    return {}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_each_check_runs_apart_with_a_hard_limit_and_every_outcome_is_reported(tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    monkeypatch.setenv("GPU_CHECK_TEST_PIDS", str(pids))
    checks = [
        Check("passes", passes, 60, "returns a figure"),
        Check("hangs", hangs, 5, "never returns"),
        Check("fails", fails, 60, "raises"),
    ]
    start = time.monotonic()
    report = run_checks(checks, tmp_path / "out", gpu="stand-in")
    status = {c["name"]: c for c in report["checks"]}
    assert status["passes"]["status"] == "passed" and status["passes"]["result"]["value"] == 42
    assert status["hangs"]["status"] == "timed out" and status["hangs"]["seconds"] < 15
    assert status["fails"]["status"] == "failed" and "the figure is wrong" in status["fails"]["error"]
    assert report["ok"] is False and time.monotonic() - start < 60
    sleeper = int(pids.read_text())
    deadline = time.monotonic() + 5
    while alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(sleeper)  # the hung check's own child went with it
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| passes: returns a figure | passed |" in text and "measured 42" in text
    assert "## hangs: timed out" in text and "## fails: failed" in text


def test_the_whole_run_stops_at_its_total_budget(tmp_path):
    checks = [Check("passes", passes, 60, "returns a figure"), Check("later", passes, 60, "no time left")]
    report = run_checks(checks, tmp_path, total_s=0.5, gpu="stand-in")
    assert [c["status"] for c in report["checks"]] == ["timed out", "timed out"]


def test_the_kernel_checks_run_at_a_small_size_on_the_cpu():
    # the code path of two GPU checks, at a size and on a device where they run here (no figure is kept)
    from bench.gpu_check import moe_experts, ring_attention_16k

    ring = ring_attention_16k(seq=256, device_name="cpu")
    assert ring["rows"][0]["n"] == 256 and ring["rows"][0]["ring_s"] > 0 and "256 tokens" in ring["summary"]
    moe = moe_experts(rows=512, dim=32, hidden=16, rounds=2, device_name="cpu")
    assert moe["rows"][0]["looped_rows_per_s"] > 0 and "512 rows" in moe["summary"]
