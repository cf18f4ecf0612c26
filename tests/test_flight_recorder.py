"""Hangs explained: on a collective timeout every rank writes its recent collectives to run.dir, its one-line
report names its last collective, and torch's analyser names the collective on which the ranks disagree.

Verified here on gloo. On NCCL, torch's watchdog writes the same files itself (the variables
``enable_flight_recorder`` sets) and ends the process: not verified here (no GPU); docs/troubleshooting.md
says what a user sees on each backend.
"""

import contextlib
import io
import os
import re
import subprocess
import sys

from launch.local_runs import DEBUG_CONFIG, ROOT
from launch.spawn import run_on_ranks
from runtime.failures import FLIGHT_RECORDER_DIR, disable_flight_recorder, enable_flight_recorder, last_collective

TIMEOUT_S = 5  # parallel.collective_timeout_s: how long the mismatched collective waits


def train_with_a_mismatched_collective(run_dir: str) -> dict:
    """Rank body: ``python train.py`` on fsdp2 where, at step 2, rank 1 gathers the loss sum that rank 0
    all-reduces (a bug of the kind that hangs a real job); returns the exit code and what was printed."""
    import torch
    import torch.distributed as dist

    import train
    import training.step

    calls = {"n": 0}
    sum_over = training.step.sum_over

    def mismatched_sum_over(tensor, mesh):
        calls["n"] += 1
        if calls["n"] == 2 and dist.get_rank() == 1:
            gathered = [torch.zeros_like(tensor) for _ in range(mesh.size())]
            dist.all_gather(gathered, tensor, group=mesh.get_group())
            return tensor
        return sum_over(tensor, mesh)

    training.step.sum_over = mismatched_sum_over
    argv = ["--config", DEBUG_CONFIG, "--parallel.dp_shard", "2", "--training.steps", "3", "--run.dir", run_dir]
    argv += ["--parallel.collective_timeout_s", str(TIMEOUT_S), "--run.tensorboard", "false"]
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        code = train.main(argv)
    return {"code": code, "stderr": printed.getvalue()}


def test_a_mismatched_collective_is_named_by_every_rank_and_by_the_analyser(tmp_path):
    run_dir = tmp_path / "run"
    results = run_on_ranks(train_with_a_mismatched_collective, 2, str(run_dir), timeout=120)
    assert [r["code"] for r in results] == [4, 4]  # a failed collective: exit code 4 on every rank
    for rank, (op, r) in enumerate(zip(("all_reduce", "all_gather"), results, strict=True)):
        # the first rank to time out ends and closes its sockets: its peer may see that before its own timeout
        line = re.search(
            rf"meshloom: rank {rank}: (a collective timed out|a peer closed its connection).*", r["stderr"]
        )
        assert line, r["stderr"]
        # the collective this rank was in: the loss sum of step 2 on the loss mesh (second on that group)
        assert re.search(rf"Its last collective: gloo:{op} #2 on group \S+ \(mesh_pp_dp_cp, ranks \[0, 1\]\)", line[0])
        assert "during step 2: loss sum and gradient norm" in line[0]
        assert f"flight_recorder.fr_trace {run_dir.resolve() / FLIGHT_RECORDER_DIR}" in line[0]
    folder = run_dir / FLIGHT_RECORDER_DIR
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1"]
    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = analysis.stdout + analysis.stderr
    assert analysis.returncode == 0, report
    # torch's analyser pairs the ranks' entries group by group and names the first disagreement
    assert re.search(
        r"Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does not "
        r"match found collective type: 'all_gather'",
        report,
    ), report
    assert "group info: " in report and "mesh_pp_dp_cp" in report


def test_the_flight_recorder_variables_keep_what_the_user_set_and_leave_with_the_run(tmp_path, monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/elsewhere/trace_")  # the user's own, older name
    folder, added = enable_flight_recorder(str(tmp_path / "run"))
    assert folder == (tmp_path / "run").resolve() / FLIGHT_RECORDER_DIR
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ  # torch falls back to the user's name
    disable_flight_recorder(added)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/elsewhere/trace_"  # the user's stays
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    _, added = enable_flight_recorder(str(tmp_path / "run"))
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(folder / "rank_")  # NCCL appends the rank
    disable_flight_recorder(added)


def test_the_last_collective_is_the_newest_unfinished_one():
    def entry(seq, group, op):
        return {
            "process_group": (group, f"mesh_{group}"),
            "collective_seq_id": seq,
            "profiling_name": op,
            "input_sizes": [[4]],
            "is_p2p": False,
        }

    dump = {
        "entries": [
            entry(1, "tp", "gloo:all_reduce"),
            entry(1, "dp", "gloo:broadcast"),
            entry(2, "tp", "gloo:all_gather"),
        ],
        "pg_status": {"tp": {"last_completed_collective": 1}, "dp": {"last_completed_collective": 1}},
        "pg_config": {"tp": {"ranks": "[0, 1]"}},
    }
    assert last_collective(dump) == (
        "gloo:all_gather #2 on group tp (mesh_tp, ranks [0, 1]), sizes [[4]], not finished"
    )
    dump["pg_status"]["tp"]["last_completed_collective"] = 2
    assert (
        last_collective(dump)
        == "gloo:all_gather #2 on group tp (mesh_tp, ranks [0, 1]), sizes [[4]], its newest, finished"
    )
    assert last_collective({"entries": []}) is None
