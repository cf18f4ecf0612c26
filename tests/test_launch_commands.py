"""Every launch command the README and launch/ give is checked by the dry run at the world size it names.

``python train.py --dry-run --world-size N ARGS`` (planning/dry_run.py) resolves the config and the layout for N
ranks without a process group or any file access. Each ``torchrun ... train.py ARGS`` (and ``python
train.py ARGS``) command in README.md's shell blocks and in launch/'s shell scripts is read with a shell's
quoting rules, its world size taken from torchrun's ``--nnodes`` x ``--nproc-per-node`` (SLURM's variables
from the script's own ``#SBATCH`` lines), and its ARGS run through the dry run: each must exit 0.
"""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from launch.local_runs import DEBUG_CONFIG, ROOT
from train import main

SEPARATORS = {";", "&&", "||", "|", "&"}
# SLURM's variables a launch script may hand torchrun, and the #SBATCH option each comes from
SLURM_VARIABLES = {"SLURM_NNODES": "nodes", "SLURM_GPUS_PER_NODE": "gpus-per-node"}


def without_comments(script: str) -> str:
    """``script`` with its ``#`` comments removed and each line ended by ``;`` (quotes respected)."""
    out, quote, i = [], None, 0
    script = script.replace("\\\n", " ")  # continuation lines
    while i < len(script):
        ch = script[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or script[i - 1].isspace()):
            while i < len(script) and script[i] != "\n":
                i += 1
            continue
        elif ch == "\n":
            ch = " ; "
        out.append(ch)
        i += 1
    return "".join(out)


def shell_commands(script: str) -> list[list[str]]:
    """The commands of a shell ``script``, each as the words a shell would pass (no expansion)."""
    lexer = shlex.shlex(without_comments(script), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def option(words: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in ``words`` (``--name value`` or ``--name=value``)."""
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def train_commands(script: str, variables: dict[str, str]) -> list[tuple[int, list[str]]]:
    """(world size, train.py's arguments) of every command of ``script`` that runs train.py."""
    found = []
    for words in shell_commands(script):
        words = [re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]), w) for w in words]
        if "train.py" not in words:
            continue
        at = words.index("train.py")
        launcher, args = words[:at], words[at + 1 :]
        world = 1
        if "torchrun" in launcher:
            nnodes = option(launcher, "--nnodes") or "1"
            nproc = option(launcher, "--nproc-per-node", "--nproc_per_node") or "1"
            world = int(nnodes) * int(nproc)
        found.append((world, args))
    return found


def launch_commands() -> dict[str, tuple[int, list[str]]]:
    """Every train.py command of README.md (its bash blocks) and launch/ (its shell scripts), by place."""
    commands = {}
    readme = (ROOT / "README.md").read_text()
    for n, block in enumerate(re.findall(r"```bash\n(.*?)```", readme, re.S)):
        for k, command in enumerate(train_commands(block, {})):
            commands[f"README.md block {n + 1} command {k + 1}"] = command
    for script in sorted([*(ROOT / "launch").glob("*.sbatch"), *(ROOT / "launch").glob("*.sh")]):
        text = script.read_text()
        sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
        variables = {var: sbatch[opt] for var, opt in SLURM_VARIABLES.items() if opt in sbatch}
        for k, command in enumerate(train_commands(text, variables)):
            commands[f"launch/{script.name} command {k + 1}"] = command
    return commands


COMMANDS = launch_commands()


def folder_writers() -> dict[str, str]:
    """README's ``python -c`` commands that write a transformers folder (``save_pretrained("P")``), by P: a later
    command's ``--checkpoint.init_from P`` takes its model from that folder."""
    readme = (ROOT / "README.md").read_text()
    writers = {}
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for words in shell_commands(block):
            code = words[-1] if words[:2] == ["python", "-c"] or words[-2:-1] == ["-c"] else ""
            for folder in re.findall(r'save_pretrained\("([^"]+)"\)', code):
                writers[folder] = code
    return writers


def exported_folders() -> dict[str, list[str]]:
    """README's ``python -m checkpoint.export --checkpoint C --out P`` commands, by P: the arguments of the README
    run that saved C (its ``--run.dir`` holds C), whose model the exported folder is."""
    readme = (ROOT / "README.md").read_text()
    commands = [words for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for words in shell_commands(block)]
    runs = {option(w, "--run.dir"): w[w.index("train.py") + 1 :] for w in commands if "train.py" in w}
    exports = {}
    for words in commands:
        if words[:3] == ["python", "-m", "checkpoint.export"]:
            run_dir = str(Path(option(words, "--checkpoint")).parent)
            if run_dir in runs:
                exports[option(words, "--out")] = runs[run_dir]
    return exports


