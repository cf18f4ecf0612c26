"""``python -m measure.gpu_check``, the one command for a GPU machine, checked on a machine without one: it says
so and exits 0 with every check "not run", run as a lent machine runs it (nothing installed, a clean
environment); and its machinery (a process per check, a hard limit per check that kills the check's whole
process group, each check's log and the report in the output folder as soon as they exist, a second call that
reruns some checks into the same report) works, run here on stand-in checks."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.local_runs import ROOT
from measure import gpu_check
from measure.gpu_check import CHECKS, TOTAL_S, Check, main, run_checks


@pytest.mark.compat
def test_without_a_gpu_it_says_so_and_exits_0_with_nothing_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "measure.gpu_check", "--out", str(tmp_path)],
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


@pytest.mark.compat
def test_a_lent_machine_runs_it_from_the_root_with_nothing_installed_and_a_clean_environment(tmp_path):
    # a lent machine: python3 from the repository root, meshloom not installed, no PYTHONPATH, no GPU here
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    outside = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('measure'))"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert outside.stdout.strip() == "None", "meshloom is installed: this test would not show it runs without"
    out = tmp_path / "out" / "gpu_check"
    proc = subprocess.run(
        [sys.executable, "-m", "measure.gpu_check", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no GPU visible" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert [c["status"] for c in report["checks"]] == ["not run"] * len(CHECKS)
    assert (out / "report.md").exists()


def test_at_module_level_it_imports_only_the_standard_library():
    # torch and pytest come inside the functions: the lent machine's versions (torch 2.11), nothing installed
    code = "import sys, measure.gpu_check; print(sorted({'torch', 'pytest'} & set(sys.modules)))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_out_is_required_unless_the_environment_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(gpu_check, "gpu_description", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "pass --out DIR" in capsys.readouterr().err
    monkeypatch.setenv("OUT", str(tmp_path))
    assert main([]) == 0
    assert json.loads((tmp_path / "gpu_check" / "report.json").read_text())["ran"] is False


def test_a_first_run_of_8_minutes_reports_the_tests_the_throughput_and_both_compiled_runs():
    names = [c.name for c in CHECKS]
    for wanted in ("gpu-tests", "throughput-1b", "compile-tp-free", "compile-1b", "ring-attention-16k", "moe-experts"):
        assert wanted in names
    assert "async-save" in names
    first = CHECKS[: names.index("compile-1b") + 1]  # run in order: these, whatever the later ones need
    assert [c.name for c in first] == ["gpu-tests", "throughput-1b", "compile-tp-free", "compile-1b"]
    assert sum(c.budget_s for c in first) <= TOTAL_S == 8 * 60
    # the rest fit in one rerun (--only) if the first run's checks used their whole budgets
    assert sum(c.budget_s for c in CHECKS[len(first) :]) <= TOTAL_S


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


def prints_then_hangs() -> dict:
    """Prints, copies the report as it stands while it runs (beside its log), then hangs."""
    print("printed before the hang")
    log = Path(os.environ["GPU_CHECK_LOG"])
    (log.parent / "report-seen-by-the-hung-check.json").write_text((log.parent / "report.json").read_text())
    time.sleep(600)
    return {}


def prints_then_fails() -> dict:
    print("printed before the failure")
    raise AssertionError("the figure is wrong")


def fixed_on_the_rerun() -> dict:
    print(f"fixed: {os.environ.get('GPU_CHECK_TEST_FIXED', 'no')}")
    assert os.environ.get("GPU_CHECK_TEST_FIXED") == "1", "not yet fixed"
    return {"summary": "fixed", "value": 7}


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


def test_each_check_logs_into_out_as_it_runs_and_the_report_is_there_before_the_end(tmp_path):
    out = tmp_path / "out"
    checks = [
        Check("passes", passes, 60, "returns a figure"),
        Check("hangs", prints_then_hangs, 8, "never returns"),
        Check("fails", prints_then_fails, 60, "raises"),
    ]
    report = run_checks(checks, out, gpu="stand-in")
    assert [c["status"] for c in report["checks"]] == ["passed", "timed out", "failed"]
    # while the second check hung, the report already held the first one's figures
    seen = json.loads((out / "report-seen-by-the-hung-check.json").read_text())
    assert [(c["name"], c["status"]) for c in seen["checks"]] == [
        ("passes", "passed"),
        ("hangs", "running"),
        ("fails", "pending"),
    ]
    assert seen["checks"][0]["result"]["value"] == 42
    # each check's output is in its own log, the killed one's included
    assert (out / "hangs.log").read_text().startswith("printed before the hang")
    assert "printed before the failure" in (out / "fails.log").read_text()
    assert (out / "passes.log").exists()
    assert {c["name"]: c["log_file"] for c in report["checks"]} == {n: f"{n}.log" for n in ("passes", "hangs", "fails")}
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report, default=str))
    assert "Its whole output: `hangs.log`" in (out / "report.md").read_text()


def test_a_second_call_with_only_reruns_those_checks_into_the_same_report(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    checks = [Check("passes", passes, 60, "returns a figure"), Check("flaky", fixed_on_the_rerun, 60, "fixed later")]
    monkeypatch.delenv("GPU_CHECK_TEST_FIXED", raising=False)
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    monkeypatch.setattr(gpu_check, "gpu_description", lambda: "stand-in")
    assert main(["--out", out]) == 1
    first = json.loads(Path(out, "report.json").read_text())
    assert [(c["name"], c["status"], c["run"]) for c in first["checks"]] == [
        ("passes", "passed", 1),
        ("flaky", "failed", 1),
    ]
    assert f"--out {out} --only flaky --budget SECONDS" in capsys.readouterr().out

    monkeypatch.setenv("GPU_CHECK_TEST_FIXED", "1")
    assert main(["--out", out, "--only", "flaky", "--budget", "60"]) == 0
    second = json.loads(Path(out, "report.json").read_text())
    assert second["checks"][0] == first["checks"][0]  # kept as the first call measured it
    assert second["checks"][1]["status"] == "passed" and second["checks"][1]["run"] == 2
    assert second["checks"][1]["result"]["value"] == 7 and second["ok"] is True
    assert [(r["run"], r["checks"], r["total_budget_s"]) for r in second["runs"]] == [
        (1, ["passes", "flaky"], TOTAL_S),
        (2, ["flaky"], 60),
    ]
    assert Path(out, "flaky.log").read_text().startswith("fixed: 1")
    text = Path(out, "report.md").read_text()
    assert "- run 1," in text and "- run 2," in text and "| flaky: fixed later | passed |" in text


def test_the_whole_run_stops_at_its_total_budget(tmp_path):
    checks = [Check("passes", passes, 60, "returns a figure"), Check("later", passes, 60, "no time left")]
    report = run_checks(checks, tmp_path, total_s=0.5, gpu="stand-in")
    assert [c["status"] for c in report["checks"]] == ["timed out", "timed out"]


@pytest.mark.compat
def test_the_kernel_checks_run_at_a_small_size_on_the_cpu():
    # the code path of two GPU checks, at a size and on a device where they run here (no figure is kept)
    from measure.gpu_check import moe_experts, ring_attention_16k

    ring = ring_attention_16k(seq=256, device_name="cpu")
    assert ring["rows"][0]["s_cp"] == 256 and ring["rows"][0]["ring_s"] > 0 and "256 tokens" in ring["summary"]
    moe = moe_experts(rows=512, dim=32, hidden=16, rounds=2, device_name="cpu")
    assert moe["rows"][0]["looped_rows_per_s"] > 0 and "512 rows" in moe["summary"]
    # each check asserts its numerics (gpu_check: RING_RTOL, GROUPED_RTOL) and reports them
    assert ring["rows"][0]["out_rel_diff"] <= 3e-2 and ring["rows"][0]["grad_rel_diff"] <= 3e-2
    assert moe["rows"][0]["forward_rel_diff"] <= 3e-2 and moe["rows"][0]["backward_rel_diff"] <= 3e-2


@pytest.mark.slow
def test_the_compile_checks_run_on_the_cpu():
    """The two compile checks' code paths on the CPU (fp32, inductor's C++ backend): their figures exist and their
    assertions hold (no recompile after the first step; the TP-free runs' loss within the check's tolerance, which
    fp32 meets by orders of magnitude)."""
    from measure.gpu_check import compile_1b, compile_tp_free
    from runtime.process import HostEvent

    tp_free = compile_tp_free(device_name="cpu", steps=4)
    assert set(tp_free["rows"]) == {"dense", "moe"} and "dense:" in tp_free["summary"]
    for row in tp_free["rows"].values():
        assert row["loss_rel_diff"] < 1e-5 and row["recompiles"] == 0 and row["speedup"] > 0
    one_b = compile_1b(smoke=True, event=HostEvent)
    assert one_b["runs"]["meshloom bf16, selective AC, compile"]["recompiles"] == 0
    assert "compiled, selective AC" in one_b["summary"]
