"""The config is the user's: after every check it still equals what was parsed from TOML and flags.

What a run derives (the model a transformers folder gives, the steps ``training.epochs`` makes, the precision
``auto`` becomes, the layout) lives in the plan (planning/plan.py: ``LayoutPlan``), never written back.
"""

from __future__ import annotations

import copy
import json

import pytest

from runtime.config import load_config


def llama_folder(tmp_path) -> str:
    """A folder that transformers wrote (config.json and weights), of another shape than the default config's."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size = 256
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 64
    return str(folder)


CASES = {
    "defaults": {},
    "precision auto, epochs": {"training.mixed_precision": "auto", "training.epochs": 0.001},
    "a transformers folder": {"checkpoint.init_from": "FOLDER", "training.seq_len": 64},
    "pipeline, dp_shard -1": {"parallel.pp": 2, "parallel.pp_schedule": "Interleaved1F1B"},
}


@pytest.mark.parametrize("case", CASES)
def test_the_config_after_every_check_equals_the_parsed_config(case, tmp_path):
    from train import check_config

    overrides = {k: (llama_folder(tmp_path) if v == "FOLDER" else v) for k, v in CASES[case].items()}
    cfg = load_config(overrides={**overrides, "run.dir": str(tmp_path / "run"), "run.memory_check": False})
    parsed = copy.deepcopy(cfg)
    plan, _ = check_config(cfg, 2 if case.startswith("pipeline") else 1)
    assert cfg.to_dict() == parsed.to_dict() and cfg.explicit_keys == parsed.explicit_keys
    if "checkpoint.init_from" in overrides:  # what the folder says is the plan's, not the config's
        assert (plan.model.dim, plan.model_config.dim, cfg.model.dim) == (64, 64, 128)
    if "training.epochs" in overrides:
        assert plan.steps != cfg.training.steps
    assert plan.layout.mixed_precision in ("fp32", "bf16")
