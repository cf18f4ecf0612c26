"""Run configuration: TOML files plus dotted command-line overrides, checked before anything else runs.

Every field of the schema (runtime/schema.py) can be set in a TOML file (``[training] steps = 20``) and
overridden on the command line (``--training.steps 20`` or ``--training.steps=20``). With no ``--config`` the
schema's defaults are the embedded default run: a tiny Llama on the default corpus that trains in seconds on a
CPU. ``python train.py --help`` prints every key with its default and meaning (``help_text``).

Input is strict, because a silently misread setting costs a whole run:

1. Unknown sections (an empty one too) or keys are errors that list what is allowed; a key given twice on
   the command line is an error (which one did you mean?).
2. Types are strict: in TOML an int field takes an int (``steps = "3"`` is refused, not coerced), a float
   field an int or a float, a string field a string, a choice field one of its ``Literal`` values (a quoted
   value that would fit without its quotes is told so). On the command line the text is parsed into the
   field's type.
3. Where a value is parsed it must meet its type's limits, which torch, the OS and datetime impose later
   (``type_problem``: int64, finite fp32, a path that is not blank, a step in ASCII digits); numbers on the
   command line are ASCII only (``int('١٢')`` is 12 in Python). ``check_values`` then checks every number
   against the range in its field's metadata (``ge``/``gt``/``le``/``lt``), the limits again, then the rules
   that tie several fields together. Every broken rule is reported at once, naming the field, the value and
   the fix.

``model_args`` maps the ``[model]`` section onto ``models.llama.ModelArgs``; everything that builds a model
from a config (training, export, generation) goes through it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from pathlib import Path
from typing import Literal

from runtime.schema import FIELD_KEYS, KEY_ALIASES, Config, ModelConfig


class ConfigError(ValueError):
    """Bad user input (config, layout, data path). The message names the field, the value and the fix."""


# ---- the limits of each type: what a value meets after the range check (torch, the OS, datetime) --------------
INT64_MAX = 2**63 - 1  # torch.manual_seed, tensors and the C++ side take int64
FP32_MAX = 3.4028234663852886e38  # learning rates and coefficients end up in fp32 tensors on some paths
FP32_TINY = 2.0**-150  # below this a non-zero value rounds to 0 in fp32
ASCII_INT = re.compile(r"[+-]?[0-9]+")  # int() also takes '١٢' and '1_0': a typo should not become a number
ASCII_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)", re.I)


def parse_int(text: str) -> int | None:
    """``text`` as an int when it is ASCII digits with an optional sign (else None)."""
    text = text.strip()
    return int(text) if ASCII_INT.fullmatch(text) else None


def parse_float(text: str) -> float | None:
    """``text`` as a float when it is an ASCII decimal number (else None); -0.0 becomes 0.0."""
    text = text.strip()
    return float(text) + 0.0 if ASCII_FLOAT.fullmatch(text) else None


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (Python's stand-in for argv bytes that are not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def type_problem(value, meta: dict | None = None) -> str | None:
    """Why ``value`` cannot be used even if it is in its field's range (None: it can): an int beyond int64, a
    float that is not a finite fp32 number (or rounds to 0 in fp32), a path that is blank or holds a NUL byte,
    a step that is not auto, none or ASCII digits."""
    meta = meta or {}
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -INT64_MAX - 1 <= value <= INT64_MAX else f"must fit in a signed 64-bit integer (<= {INT64_MAX})"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "must be a finite number"
        if abs(value) > FP32_MAX or (value != 0 and abs(value) < FP32_TINY):
            return "must be 0 or a number fp32 can hold (between 1e-45 and 3.4e38 in magnitude)"
        return None
    if isinstance(value, str):
        if "\0" in value:
            return "must not contain a NUL byte"
        kind = meta.get("path")
        if not kind and not _is_unicode(value):  # a path may hold any bytes; text is tokenized, so it must be text
            return "is not UTF-8 text (bytes the terminal could not decode); give it in UTF-8"
        if (kind or meta.get("nonempty")) and value and not value.strip():
            return "is only whitespace; give a real value"
        if (kind == "required" or meta.get("nonempty")) and not value:
            return "must not be empty (an empty path would mean the current folder); give a path"
        if meta.get("step") and value.strip().lower() not in ("auto", "none"):
            step = parse_int(value)
            if step is None or value.strip()[:1] in "+-" or step > INT64_MAX:
                return "must be auto, none or a step number in ASCII digits (e.g. 100)"
    return None


def _sections(cfg: Config) -> dict[str, object]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _fields(section) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section)}


def _convert(key: str, raw: object, typ, from_text: bool, int_ok: bool = False) -> object:
    """``raw`` as a ``typ`` (``from_text``: a parsed command-line string), or a ConfigError naming key, value and
    fix."""
    if typing.get_origin(typ) is Literal:
        choices = typing.get_args(typ)
        if isinstance(raw, str) and raw in choices:
            return raw
        raise ConfigError(f"{key}={raw!r} is not allowed; choose one of {', '.join(map(str, choices))}.")
    if from_text:
        assert isinstance(raw, str)
        text = raw.strip()
        if typ is bool and text.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return text.lower() in ("true", "1", "yes", "on")
        if typ is int and parse_int(text) is not None:
            return parse_int(text)
        if typ is float and parse_float(text) is not None:
            return parse_float(text)
        if typ is str:
            return raw
    else:
        if typ is bool and isinstance(raw, bool):
            return raw
        if typ is int and isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if typ is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            try:
                return float(raw) + 0.0  # -0.0 becomes 0.0
            except OverflowError:  # a TOML integer beyond any float
                pass
        if typ is str and (isinstance(raw, str) or (int_ok and isinstance(raw, int) and not isinstance(raw, bool))):
            return str(raw)
        if isinstance(raw, str) and typ is not str and _fits_unquoted(raw, typ):
            raise ConfigError(
                f"{key}={raw!r} is a string in the TOML file but must be a {typ.__name__}; write it without quotes."
            )
    example = {"int": "e.g. 8", "float": "e.g. 0.5", "bool": "true or false", "str": 'e.g. "text"'}[typ.__name__]
    raise ConfigError(f"{key}={raw!r} is not a valid {typ.__name__}; set it to a {typ.__name__} value ({example}).")


def _fits_unquoted(text: str, typ) -> bool:
    """Whether the TOML string ``text``, written without its quotes, is a valid ``typ`` value (``"3"`` for an
    int: yes; ``"fast"`` for a float: no, so the advice to drop the quotes is given only where it helps)."""
    if "\n" in text:
        return False
    try:
        _convert("", tomllib.loads(f"value = {text}")["value"], typ, from_text=False)
    except (tomllib.TOMLDecodeError, ConfigError):
        return False
    return True


def _set(cfg: Config, key: str, raw: object, from_text: bool) -> None:
    field_key = KEY_ALIASES.get(key, key)
    sections = _sections(cfg)
    parts = field_key.split(".")
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(
            f"unknown config key {key!r}: keys are <section>.<name> with section one of {sorted(sections)}; "
            "`python train.py --help` lists them all."
        )
    section = sections[parts[0]]
    hints = typing.get_type_hints(type(section), include_extras=False)
    if parts[1] not in hints:
        names = [FIELD_KEYS.get(f"{parts[0]}.{n}", f"{parts[0]}.{n}").split(".")[1] for n in hints]
        raise ConfigError(f"unknown config key {key!r}; the keys of [{parts[0]}] are: {', '.join(names)}.")
    meta = _fields(section)[parts[1]].metadata
    value = _convert(key, raw, hints[parts[1]], from_text, meta.get("int_ok", False))
    problem = type_problem(value, meta)  # checked where it is parsed: the key is named before anything uses it
    if problem:
        default = _fields(section)[parts[1]].default
        raise ConfigError(f"{key}={value!r} {problem}; the default is {default!r}.")
    setattr(section, parts[1], value)


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into the ``--config`` path and a list of (dotted key, raw string value) overrides."""
    config_path, overrides, seen, i = None, [], set(), 0
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
        if name in seen:
            raise ConfigError(f"--{name} is given twice on the command line; give each key once.")
        seen.add(name)
        if name == "config":
            config_path = value
        else:
            overrides.append((name, value))
    return config_path, overrides