def shell_variable(name: str) -> str:
    """The value README's ``NAME=$(command)`` gives ``name``: the command run as pasted, its printed last line."""
    found = re.search(rf"^{name}=\$\((.+?)\)", (ROOT / "README.md").read_text(), re.M)
    assert found, f"README uses ${name} without setting it"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    words = shlex.split(found.group(1))
    words = [sys.executable, *words[1:]] if words[0] == "python" else words  # this venv's python
    done = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def written_folder(args: list[str], tmp_path) -> list[str]:
    """``args`` with an ``init_from`` folder that README writes first (and that does not exist yet) made under
    ``tmp_path``: by README's own ``python -c`` command, run as pasted, or, for a folder README's export writes, by
    the export's writer (checkpoint/hf.py: ``export_safetensors``) from the model of the run it exports (its weights
    do not matter to a dry run, its config.json does)."""
    folder = option(args, "--checkpoint.init_from")
    if folder is not None and folder.startswith("$"):  # a shell variable README sets from a command: run it
        made = shell_variable(folder[1:])
        return [made if a == folder else a.replace(folder, made) for a in args]
    if folder is None or (ROOT / folder).exists():
        return args
    code = folder_writers().get(folder)
    if code is not None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=300)
    elif folder in exported_folders():
        from checkpoint.hf import export_safetensors
        from models.llama import Transformer
        from runtime.config import load_config, model_args

        model = Transformer(model_args(load_config(exported_folders()[folder])))
        export_safetensors(model.state_dict(), model.args, tmp_path / folder)
    else:
        return args
    return [str(tmp_path / folder) if a == folder else a for a in args]


def dry_run(world: int, args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--dry-run", "--world-size", str(world), *args])
    return code, out.getvalue() + err.getvalue()


def test_the_commands_are_found():
    worlds = {place: world for place, (world, _) in COMMANDS.items()}
    assert len([p for p in worlds if p.startswith("README")]) >= 10  # every layout example, resume, real data
    assert worlds["launch/slurm.sbatch command 1"] == 16  # 2 nodes x 8 GPUs, from its #SBATCH lines
    assert 16 in {w for p, w in worlds.items() if p.startswith("README")}  # the multi-node example


@pytest.mark.parametrize("place", COMMANDS)
def test_every_launch_command_passes_the_dry_run(place, monkeypatch, tmp_path):
    world, args = COMMANDS[place]
    monkeypatch.chdir(ROOT)  # the commands name configs/ relative to the repository root
    code, printed = dry_run(world, written_folder(args, tmp_path))
    assert code == 0, f"{place}: {' '.join(args)}\n{printed}"
    assert f"meshloom dry run | world {world} |" in printed
    assert not dist.is_initialized()  # no process group


def test_the_dry_run_touches_no_file_and_says_what_it_did_not_check(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    run_dir, folder = tmp_path / "run", tmp_path / "ckpt"
    args = ["--config", DEBUG_CONFIG, "--parallel.pp", "2", "--parallel.tp", "2", "--parallel.dp_shard", "-1"]
    args += ["--data.source", str(tmp_path / "missing"), "--run.dir", str(run_dir)]
    args += ["--checkpoint.folder", str(folder), "--checkpoint.interval", "5", "--checkpoint.resume", "auto"]
    code, printed = dry_run(8, args)
    assert code == 0, printed
    assert list(tmp_path.iterdir()) == []  # no run.dir, no checkpoint folder, nothing else
    for line in (
        "  pp            size   2",
        "  dp_replicate  size   1",
        "  dp_shard      size   2",
        "  cp            size   1",
        "  tp            size   2",
        "  parameters    853,120 total",
        # each pp rank's stages, then what one of its ranks holds (planning/memory_estimate.py: rank_parameters)
        "  pp rank 0     stages [0] (layers [0, 1]): 426,496 parameters, 106,752 on each of its ranks",
        "  pp rank 1     stages [1] (layers [2, 3]): 426,624 parameters, 106,816 on each of its ranks",
        "  batch         global 8 = micro 4 x dp 2 x accumulation 1",
        f"    data        source '{tmp_path / 'missing'}'",
        f"    checkpoint  folder '{folder}', resume 'auto'",
        f"    run.dir     '{run_dir}'",
        "    memory      the estimate against each machine's memory",
    ):
        assert line in printed, printed
    assert printed.count("memory about ") == 2  # one estimate per pp rank
    # the same layout on a world it does not fit: exit 2, the broken rule named, still no file
    code, printed = dry_run(6, args)
    assert code == 2 and "WORLD_SIZE=6 is not divisible by dp_replicate*cp*tp*pp=4" in printed, printed
    assert list(tmp_path.iterdir()) == []


def test_the_old_multi_node_example_is_refused_with_its_rule():
    code, printed = dry_run(16, ["--config", DEBUG_CONFIG, "--parallel.tp", "8"])
    assert code == 2 and "parallel.tp=8 does not divide model.n_kv_heads=4" in printed


def test_the_command_line_dry_run_and_its_help():
    usage = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--dry-run --world-size N" in usage.stdout
    proc = subprocess.run(
        [sys.executable, "train.py", "--dry-run", "--world-size", "4", "--config", DEBUG_CONFIG, "--parallel.tp", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "dp_shard      size   2" in proc.stdout, proc.stderr
    wrong = subprocess.run(
        [sys.executable, "train.py", "--world-size", "4"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode == 2 and "--world-size only goes with --dry-run" in wrong.stderr
