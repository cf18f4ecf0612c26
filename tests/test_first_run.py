"""README's first command leads somewhere: ``python train.py`` (the embedded default) ends with a saved checkpoint
and prints the command that samples from it and the one that exports it, and README shows the sampling line; a dry
run reads checkpoint.init_from as the run does and refuses a missing folder with its path."""

from __future__ import annotations

import shlex
import subprocess
import sys

from launch.local_runs import ROOT


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_default_run_saves_and_prints_the_commands_that_sample_and_export_it(tmp_path):
    done = run("train.py", "--training.steps", "2", "--run.dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if ":" in line}
    sample, export = shlex.split(lines["sample from it"]), shlex.split(lines["export it"])
    assert sample[:3] == ["python", "-m", "generate"] and export[:3] == ["python", "-m", "checkpoint.export"]
    sampled = run(*sample[1:-1], "5")  # the printed command, 5 new tokens instead of 100
    assert sampled.returncode == 0, sampled.stderr
    exported = run(*export[1:])
    assert exported.returncode == 0 and (tmp_path / "run" / "hf" / "config.json").is_file(), exported.stderr


def test_readme_follows_the_first_command_with_the_sampling_line():
    readme = (ROOT / "README.md").read_text()
    first = readme.index(".venv/bin/python train.py\n")
    assert (
        "python -m generate --checkpoint runs/default/checkpoints --prompt 'def ' --max-new-tokens 100"
        in (readme[first : first + 1500])
    )


def test_a_dry_run_refuses_a_missing_init_from_with_its_path(tmp_path):
    missing = tmp_path / "no-such-folder"
    done = run("train.py", "--dry-run", "--world-size", "1", "--checkpoint.init_from", str(missing))
    assert done.returncode == 2 and str(missing) in done.stderr, (done.stdout, done.stderr)