def load_config(argv: list[str] | None = None, *, path: str | None = None, overrides=None) -> Config:
    """Build a Config from defaults, then a TOML file, then dotted overrides (later wins); tests may pass ``path`` and
    ``overrides`` instead of ``argv``."""
    if argv is not None:
        path, pairs = parse_overrides(argv)
        typed = False
    else:
        pairs = list((overrides or {}).items()) if isinstance(overrides, dict) else list(overrides or [])
        typed = True
    cfg = Config()
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config {path!r}: no such file; pass the path of a TOML file (see configs/).")
        try:
            table = tomllib.loads(file.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config {path!r} is not valid TOML: {exc}; fix the file.") from exc
        for section, entries in table.items():
            if not isinstance(entries, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table.")
            if section not in _sections(cfg):  # also an empty one: a misspelt [trainig] must not pass unseen
                raise ConfigError(
                    f"{path}: unknown section [{section}]; the sections are {', '.join(_sections(cfg))} "
                    "(`python train.py --help` lists every key)."
                )
            for name, value in entries.items():
                _set(cfg, f"{section}.{name}", value, from_text=False)
    explicit = {f"{section}.{name}" for section, entries in table.items() for name in entries} if path else set()
    for key, value in pairs:
        _set(cfg, key, value, from_text=not typed or isinstance(value, str))
        explicit.add(KEY_ALIASES.get(key, key))
    if cfg.model.preset:  # the preset's [model] keys, except those given explicitly (models/presets.py)
        from models.presets import PRESETS, preset_keys

        if cfg.model.preset not in PRESETS:
            raise ConfigError(
                f"model.preset={cfg.model.preset!r} is not a preset; the presets are {', '.join(PRESETS)}."
            )
        for name, value in preset_keys(cfg.model.preset).items():
            if f"model.{name}" not in explicit:
                setattr(cfg.model, name, value)
                explicit.add(f"model.{name}")  # asked for by name: a model folder's config.json must not overrule it
    cfg.explicit_keys = frozenset(explicit)
    return cfg


# ---- value checks ----------------------------------------------------------------------------------------
def _range_rule(meta: dict) -> str | None:
    bounds = [f"{sym} {meta[k]}" for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta]
    return " and ".join(bounds) if bounds else None


def _in_range(value, meta: dict) -> bool:
    return (
        ("ge" not in meta or value >= meta["ge"])
        and ("gt" not in meta or value > meta["gt"])
        and ("le" not in meta or value <= meta["le"])
        and ("lt" not in meta or value < meta["lt"])
    )


def section_problems(section_name: str, section) -> list[str]:
    """Each field of ``section`` against its type's limits and its range: one line per broken field."""
    broken = []
    for name, f in _fields(section).items():
        value, key = getattr(section, name), FIELD_KEYS.get(f"{section_name}.{name}", f"{section_name}.{name}")
        problem = type_problem(value, f.metadata)
        if problem:
            broken.append(f"{key}={value!r} {problem}; the default is {f.default!r}.")
            continue
        rule = _range_rule(f.metadata)
        if (
            rule
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not _in_range(value, f.metadata)
        ):
            broken.append(f"{key}={value!r} must be {rule}; the default is {f.default!r}.")
    return broken


def check_values(cfg: Config, model: ModelConfig | None = None, steps: int | None = None) -> None:
    """Every field's range (from its metadata), then the rules between fields; one ConfigError lists all.
    ``model`` and ``steps``: what the run trains when a transformers folder or training.epochs sets them (by
    default the config's own)."""
    broken = []
    sections = _sections(cfg)
    if model is not None:  # the model the run trains (a transformers folder's) is checked, not the one it replaced
        sections["model"] = model
    for section_name, section in sections.items():
        broken += section_problems(section_name, section)
    m, p = model or cfg.model, cfg.parallel
    steps = steps or cfg.training.steps
    if p.dp_shard == 0:
        broken.append("parallel.dp_shard=0 must be >= 1, or -1 for 'the rest of the world'.")
    if cfg.data.tokenizer == "bytes" and m.vocab_size < 256:
        broken.append(f"model.vocab_size={m.vocab_size} must be >= 256, which the byte tokenizer needs.")
    if m.n_heads >= 1 and m.dim % m.n_heads == 0 and (m.dim // m.n_heads) % 2:
        broken.append(
            f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even (rotary embeddings rotate pairs); "
            "change model.dim or model.n_heads."
        )
    if m.sliding_window and cfg.training.seq_len > m.sliding_window:
        broken.append(
            f"training.seq_len={cfg.training.seq_len} is longer than model.sliding_window={m.sliding_window}: meshloom "
            "computes full attention, which equals the model's windowed attention only up to the window; lower it."
        )
    if m.rope_scaling == "llama3" and m.rope_low_freq_factor >= m.rope_high_freq_factor:
        broken.append(
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be < model.rope_high_freq_factor="
            f"{m.rope_high_freq_factor} (llama3 RoPE scaling blends between the two); e.g. 1 and 4."
        )
    broken += pad_problems(m, p.tp)
    d = cfg.data
    if d.val_source and d.val_fraction:
        broken.append(
            f"data.val_source={d.val_source!r} and data.val_fraction={d.val_fraction} are both set; "
            "keep one (val_fraction=0 with a val_source)."
        )
    if cfg.eval.interval > 0 and not (d.val_source or d.val_fraction):
        broken.append(
            f"eval.interval={cfg.eval.interval} needs a validation split: set --data.val_source (a prepared folder "
            "or text) or --data.val_fraction (e.g. 0.01 holds out the last 1% of data.source)."
        )
    if cfg.profile.enabled and cfg.profile.start_step > steps:
        broken.append(
            f"profile.start_step={cfg.profile.start_step} comes after the last step (training.steps="
            f"{steps}); profile an earlier step or train longer."
        )
    if broken:
        raise ConfigError("invalid settings:\n  - " + "\n  - ".join(broken))


def help_text() -> str:
    """Every key with its type, default and meaning (``python train.py --help``)."""
    lines = [
        "usage: [torchrun --standalone --nproc-per-node N] train.py [--config FILE.toml] [--section.key VALUE ...]",
        "       python train.py --dry-run --world-size N [--config FILE.toml] [--section.key VALUE ...]",
        "       python train.py --simulate --world-size N [--config FILE.toml] [--section.key VALUE ...]",
        "",
        "--dry-run --world-size N: check the config and the layout for N ranks and print the banner (mesh, parameters",
        "and memory per rank, batch split) without a process group or any data, checkpoint or run.dir file; exit 0, or",
        "2 listing every broken rule.",
        "--simulate --world-size N [--pp-ranks 0,15] [--simulate-out FILE]: build and run two training steps of one",
        "rank per pipeline stage on a fake world of N ranks under fake tensors; peak memory by category beside the",
        "estimate, collectives per mesh dim (planning/simulate.py).",
        "",
        "Every key below can be set in a TOML file ([section] key = value) or overridden on the command line.",
    ]
    for section_name, section in _sections(Config()).items():
        lines += ["", f"[{section_name}]"]
        hints = typing.get_type_hints(type(section))
        for name, f in _fields(section).items():
            key = FIELD_KEYS.get(f"{section_name}.{name}", f"{section_name}.{name}")
            typ = hints[name]
            kind = "|".join(typing.get_args(typ)) if typing.get_origin(typ) is Literal else typ.__name__
            rule = _range_rule(f.metadata)
            lines.append(f"  --{key:<36} {kind:<20} default {f.default!r:<14} {f.metadata.get('help', '')}")
            if rule:
                lines[-1] += f" ({rule})"
    return "\n".join(lines)


def pad_problems(m: ModelConfig, tp: int) -> list[str]:
    """model.pad_token_id within the vocabulary; model.freeze_pad_embedding where the embedding is whole (not
    vocab-sharded by tensor parallelism, whose ranks see shifted ids). Checked again on the [model] a
    transformers folder gives (checkpoint/hf_folder.py)."""
    out = []
    if m.pad_token_id >= m.vocab_size:
        out.append(
            f"model.pad_token_id={m.pad_token_id} is not an id of model.vocab_size={m.vocab_size}; use -1 (none) "
            "or an id below the vocabulary size."
        )
    if m.freeze_pad_embedding and m.pad_token_id >= 0 and tp > 1:
        out.append(
            f"model.freeze_pad_embedding=true with parallel.tp={tp}: tensor parallelism shards the "
            "embedding by vocabulary, where the pad row's lookup gradient is not held out; set "
            "--model.freeze_pad_embedding false (every row trains) or parallel.tp 1."
        )
    return out


def dense_layer_ids(text: str, n_layers: int) -> tuple[int, ...]:
    """model.moe_dense_layers ('0,1') as layer ids; a ConfigError naming the value for anything else."""
    try:
        ids = tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        ids = (-1,)
    if any(not 0 <= i < n_layers for i in ids):
        raise ConfigError(
            f"model.moe_dense_layers={text!r}: give comma-separated layer ids between 0 and model.n_layers - 1 = "
            f"{n_layers - 1}, e.g. '0,1'"
        )
    return ids


def model_args(cfg: Config, model: ModelConfig | None = None):
    """The ``[model]`` section (or ``model``: a transformers folder's, checkpoint/hf_folder.py) as
    ``models.llama.ModelArgs`` (with ``MoEArgs`` for an MoE model)."""
    from models.llama import ModelArgs
    from models.moe import MoEArgs
    from models.rope import RopeScaling

    m = model or cfg.model
    args = ModelArgs(
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        vocab_size=m.vocab_size,
        ffn_dim=m.ffn_dim,
        multiple_of=m.multiple_of,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling=RopeScaling(
            m.rope_scaling,
            m.rope_factor if m.rope_scaling != "none" else 1.0,
            m.rope_low_freq_factor,
            m.rope_high_freq_factor,
            m.rope_original_max_seq_len,
            m.rope_beta_fast,
            m.rope_beta_slow,
            m.rope_mscale,
            m.rope_mscale_all_dim,
            m.rope_truncate,
        ),
        max_seq_len=m.max_seq_len,
        moe_every=m.moe_every,
        tie_embeddings=m.tie_embeddings,
        pad_token_id=m.pad_token_id,
        freeze_pad_embedding=m.freeze_pad_embedding,
        family=m.family,
        qkv_bias=m.qkv_bias,
        qk_norm=m.qk_norm,
        explicit_head_dim=m.head_dim,
        sliding_window=m.sliding_window,
        qk_norm_full=m.qk_norm_full,
        dense_layers=dense_layer_ids(m.moe_dense_layers, m.n_layers),
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=m.rope_interleave,
    )
    if m.n_experts:
        args.moe = MoEArgs(
            n_experts=m.n_experts,
            top_k=m.top_k,
            hidden_dim=m.moe_ffn_dim or max(1, args.hidden_dim // m.top_k),
            n_shared_experts=m.moe_shared_experts,
            score_func=m.moe_score_func,
            route_norm=m.moe_route_norm,
            aux_loss_coef=m.moe_aux_loss_coef,
            aux_loss_form=m.moe_aux_loss_form,
            bias_update_rate=m.moe_bias_update_rate,
            capacity_factor=m.moe_capacity_factor,
            shared_hidden_dim=m.moe_shared_ffn_dim,
            shared_gate=m.moe_shared_gate,
            n_groups=m.moe_groups,
            topk_groups=m.moe_topk_groups,
            route_scale=m.moe_route_scale,
            # the aux loss is summed per sequence and averaged over the global batch, whatever the layout
            aux_loss_scale=1.0 / cfg.training.global_batch,
        )
    return args
