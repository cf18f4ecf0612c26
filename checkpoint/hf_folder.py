"""A transformers model folder (config.json + safetensors) as meshloom's model: its shape, its refusals, its files.

``LlamaForCausalLM(config).save_pretrained(dir)`` writes config.json and either one model.safetensors or
model-0000k-of-0000n.safetensors shards with model.safetensors.index.json (tensor name -> shard file).
Starting a run (or ``python -m generate``) from such a folder:

1. **Refuse what meshloom does not compute** (``unsupported``): another model_type or architecture, biases,
   a sliding window, MoE fields, qk-norm, a head_dim other than hidden_size / num_attention_heads, an
   activation other than SiLU, partial rotary, dropout, a RoPE type other than none/linear/llama3. Each
   problem names the field, its value and what meshloom supports.
2. **Read the shape** (``model_fields``): config.json in either dialect, the legacy top-level
   ``rope_theta`` + ``rope_scaling`` ({"type" or "rope_type": ...}) or the current ``rope_parameters``
   ({"rope_type", "rope_theta", ...}), mapped onto meshloom's ``model.*`` keys.
3. **Adopt it** (``adopt_folder_config``): every ``model.*`` key the folder determines is set from it; one
   the user gave explicitly (TOML or command line) that disagrees is a ConfigError naming both values. This
   runs before any process group, on every rank, so every rank refuses the same way.
4. **Find the tensors** (``weight_files``): the index's map, or every name of the one file.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.config import Config, ConfigError

SUPPORTED = "dense Llama (model_type 'llama', LlamaForCausalLM) with SiLU SwiGLU, no biases, full attention"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# Fields that, when present with anything but these values, mean computation meshloom does not do.
_MUST_BE = {
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "hidden_act": ("silu",),
    "sliding_window": (None,),
    "use_sliding_window": (False,),
    "partial_rotary_factor": (1, 1.0),
    "attention_dropout": (0, 0.0),
    "qk_layernorm": (False,),
    "use_qk_norm": (False,),
    "qk_norm": (False, None),
    "pretraining_tp": (1,),
}
# Any of these with a non-empty, non-zero value makes an MoE model.
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")


def rope_parameters(config: dict) -> dict:
    """The RoPE settings in the current dialect, {"rope_type", "rope_theta", ...}, from either dialect."""
    if isinstance(config.get("rope_parameters"), dict):
        params = dict(config["rope_parameters"])
    else:
        params = dict(config.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:  # the oldest spelling of the legacy dialect
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def unsupported(config: dict) -> list[str]:
    """Step 1: why meshloom cannot compute what ``config`` describes (empty: it can)."""
    out = []
    if config.get("model_type") != "llama":
        out.append(f"config.json model_type={config.get('model_type')!r}: meshloom runs {SUPPORTED}")
    arch = config.get("architectures")
    if arch is not None and arch != ["LlamaForCausalLM"]:
        out.append(f"config.json architectures={arch}: meshloom runs LlamaForCausalLM only ({SUPPORTED})")
    for key, allowed in _MUST_BE.items():
        if key in config and config[key] not in allowed:
            out.append(f"config.json {key}={config[key]!r}: meshloom supports only {allowed[0]!r} ({SUPPORTED})")
    for key in _MOE_FIELDS:
        if config.get(key):
            out.append(f"config.json {key}={config[key]!r} describes MoE layers; meshloom imports {SUPPORTED}")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        out.append(
            f"config.json head_dim={head_dim} but hidden_size / num_attention_heads = {hidden}/{heads}: meshloom's "
            "heads are hidden_size / num_attention_heads wide"
        )
    rope = rope_parameters(config)
    kind = rope["rope_type"]
    if kind not in ("default", "linear", "llama3"):
        out.append(f"config.json RoPE type {kind!r} is not supported; meshloom supports default (none), linear, llama3")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(f"config.json partial_rotary_factor={rope['partial_rotary_factor']}: meshloom rotates whole heads")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if not isinstance(config.get(key), int):
            out.append(f"config.json {key}={config.get(key)!r}: a Llama config needs it as an integer")
    return out


def model_fields(config: dict) -> dict[str, object]:
    """Step 2: meshloom ``model.*`` key (without ``model.``) -> value, for a config ``unsupported`` accepts."""
    rope = rope_parameters(config)
    kind = {"default": "none"}.get(rope["rope_type"], rope["rope_type"])
    fields = {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "ffn_dim": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope["rope_theta"]),
        "max_seq_len": config.get("max_position_embeddings", 2048),
        "rope_scaling": kind,
        "n_experts": 0,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),  # transformers leaves lm_head out
    }
    if kind in ("linear", "llama3"):
        fields["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        fields["rope_low_freq_factor"] = float(rope["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        fields["rope_original_max_seq_len"] = int(
            rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 8192)
        )
    return fields


def folder_of(init_from: str | Path) -> Path | None:
    """The folder whose config.json describes ``init_from`` (the folder, or a .safetensors file in it); None
    when there is no config.json (a bare safetensors file: the model.* keys describe the model)."""
    path = Path(init_from).expanduser()
    folder = path if path.is_dir() else path.parent
    return folder if (folder / "config.json").is_file() else None


def read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{folder / 'config.json'} cannot be read as JSON ({exc}); is it a transformers folder?"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{folder / 'config.json'} is not a JSON object; is it a transformers folder?") from None
    return config


def checked_fields(folder: Path, field: str) -> dict[str, object]:
    """Steps 1-2 for ``folder``; a ConfigError listing every unsupported field (``field``: the option that
    named the folder, for the message)."""
    config = read_config(folder)
    problems = unsupported(config)
    if problems:
        raise ConfigError(f"{field}={str(folder)!r} is a model meshloom cannot run:\n  - " + "\n  - ".join(problems))
    return model_fields(config)


def adopt_folder_config(cfg: Config) -> None:
    """Step 3: the [model] section from ``checkpoint.init_from``'s config.json, if it has one."""
    if not cfg.checkpoint.init_from:
        return
    folder = folder_of(cfg.checkpoint.init_from)
    if folder is None:
        return
    fields = checked_fields(folder, "checkpoint.init_from")
    explicit = getattr(cfg, "explicit_keys", frozenset())
    clashes = []
    for name, value in fields.items():
        mine = getattr(cfg.model, name)
        if name == "ffn_dim" and mine == 0:  # 0: derived from dim by Llama's rule; compare what it derives
            from runtime.config import model_args

            mine = model_args(cfg).hidden_dim
        if f"model.{name}" in explicit and mine != value:
            clashes.append(
                f"model.{name}={mine!r} was given, but {folder / 'config.json'} says {value!r}; drop "
                f"--model.{name} (the folder sets the model's shape)"
            )
        setattr(cfg.model, name, type(getattr(cfg.model, name))(value))
    if clashes:
        raise ConfigError("the model given disagrees with checkpoint.init_from:\n  - " + "\n  - ".join(clashes))


def weight_files(folder: Path) -> dict[str, Path]:
    """Step 4: tensor name -> the safetensors file holding it (from the index, or the one file)."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        return {name: folder / file for name, file in index["weight_map"].items()}
    with safe_open(str(folder / SINGLE), framework="pt") as f:
        return {name: folder / SINGLE for name in f.keys()}


def is_model_folder(path: Path) -> bool:
    """config.json with one model.safetensors or an index of shards."""
    return (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())
