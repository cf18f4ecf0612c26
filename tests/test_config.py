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
