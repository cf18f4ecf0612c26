"""Run configuration: TOML files plus dotted command-line overrides.

Every field below can be set in a TOML file (``[training] steps = 20``) and overridden on the command line
(``--training.steps 20`` or ``--training.steps=20``). Unknown sections or keys, and values of the wrong
type, are errors that name the key and list what is allowed. With no ``--config`` the defaults below are
the embedded default run: a tiny Llama on the default corpus that trains in seconds on a CPU.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """Bad user input (config, layout, data path). The message names the field, the value and the fix."""


@dataclass
class ModelConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 256  # the byte tokenizer needs 256
    ffn_dim: int = 0  # 0: Llama's rule, 8/3 * dim rounded up to multiple_of
    multiple_of: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    n_experts: int = 0  # 0: a dense model; > 0: MoE feed-forward layers (see models/moe.py)
    top_k: int = 2
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0
    moe_ffn_dim: int = 0  # each expert's hidden size; 0: the dense FFN's hidden size / top_k
    moe_shared_experts: int = 0  # 0 or 1
    moe_score_func: str = "softmax"  # softmax | sigmoid
    moe_route_norm: bool = True
    moe_aux_loss_coef: float = 0.0  # Switch-style load-balancing loss coefficient (0: off)
    moe_bias_update_rate: float = 0.0  # aux-loss-free expert-bias step (0: off)
    moe_capacity_factor: float = 0.0  # 0: dropless; > 0: per-sequence capacity with token dropping


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world after the other degrees
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 0  # 0: one micro-batch per pipeline stage
    pp_stages_per_rank: int = 0  # 0: derived from the schedule (1; 2 for looped and V-shaped schedules)
    pp_split: str = "params"  # params | flops | explicit layers per stage, e.g. "3,5"
    sequence_parallel: bool = True
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    collective_timeout_s: int = 300


@dataclass
class TrainingConfig:
    steps: int = 40
    seed: int = 1234
    global_batch: int = 8  # sequences per optimizer step, whole world
    micro_batch: int = 0  # sequences per rank per forward; 0: the whole local batch (no accumulation)
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # <= 0 disables clipping (the norm is still measured and logged)
    mixed_precision: str = "fp32"  # fp32 | bf16
    activation_checkpoint: str = "none"  # none | full | selective
    compile: bool = False
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class DataConfig:
    source: str = "default"  # "default": the stdlib's sources; a text file / folder; or a data.prepare folder
    max_bytes: int = 16 * 1024 * 1024  # raw text sources: read at most this much (prepared folders: no limit)
    tokenizer: str = "bytes"  # bytes | path to a Hugging Face tokenizer.json (or its folder); see data/tokenizers.py
    eos_token: str = ""  # "": the tokenizer's own end-of-document token
    val_source: str = ""  # held-out data (same kinds as source); "": none, or the last val_fraction of source
    val_fraction: float = 0.0  # with no val_source: hold out this last fraction of the source's tokens


@dataclass
class EvalConfig:
    interval: int = 0  # validation loss every `interval` steps and at the last step; 0: never
    steps: int = 4  # global batches of the validation split per evaluation (always the same ones)


@dataclass
class RunConfig:
    dir: str = "runs/default"
    log_every: int = 1
    tensorboard: bool = True
    overwrite: bool = False  # allow replacing the metrics of an earlier run in the same run.dir
    pp_timeline: bool = False  # pipeline runs: time F/B/W per rank on the last step, write the bubble + SVG


@dataclass
class CheckpointConfig:
    folder: str = ""  # "": <run.dir>/checkpoints; holds step-N/ folders (see checkpoint/manager.py)
    interval: int = 0  # save every `interval` steps and at the last step; 0: never save
    resume: str = "none"  # auto (the newest complete checkpoint, if any) | none | a step number
    async_: bool = False  # TOML/CLI key `checkpoint.async` (a Python keyword): save in a thread while training
    keep_last: int = 3  # published checkpoints to keep, newest first; 0: keep all
    init_from: str = ""  # a Hugging Face-named model.safetensors (or its folder): initial weights of a fresh run


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "training.mixed_precision": ("fp32", "bf16"),
    "training.activation_checkpoint": ("none", "full", "selective"),
    "training.device": ("auto", "cpu", "cuda"),
    "model.moe_score_func": ("softmax", "sigmoid"),
    "parallel.fsdp_reshard_after_forward": ("default", "always", "never"),
}


def _sections(cfg: Config) -> dict[str, object]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _convert(key: str, raw: object, typ: type) -> object:
    """Convert a TOML value or a CLI string to the field's type, or raise a ConfigError naming the key."""
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return raw.lower() in ("true", "1", "yes", "on")
    elif typ is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(raw, (str, int)) and not isinstance(raw, bool):
            return str(raw)
    raise ConfigError(f"{key}={raw!r} is not a valid {typ.__name__}; set it to a {typ.__name__} value.")


# Keys whose field name differs from the user-facing name (a Python keyword cannot be a field name).
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_"}


def _set(cfg: Config, key: str, raw: object) -> None:
    key = KEY_ALIASES.get(key, key)
    sections = _sections(cfg)
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(
            f"unknown config key {key!r}: keys are <section>.<name> with section one of {sorted(sections)}."
        )
    section = sections[parts[0]]
    hints = typing.get_type_hints(type(section))
    if parts[1] not in hints:
        raise ConfigError(f"unknown config key {key!r}; the keys of [{parts[0]}] are: {', '.join(hints)}.")
    value = _convert(key, raw, hints[parts[1]])
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(CHOICES[key])}.")
    setattr(section, parts[1], value)


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into the ``--config`` path and a list of (dotted key, raw string value) overrides."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value.")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value, e.g. --{name} <value>.")
            value, i = argv[i + 1], i + 1
        i += 1
        if name == "config":
            config_path = value
        else:
            overrides.append((name, value))
    return config_path, overrides


def load_config(argv: list[str] | None = None, *, path: str | None = None, overrides=None) -> Config:
    """Build a Config from defaults, then a TOML file, then dotted overrides (later wins).

    ``argv`` is the command line (``--config f.toml --training.steps 5``); tests may instead pass
    ``path`` and ``overrides`` (a dict or a list of pairs) directly.
    """
    if argv is not None:
        path, pairs = parse_overrides(argv)
    else:
        pairs = list((overrides or {}).items()) if isinstance(overrides, dict) else list(overrides or [])
    cfg = Config()
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config {path!r}: no such file; pass the path of a TOML file (see configs/).")
        try:
            table = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path!r} is not valid TOML: {exc}; fix the file.") from exc
        for section, entries in table.items():
            if not isinstance(entries, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table.")
            for name, value in entries.items():
                _set(cfg, f"{section}.{name}", value)
    for key, value in pairs:
        _set(cfg, key, value)
    return cfg
