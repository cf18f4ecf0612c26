"""Reading the config: defaults, the file, dotted overrides (the errors are in test_bad_input.py: CONFIG_ERRORS)."""

from launch.local_runs import DEBUG_CONFIG
from runtime.config import load_config


def test_cli_overrides_win_over_the_file():
    cfg = load_config(["--config", DEBUG_CONFIG, "--training.steps", "3", "--parallel.dp_shard=2"])
    assert cfg.training.steps == 3 and cfg.parallel.dp_shard == 2
    assert cfg.model.dim == 128  # from the file


def test_defaults_are_the_embedded_run():
    cfg = load_config([])
    assert cfg.data.source == "default" and cfg.training.steps > 0


def test_booleans_parse_from_strings():
    assert load_config(["--parallel.sequence_parallel", "false"]).parallel.sequence_parallel is False
    assert load_config(["--run.tensorboard", "true"]).run.tensorboard is True


def test_a_preset_gives_the_model_shape_and_explicit_keys_override_it():
    """configs/llama3_*.toml name their shape (``model.preset``); the shape is defined once, in models/presets.py."""
    import pytest

    from launch.local_runs import ROOT
    from models.presets import PRESETS
    from runtime.config import ConfigError, model_args

    for size in ("8b", "70b", "405b"):
        cfg = load_config(path=str(ROOT / "configs" / f"llama3_{size}.toml"))
        args, preset = model_args(cfg), PRESETS[f"llama3-{size}"]
        assert cfg.model.preset == f"llama3-{size}"
        assert args.num_params() == preset.num_params() and args.hidden_dim == preset.hidden_dim
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta", "max_seq_len"):
            assert getattr(args, key) == getattr(preset, key), (size, key)
    cfg = load_config(["--config", str(ROOT / "configs" / "llama3_8b.toml"), "--model.n_layers", "2"])
    assert cfg.model.n_layers == 2 and cfg.model.dim == 4096  # the command line over the preset
    mixtral = load_config(overrides={"model.preset": "mixtral-8x7b"})
    assert model_args(mixtral).num_params() == PRESETS["mixtral-8x7b"].num_params()
    with pytest.raises(ConfigError, match="not a preset"):
        load_config(overrides={"model.preset": "llama3-9b"})
