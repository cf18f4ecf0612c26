import pytest

from launch.local_runs import DEBUG_CONFIG
from runtime.config import ConfigError, load_config


def test_cli_overrides_win_over_the_file():
    cfg = load_config(["--config", DEBUG_CONFIG, "--training.steps", "3", "--parallel.dp_shard=2"])
    assert cfg.training.steps == 3 and cfg.parallel.dp_shard == 2
    assert cfg.model.dim == 128  # from the file


def test_defaults_are_the_embedded_run():
    cfg = load_config([])
    assert cfg.data.source == "default" and cfg.training.steps > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--training.stepz", "3"], ["training.stepz", "steps"]),
        (["--trainin.steps", "3"], ["trainin.steps", "section"]),
        (["--training.steps", "three"], ["training.steps", "int"]),
        (["--training.mixed_precision", "fp16"], ["training.mixed_precision", "bf16"]),
        (["--training.steps"], ["--training.steps", "value"]),
        (["steps=3"], ["steps=3", "--section.key"]),
        (["--config", "no/such.toml"], ["no/such.toml", "TOML"]),
    ],
)
def test_bad_input_names_the_key_and_the_fix(argv, words):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    for word in words:
        assert word in str(err.value)


def test_booleans_parse_from_strings():
    assert load_config(["--parallel.sequence_parallel", "false"]).parallel.sequence_parallel is False
    assert load_config(["--run.tensorboard", "true"]).run.tensorboard is True
