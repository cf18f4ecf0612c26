"""Real data end to end: a BPE tokenizer.json, JSONL and Parquet datasets, training on several layouts with
a validation loss, resuming on another layout, then sampling and loading the export in transformers.

1. Train a 512-token byte-level BPE with `tokenizers` on the default corpus (no download); write the
   corpus's first files as a JSONL file and as a Parquet file, and prepare both with `data.prepare`. Same
   documents, same tokenizer: the two token files must be byte-identical.
2. One process on the JSONL folder, 6 steps, validation every 2 steps (the reference). Two data-parallel
   ranks (FSDP) on the Parquet folder for 3 steps, saving; then a 2-stage pipeline resumes for steps 4-6.
   Training loss, gradient norm and validation loss must follow the reference (fp32 parity, LOSS_RTOL):
   two layouts with identical losses, a resume on a third with the same curve, and val_loss identical on
   1 process, fsdp2 and pp2 (the pipeline path uses the schedule's forward-only ``eval``). Tensor
   parallelism (vocab-sharded loss) and a V-shaped pipeline schedule (whose ``eval`` torch 2.13 cannot
   run, see training/evaluation.py) must match too.
3. Export the final checkpoint; ``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM
   .from_pretrained`` load it offline, tokenize like our tokenizer and give our logits; greedy generation
   from the DCP checkpoint equals transformers' ``generate`` from the export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.prepare import prepare
from data.token_file import TOKENS, read_header

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # from_pretrained reads local folders here: never the network
from launch.local_runs import ROOT, read_metrics, train_on
from tests.bpe import tiny_bpe
from tests.training_runs import LOSS_RTOL, assert_same_curve

N_FILES = 30  # documents (stdlib files) in the datasets: ~400k tokens, prepared in about a second
STEPS = 6


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Step 1: (tokenizer.json, JSONL-prepared folder, Parquet-prepared folder)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.corpus import corpus_files

    root = tmp_path_factory.mktemp("real")
    tokenizer = tiny_bpe(root / "tokenizer")
    files = corpus_files("default")[:N_FILES]
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    (root / "raw").mkdir()
    with open(root / "raw" / "docs.jsonl", "w") as f:
        for file, text in zip(files, texts, strict=True):
            f.write(json.dumps({"text": text, "path": file.name}) + "\n")
    pq.write_table(pa.table({"path": [f.name for f in files], "text": texts}), root / "raw" / "docs.parquet")
    prepare(str(root / "raw" / "docs.jsonl"), str(tokenizer), str(root / "jsonl"), workers=2, quiet=True)
    prepare(str(root / "raw" / "docs.parquet"), str(tokenizer), str(root / "parquet"), workers=1, quiet=True)
    return tokenizer, root / "jsonl", root / "parquet"


def test_jsonl_and_parquet_prepare_the_same_tokens(datasets):
    _, jsonl, parquet = datasets
    a, b = read_header(jsonl), read_header(parquet)
    assert a["num_documents"] == b["num_documents"] == N_FILES and a["num_tokens"] == b["num_tokens"] > 100_000
    assert (jsonl / TOKENS).read_bytes() == (parquet / TOKENS).read_bytes()
    tokens = np.fromfile(jsonl / TOKENS, dtype="<u2")
    assert int(tokens.max()) == 511 and int((tokens == 0).sum()) == N_FILES  # the EOS ends each document


def settings(datasets, source, **extra) -> dict:
    tokenizer, *_ = datasets
    return {
        "data.tokenizer": str(tokenizer),
        "model.vocab_size": 512,
        "data.source": str(source),
        "data.val_fraction": 0.05,
        "eval.interval": 2,
        "eval.steps": 2,
        "training.steps": STEPS,
        **extra,
    }


@pytest.fixture(scope="module")
def reference(datasets, shared_runs):
    """Step 2: one process on the JSONL folder."""
    return shared_runs.records(settings(datasets, datasets[1]))


def assert_same_val_loss(run: list[dict], ref: list[dict]) -> int:
    """val_loss equal wherever both runs evaluated; returns how many evaluations were compared."""
    by_step = {r["step"]: r["val_loss"] for r in ref if "val_loss" in r}
    compared = 0
    for r in run:
        if "val_loss" in r and r["step"] in by_step:
            rel = abs(r["val_loss"] - by_step[r["step"]]) / by_step[r["step"]]
            assert rel <= LOSS_RTOL, f"step {r['step']} val_loss {r['val_loss']!r} vs {by_step[r['step']]!r}"
            compared += 1
    return compared


@pytest.fixture(scope="module")
def resumed(datasets, reference, tmp_path_factory):
    """Step 2: FSDP on 2 ranks for 3 steps (saving), then a 2-stage pipeline resumes for steps 4-6."""
    root = tmp_path_factory.mktemp("layouts")
    folder = {"checkpoint.folder": str(root / "ckpt")}
    parquet = datasets[2]
    fsdp = train_on(
        2,
        settings(
            datasets, parquet, **folder, **{"parallel.dp_shard": 2, "training.steps": 3, "checkpoint.interval": 3}
        ),
        root / "a",
    )
    pp = train_on(
        2,
        settings(
            datasets,
            parquet,
            **folder,
            **{"parallel.pp": 2, "parallel.dp_shard": 1, "checkpoint.interval": 3, "checkpoint.resume": "auto"},
        ),
        root / "b",
    )
    return fsdp, pp, root / "ckpt"


def test_two_layouts_give_the_same_losses_and_a_third_resumes_the_curve(reference, resumed):
    fsdp, pp, _ = resumed
    assert_same_curve(fsdp, reference[:3])
    assert [r["step"] for r in pp] == [4, 5, 6]
    assert_same_curve(pp, reference[3:])  # step 5 trains right after the pipeline evaluated at step 4
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3, "the model learns from the BPE tokens"


def test_validation_loss_is_the_same_on_one_process_fsdp2_and_pp2(reference, resumed):
    fsdp, pp, _ = resumed
    assert [r["step"] for r in reference if "val_loss" in r] == [2, 4, 6]
    assert assert_same_val_loss(fsdp, reference) == 1  # step 2 (step 3, its last, has no reference)
    assert assert_same_val_loss(pp, reference) == 2  # steps 4 and 6
    assert 3 < reference[-1]["val_loss"] < reference[1]["val_loss"]


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "ZBVZeroBubble"},
        {"parallel.tp": 2, "parallel.dp_shard": 1},
    ],
    ids=["pp2-zbv", "tp2"],
)
def test_other_layouts_evaluate_the_same(layout, datasets, reference, tmp_path):
    run = train_on(2, settings(datasets, datasets[1], **layout, **{"training.steps": 4}), tmp_path)
    # Steps 1-4 are inside the 5 warmup steps, where the LR does not depend on training.steps.
    assert_same_curve(run, reference[:4])
    assert assert_same_val_loss(run, reference) == 2  # steps 2 and 4


# ---- export, transformers, generation -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(resumed, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "checkpoint.export", "--checkpoint", str(resumed[2]), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step-6" in proc.stdout and "tokenizer.json" in proc.stdout
    return out


def test_the_export_loads_in_transformers_with_its_tokenizer(datasets, exported):
    import transformers  # the dev extras install it: a missing one fails here instead of skipping

    from data.tokenizers import load_tokenizer
    from generate import load_export

    ours_tok = load_tokenizer(str(datasets[0]))
    theirs_tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    text = "def main(argv):\n    return sorted(set(argv))  # héllo\n"
    ids = theirs_tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ours_tok.encode(text) and theirs_tok.decode(ids) == text
    assert theirs_tok.eos_token_id == ours_tok.eos_id == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert model.config.eos_token_id == 0
    ours, _ = load_export(exported)
    batch = torch.tensor([ids])
    with torch.no_grad():
        a, b = ours.eval()(batch), model(batch).logits
    # the same fp32 ops in the same order (identical when measured); a wrong weight would be O(1)
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()


def test_greedy_samples_from_the_checkpoint_equal_transformers(datasets, resumed, exported):
    import transformers  # the dev extras install it: a missing one fails here instead of skipping

    from generate import generate_tokens, load_checkpoint

    model, tokenizer, step_dir = load_checkpoint(resumed[2], step=None)  # saved by the pp2 run
    assert step_dir.name == "step-6" and tokenizer.sha256 == read_header(datasets[1])["tokenizer"]["sha256"]
    prompt = tokenizer.encode("import os\n\ndef ")
    ours = list(generate_tokens(model.eval(), prompt, 24, temperature=0.0, eos_id=tokenizer.eos_id))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    assert ours == theirs


def test_generate_command_streams_text_from_the_checkpoint(resumed, datasets):
    cmd = [
        sys.executable,
        "-m",
        "generate",
        "--checkpoint",
        str(resumed[2]),
        "--step",
        "3",
        "--prompt",
        "def ",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "5",
    ]
    runs = [subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("def ") and len(proc.stdout) > len("def \n")
        assert "step-3" in proc.stderr and "tokens in" in proc.stderr
    assert runs[0].stdout == runs[1].stdout, "the same --seed samples the same text"


def test_val_loss_reaches_the_console_metrics_jsonl_and_tensorboard(datasets, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launch.local_runs import DEBUG_CONFIG, run_train_cli

    tokenizer, jsonl, _ = datasets
    run = tmp_path / "run"
    proc = run_train_cli(
        1,
        "--config",
        DEBUG_CONFIG,
        "--run.dir",
        str(run),
        "--training.steps",
        "3",
        "--data.source",
        str(jsonl),
        "--data.tokenizer",
        str(tokenizer),
        "--model.vocab_size",
        "512",
        "--data.val_fraction",
        "0.05",
        "--eval.interval",
        "2",
        "--eval.steps",
        "1",
        "--run.log_every",
        "5",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # evaluated at step 2 (the interval) and step 3 (the last), logged even though log_every is 5
    assert [line.count("| val_loss ") for line in proc.stdout.splitlines() if line.startswith("step")] == [1, 1]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [2, 3] and all(r["val_loss"] > 0 for r in records)
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [2, 3]
    assert [e.value for e in events.Scalars("val/loss")] == pytest.approx([r["val_loss"] for r in records])


def test_evaluation_does_not_change_training(tmp_path):
    """MoE counts routed tokens and nudges its expert bias from them: evaluating must touch neither."""
    moe = str(ROOT / "configs" / "debug_moe.toml")
    base = {"data.val_fraction": 0.05, "training.steps": 4, "model.moe_bias_update_rate": 0.01}
    plain = train_on(1, base, tmp_path / "plain", config=moe)
    evaluated = train_on(1, {**base, "eval.interval": 1, "eval.steps": 2}, tmp_path / "eval", config=moe)
    assert all("val_loss" in r for r in evaluated)
    for a, b in zip(plain, evaluated, strict=True):
        assert (a["loss"], a["grad_norm"], a["expert_load"]) == (b["loss"], b["grad_norm"], b["expert_load"])
