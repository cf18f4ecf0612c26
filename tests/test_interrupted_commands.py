"""Children end with their parent, and nothing half-written stays (issue 48): SIGTERM to ``python -m
data.prepare`` ends its worker processes and multiprocessing's resource tracker, and exits 128 + 15;
SIGTERM during ``python -m checkpoint.export`` removes its partial folder (an earlier export stays whole);
an export killed outright leaves folders the next export clears; ``--overwrite`` through a symlinked ``--out``
replaces what the link points to. Every command runs with a hard timeout; processes are found in /proc."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint import export
from launch.local_runs import ROOT
from tests.bpe import tiny_bpe

TIMEOUT = 120


def children(pid: int) -> dict[int, int]:
    """pid -> parent pid of every live process (zombies excluded), from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            table[int(entry.name)] = int(fields[1])
    return table


def descendants(pid: int) -> set[int]:
    table, found, frontier = children(pid), set(), {pid}
    while frontier:
        frontier = {p for p, parent in table.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    table = children(0)
    return {p for p in pids if p in table}


def wait_until(condition, proc, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"no {what} (exit {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.05)


def test_sigterm_to_prepare_ends_its_workers_and_the_resource_tracker(tmp_path):
    bpe = tiny_bpe(tmp_path / "bpe", n_files=10)
    source = tmp_path / "big.jsonl"
    text = (ROOT / "train.py").read_text()
    with source.open("w") as f:
        for i in range(4000):  # about 60 MB: far longer to tokenize than the test waits
            f.write(json.dumps({"text": f"# {i}\n" + text}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "data.prepare", "--source", str(source), "--tokenizer", str(bpe)]
        + ["--out", str(out), "--workers", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the two workers and the resource tracker, all started
        wait_until(lambda: len(descendants(proc.pid)) >= 3, proc, "worker processes")
        time.sleep(1.0)  # the workers at work
        spawned = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1] and "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 10  # the resource tracker leaves on its own once no process holds its pipe
    while alive(spawned) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(spawned), f"orphans left: {alive(spawned)}"
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == [], sorted(out.iterdir())


PAUSED_EXPORT = """
import os, runpy, sys, time
rename = os.rename
def paused(src, dst, *args, **kwargs):
    if ".partial-" in os.path.basename(str(src)):
        print("PAUSED before publishing the export", flush=True)
        time.sleep(600)
    return rename(src, dst, *args, **kwargs)
os.rename = paused
sys.argv = ["checkpoint.export", *sys.argv[1:]]
runpy.run_module("checkpoint.export", run_name="__main__")
"""


def test_sigterm_during_an_export_removes_its_partial_folder_and_keeps_the_earlier_export(one_process_saving, tmp_path):
    checkpoints, out = one_process_saving.checkpoints, tmp_path / "hf"
    assert export.main(["--checkpoint", str(checkpoints), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_EXPORT, "--checkpoint", str(checkpoints), "--out", str(out), "--overwrite"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: any(".partial-" in p.name for p in tmp_path.iterdir()), proc, "partial folder")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1] and "Traceback" not in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial or old folder beside it
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_the_next_export_clears_what_a_killed_export_left(one_process_saving, tmp_path, capsys):
    checkpoints, out = one_process_saving.checkpoints, tmp_path / "hf"
    pid = dead_pid()
    partial = tmp_path / f".hf.partial-{pid}"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".hf.partial-{os.getpid()}x"  # not its naming pattern: left alone
    live.mkdir()
    assert export.main(["--checkpoint", str(checkpoints), "--out", str(out)]) == 0
    assert not partial.exists() and live.is_dir()
    assert f"removed {partial}" in capsys.readouterr().err
    # Killed between setting the earlier export aside and publishing the new one: put back, never removed.
    aside = tmp_path / f".hf.old-{pid}"
    os.rename(out, aside)
    assert export.main(["--checkpoint", str(checkpoints), "--out", str(out)]) == 2  # it is an export again
    assert f"put back the earlier export {aside}" in capsys.readouterr().err
    assert (out / "config.json").is_file() and not aside.exists()


def test_an_overwrite_through_a_symlink_replaces_what_it_points_to(one_process_saving, tmp_path, capsys):
    checkpoints, real, link = one_process_saving.checkpoints, tmp_path / "real", tmp_path / "link"
    assert export.main(["--checkpoint", str(checkpoints), "--out", str(real), "--max-shard-size", "40KB"]) == 0
    link.symlink_to(real, target_is_directory=True)
    assert export.main(["--checkpoint", str(checkpoints), "--out", str(link), "--overwrite"]) == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no stray link or folder
    assert sorted(p.name for p in real.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
