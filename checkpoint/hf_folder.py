"""A transformers model folder (config.json + safetensors) as meshloom's model: its shape, its refusals, its files.

``LlamaForCausalLM(config).save_pretrained(dir)`` writes config.json and either one model.safetensors or
model-0000k-of-0000n.safetensors shards with model.safetensors.index.json (tensor name -> shard file).
Starting a run (or ``python -m generate``) from such a folder:

1. **Refuse what meshloom does not compute** (``unsupported``): a model_type or architecture outside the
   families below, biases the family does not have, a sliding window that binds (see below), MoE fields in a
   dense family, an activation other than SiLU, partial rotary, dropout, a RoPE type other than
   none/linear/llama3/yarn, and each MoE family's own extras (``moe_unsupported``); GPT-OSS gets one line per piece
   meshloom lacks (``GPT_OSS_MISSING``). Each problem names the field, its value and what meshloom supports.

   The families (``FAMILIES``) are one decoder with two switches (models/llama.py):

   | family  | architectures        | differs from Llama                                 | meshloom model.*        |
   |---------|----------------------|----------------------------------------------------|-------------------------|
   | llama   | LlamaForCausalLM     | (the reference)                                    |                         |
   | mistral | MistralForCausalLM   | its defaults only; ``sliding_window`` (see below)  | sliding_window          |
   | qwen2   | Qwen2ForCausalLM     | q/k/v projections have biases (o has none)         | qkv_bias = true         |
   | qwen3   | Qwen3ForCausalLM     | RMSNorm per q and k head before RoPE; own head_dim | qk_norm = true, head_dim|

   The MoE families (``MOE_FAMILIES``; their fields: ``moe_fields``, docs/checkpointing.md, Appendix B):

   | family      | architectures          | MoE layers                                          | attention         |
   |-------------|------------------------|-----------------------------------------------------|-------------------|
   | mixtral     | MixtralForCausalLM     | softmax top-k, renormalised; every layer            | Mistral's         |
   | qwen2_moe   | Qwen2MoeForCausalLM    | norm_topk_prob; a shared expert times sigmoid(gate); decoder_sparse_step, mlp_only_layers | q/k/v biases |
   | qwen3_moe   | Qwen3MoeForCausalLM    | norm_topk_prob; decoder_sparse_step, mlp_only_layers | Qwen3's q/k norms |
   | olmoe       | OlmoeForCausalLM       | norm_topk_prob; every layer                         | q/k norms over the whole projection |
   | deepseek_v3 | DeepseekV3ForCausalLM  | sigmoid, correction bias, group-limited, scaled; shared experts; first k dense | latent (MLA) |

   Any of them may give ``head_dim`` (model.head_dim; 0 when it is hidden_size / num_attention_heads).
   A sliding window is accepted as a limit: meshloom computes full causal attention, which equals windowed
   attention as long as no sequence is longer than the window, so ``model.sliding_window`` records it and a
   longer ``training.seq_len`` (or generation) is refused. Qwen's ``sliding_window`` counts only with
   ``use_sliding_window: true`` (transformers ignores it otherwise).
2. **Read the shape** (``model_fields``): config.json in either dialect, the legacy top-level
   ``rope_theta`` + ``rope_scaling`` ({"type" or "rope_type": ...}) or the current ``rope_parameters``
   ({"rope_type", "rope_theta", ...}), mapped onto meshloom's ``model.*`` keys.
3. **Adopt it** (``folder_model``): every ``model.*`` key the folder determines is taken from it, into the plan (the config stays as written); one
   the user gave explicitly (TOML or command line) that disagrees is a ConfigError naming both values. This
   runs before any process group, on every rank, so every rank refuses the same way.
4. **Find the tensors** (``weight_files``): the index's map, or every name of the one file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import ConfigError
from runtime.files import read_json_object

if TYPE_CHECKING:
    from runtime.schema import Config, ModelConfig

# model_type -> (the architecture transformers writes, the biases its attention has)
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    # the MoE families (the module docstring's second table)
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
SUPPORTED = "Llama-family decoders with SiLU SwiGLU: " + ", ".join(
    f"{arch} (model_type {kind!r})" for kind, arch in FAMILIES.items()
)
# GPT-OSS: what its folder computes that meshloom does not (``gpt_oss_refusal``), each with what it would take; the
# {fields} are the folder's own values. (Its YaRN RoPE is not among them: models/rope.py computes it.)
GPT_OSS_MISSING = (
    "attention sinks (self_attn.sinks: a learned per-head logit in every softmax's denominator; needs an "
    "attention kernel that takes it, SDPA has none)",
    "alternating sliding-window attention (layer_types {layer_types}, sliding_window {sliding_window}: "
    "meshloom has one full causal attention; needs a per-layer window in models/llama.causal_attention and CP)",
    "biases on q/k/v/o, the router and the experts (attention_bias {attention_bias}, gate_up_proj_bias, "
    "down_proj_bias: GroupedExperts has no bias)",
    "a clamped SwiGLU (swiglu_limit {swiglu_limit}, (up + 1) * gate * sigmoid(1.702 * gate): "
    "meshloom's experts compute silu(gate) * up)",
    "MXFP4 expert weights where a folder has them (quantization_config quant_method {quant_method}; the released "
    "folders' 'mxfp4': blocks and scales to dequantize on import)",
)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# Fields that, when present with anything but these values, mean computation meshloom does not do.
_MUST_BE = {
    "attention_bias": (False,),  # Llama/Qwen3: biases on q, k, v *and* o (Qwen2's q/k/v biases are implicit)
    "mlp_bias": (False,),
    "hidden_act": ("silu",),
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


def gpt_oss_refusal(config: dict) -> list[str]:
    """A GPT-OSS folder: one line per piece meshloom lacks (``GPT_OSS_MISSING``), naming what it would take."""
    types = config.get("layer_types") or []
    values = {
        "layer_types": ", ".join(f"{types.count(t)} x {t}" for t in dict.fromkeys(types)) or "absent",
        "sliding_window": repr(config.get("sliding_window")),
        "attention_bias": repr(config.get("attention_bias")),
        "swiglu_limit": repr(config.get("swiglu_limit")),
        "quant_method": repr((config.get("quantization_config") or {}).get("quant_method")),
    }
    return [
        f"config.json model_type={config.get('model_type')!r} (GPT-OSS) needs {piece.format(**values)}"
        for piece in GPT_OSS_MISSING
    ]


def moe_unsupported(config: dict) -> list[str]:
    """The MoE families' own refusals (step 1): the values their classes allow but meshloom does not compute."""
    kind, out = config["model_type"], []
    if kind == "mixtral" and config.get("router_jitter_noise", 0.0):
        out.append(
            f"config.json router_jitter_noise={config['router_jitter_noise']!r}: meshloom's router adds no "
            "multiplicative noise in training; supported: 0.0"
        )
    if kind == "olmoe" and config.get("clip_qkv") is not None:
        out.append(f"config.json clip_qkv={config['clip_qkv']!r}: meshloom does not clamp q/k/v; supported: null")
    if kind == "qwen2_moe" and not config.get("shared_expert_intermediate_size"):
        out.append(
            f"config.json shared_expert_intermediate_size={config.get('shared_expert_intermediate_size')!r}: a "
            "Qwen2-MoE layer has a shared expert; supported: a positive size"
        )
    if kind == "deepseek_v3":
        # fields of DeepSeek's own config.json that transformers' class does not read: the values it computes
        for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if config.get(key, value) != value:
                out.append(f"config.json {key}={config[key]!r}: DeepSeek-V3 routes as {key}={value!r}; supported: that")
        heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
        if kv_heads not in (None, heads):
            out.append(
                f"config.json num_key_value_heads={kv_heads!r}: latent attention expands keys and values for every "
                f"head; supported: num_key_value_heads = num_attention_heads = {heads!r}"
            )
        experts, groups = config.get("n_routed_experts") or 0, config.get("n_group") or 1
        if experts % groups or not 1 <= (config.get("topk_group") or 1) <= groups:
            out.append(
                f"config.json n_group={groups!r}, topk_group={config.get('topk_group')!r}: supported: n_group divides "
                f"n_routed_experts={experts} and 1 <= topk_group <= n_group"
            )
        if experts // groups < 2 and groups > 1:
            out.append(f"config.json n_group={groups}: a group's score is its best two experts; give >= 2 per group")
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if not isinstance(config.get(key), int) or config[key] < 1:
                out.append(f"config.json {key}={config.get(key)!r}: latent attention needs it as a positive integer")
        if isinstance(config.get("qk_rope_head_dim"), int) and config["qk_rope_head_dim"] % 2:
            out.append(f"config.json qk_rope_head_dim={config['qk_rope_head_dim']}: RoPE needs an even width")
    top_k, experts = config.get("num_experts_per_tok"), moe_experts(config)
    if not isinstance(top_k, int) or not isinstance(experts, int) or not 1 <= top_k <= experts:
        out.append(
            f"config.json num_experts_per_tok={top_k!r} with {experts!r} experts: supported: 1 <= top-k <= experts"
        )
    return out


def moe_experts(config: dict):
    """The routed-expert count, under each family's name for it."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key) is not None:
            return config[key]
    return None


def unsupported(config: dict) -> list[str]:
    """Step 1: why meshloom cannot compute what ``config`` describes (empty: it can)."""
    if config.get("model_type") == "gpt_oss":
        return gpt_oss_refusal(config)
    out = []
    kind = config.get("model_type")
    if kind not in FAMILIES:
        out.append(f"config.json model_type={kind!r}: meshloom runs {SUPPORTED}")
    arch = config.get("architectures")
    if arch is not None and (kind not in FAMILIES or arch != [FAMILIES[kind]]):
        out.append(f"config.json architectures={arch}: meshloom runs {SUPPORTED}")
    if kind == "llama" and config.get("sliding_window") is not None:  # LlamaForCausalLM has no window to apply
        out.append(
            f"config.json sliding_window={config['sliding_window']!r}: a Llama config has no sliding window; "
            f"meshloom runs full attention ({SUPPORTED}; Mistral and Qwen may give one)"
        )
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if layer_types - {"full_attention", "sliding_attention"}:
        out.append(f"config.json layer_types={sorted(layer_types)}: meshloom runs full attention ({SUPPORTED})")
    moe = kind in MOE_FAMILIES
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        out.append(
            f"config.json quantization_config (quant_method {method!r}): supported: unquantized weights "
            "(fp32/bf16/fp16 safetensors); dequantize the folder first (e.g. load it in transformers and save_pretrained)"
        )
    for key, allowed in _MUST_BE.items():
        if key in config and config[key] not in allowed:
            out.append(f"config.json {key}={config[key]!r}: meshloom supports only {allowed[0]!r} ({SUPPORTED})")
    for key in () if moe else _MOE_FIELDS:
        if config.get(key):
            out.append(
                f"config.json {key}={config[key]!r} describes MoE layers, which a {kind!r} model has not; meshloom "
                f"imports MoE as model_type {', '.join(MOE_FAMILIES)}"
            )
    if moe:
        out += moe_unsupported(config)
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        out.append(f"config.json head_dim={head_dim!r}: a head must be an even number of channels (RoPE pairs)")
    rope = rope_parameters(config)
    kind = rope["rope_type"]
    if kind not in ("default", "linear", "llama3", "yarn"):
        out.append(
            f"config.json RoPE type {kind!r} is not supported; meshloom supports default (none), linear, llama3, yarn"
        )
    if kind == "yarn" and rope.get("attention_factor") is not None:
        out.append(
            f"config.json rope attention_factor={rope['attention_factor']!r}: supported: none given (meshloom derives "
            "YaRN's factor from factor, mscale and mscale_all_dim)"
        )
    if kind == "yarn" and not (rope.get("factor") or rope.get("original_max_position_embeddings")):
        out.append("config.json YaRN RoPE without factor or original_max_position_embeddings: give one of them")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(f"config.json partial_rotary_factor={rope['partial_rotary_factor']}: meshloom rotates whole heads")
    if config.get("model_type") == "deepseek_v3" and rope["rope_type"] not in ("default", "yarn"):
        out.append(
            f"config.json RoPE type {rope['rope_type']!r} with latent attention: supported there: default (none), yarn"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if not isinstance(config.get(key), int):
            out.append(f"config.json {key}={config.get(key)!r}: a Llama config needs it as an integer")
    for key in ("num_key_value_heads", "max_position_embeddings"):  # optional: null or absent means the default
        if config.get(key) is not None and (not isinstance(config[key], int) or isinstance(config[key], bool)):
            out.append(f"config.json {key}={config[key]!r}: needs an integer")
    for key, value in (("rms_norm_eps", config.get("rms_norm_eps", 1e-6)), ("rope_theta", rope.get("rope_theta", 1.0))):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append(f"config.json {key}={value!r}: needs a number")
    return out


# config.json's name for each model.* field a range check can refuse (the message names the file's key)
HF_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
}


def checked_model(config: dict, where: str) -> dict[str, object]:
    """Steps 1-2 and every field's range: the ``model.*`` fields ``config`` gives, or one ConfigError naming
    ``where`` (the config.json) and every problem. Training (``checked_fields``) and generation
    (checkpoint/hf.py: ``model_args_from_hf_config``) both read a folder through it."""
    from runtime.config import section_problems
    from runtime.schema import ModelConfig

    problems = unsupported(config)
    if problems:
        raise ConfigError(f"{where} is a model meshloom cannot run:\n  - " + "\n  - ".join(problems))
    try:
        fields = model_fields(config)
        model = dataclasses.replace(ModelConfig(), **{k: type(getattr(ModelConfig(), k))(v) for k, v in fields.items()})
    except (ArithmeticError, KeyError, TypeError, ValueError) as exc:  # e.g. num_attention_heads 0, a missing key
        raise ConfigError(
            f"{where} cannot be read as a model ({type(exc).__name__}: {exc}); is it a transformers folder?"
        ) from None
    broken = section_problems("model", model)
    if broken:
        named = [
            next(
                (f"config.json {hf}: {line}" for name, hf in HF_KEYS.items() if line.startswith(f"model.{name}=")), line
            )
            for line in broken
        ]
        raise ConfigError(f"{where} describes a model out of range:\n  - " + "\n  - ".join(named))
    return fields


def model_fields(config: dict) -> dict[str, object]:
    """Step 2: meshloom ``model.*`` key (without ``model.``) -> value, for a config ``unsupported`` accepts."""
    rope = rope_parameters(config)
    kind = {"default": "none"}.get(rope["rope_type"], rope["rope_type"])
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
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
        "family": config["model_type"],
        "qkv_bias": config["model_type"] == "qwen2"
        or (config["model_type"] == "qwen2_moe" and config.get("qkv_bias", True)),
        "qk_norm": config["model_type"] in ("qwen3", "qwen3_moe", "olmoe"),
        # 0 when it is the Llama rule, so the run's config (and its checkpoint's meshloom.json) says so
        "head_dim": 0 if head_dim * heads == hidden else head_dim,
        "sliding_window": window(config),
        # transformers builds nn.Embedding(padding_idx=pad_token_id); model.freeze_pad_embedding chooses whether
        # meshloom holds that row's lookup gradient out the same way (docs/checkpointing.md)
        "pad_token_id": pad_id(config),
    }
    if config["model_type"] in MOE_FAMILIES:
        fields.update(moe_fields(config))
    if kind == "yarn":  # transformers' defaults where a field is missing (modeling_rope_utils: yarn)
        original = int(rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 8192))
        factor = rope.get("factor") or config.get("max_position_embeddings", original) / original
        fields.update(
            rope_factor=float(factor),
            rope_original_max_seq_len=original,
            rope_beta_fast=float(rope.get("beta_fast") or 32.0),
            rope_beta_slow=float(rope.get("beta_slow") or 1.0),
            rope_mscale=float(rope.get("mscale") or 0.0),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            rope_truncate=bool(rope.get("truncate", True)),
        )
    if kind in ("linear", "llama3"):
        fields["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        fields["rope_low_freq_factor"] = float(rope["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(rope["high_freq_factor"])
        fields["rope_original_max_seq_len"] = int(
            rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 8192)
        )
    return fields


def pad_id(config: dict) -> int:
    """config.json's pad_token_id as meshloom's model.pad_token_id (-1: none, or not an id of the vocabulary)."""
    pad = config.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < config["vocab_size"] else -1


def moe_fields(config: dict) -> dict[str, object]:
    """Step 2 for the MoE families: model.* key -> value (the module docstring's second table)."""
    kind = config["model_type"]
    moe_hidden = config.get("moe_intermediate_size") or config["intermediate_size"]  # Mixtral, OLMoE: the latter
    fields = {
        "n_experts": moe_experts(config),
        "top_k": config["num_experts_per_tok"],
        "moe_ffn_dim": moe_hidden,
        "moe_every": config.get("decoder_sparse_step") or 1,
        "moe_dense_layers": ",".join(str(i) for i in sorted(config.get("mlp_only_layers") or [])),
        "moe_route_norm": kind == "mixtral" or bool(config.get("norm_topk_prob", False)),
        "moe_score_func": "sigmoid" if kind == "deepseek_v3" else "softmax",
        "moe_shared_experts": 0,
        "moe_shared_ffn_dim": 0,
        "moe_shared_gate": False,
        "moe_groups": 1,
        "moe_topk_groups": 1,
        "moe_route_scale": 1.0,
        # transformers adds its auxiliary loss only with output_router_logits (DeepSeek-V3's class: never), by its
        # own formula over the whole forward (model.moe_aux_loss_form, models/moe.py)
        "moe_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.0))
        if config.get("output_router_logits") and kind != "deepseek_v3"
        else 0.0,
        "qk_norm_full": kind == "olmoe",
    }
    if kind == "qwen2_moe":
        fields.update(moe_shared_experts=1, moe_shared_ffn_dim=config["shared_expert_intermediate_size"])
        fields["moe_shared_gate"] = True
    if kind == "deepseek_v3":
        shared = config.get("n_shared_experts") or 0
        fields.update(
            moe_shared_experts=1 if shared else 0,
            moe_shared_ffn_dim=shared * moe_hidden,
            moe_dense_layers=",".join(str(i) for i in range(config.get("first_k_dense_replace") or 0)),
            moe_groups=config.get("n_group") or 1,
            moe_topk_groups=config.get("topk_group") or 1,
            moe_route_scale=float(config.get("routed_scaling_factor", 1.0)),
            q_lora_rank=config.get("q_lora_rank") or 0,
            kv_lora_rank=config["kv_lora_rank"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            head_dim=config["qk_nope_head_dim"],  # meshloom's head_dim is the nope part (models/latent_attention.py)
            rope_interleave=bool(config.get("rope_interleave", True)),
            n_kv_heads=config["num_attention_heads"],
        )
    return fields


def window(config: dict) -> int:
    """The sliding window transformers applies for ``config`` (0: none). Mistral: ``sliding_window`` when not
    null. Qwen2/3: only with ``use_sliding_window`` (transformers sets it to None otherwise), on the layers
    ``layer_types`` (or ``max_window_layers``) name; meshloom keeps one window for all, the strictest."""
    size = config.get("sliding_window")
    if config.get("model_type") == "llama":  # refused by ``unsupported`` when set
        return 0
    if config.get("model_type") in ("olmoe", "deepseek_v3"):  # no sliding window in these classes
        return 0
    if config.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not config.get(
        "use_sliding_window", False
    ):
        return 0
    if config.get("layer_types") and "sliding_attention" not in config["layer_types"]:
        return 0
    return int(size or 0)


def folder_of(init_from: str | Path) -> Path | None:
    """The folder whose config.json describes ``init_from`` (the folder, or a .safetensors file in it); None
    when there is no config.json (a bare safetensors file: the model.* keys describe the model)."""
    path = Path(init_from).expanduser()
    folder = path if path.is_dir() else path.parent
    return folder if (folder / "config.json").is_file() else None


def read_config(folder: Path) -> dict:
    return read_json_object(folder / "config.json", "is it a transformers folder?")


def checked_fields(folder: Path, field: str) -> dict[str, object]:
    """Steps 1-2 for ``folder``; a ConfigError listing every unsupported field (``field``: the option that
    named the folder, for the message)."""
    return checked_model(read_config(folder), f"{field}={str(folder)!r}")


def folder_model(cfg: Config) -> ModelConfig:
    """Step 3: the [model] section the run trains: ``checkpoint.init_from``'s config.json over the config's own
    (a copy; the config is left as the user wrote it), or the config's own when there is no folder."""
    if not cfg.checkpoint.init_from:
        return cfg.model
    if not Path(cfg.checkpoint.init_from).expanduser().exists():
        raise ConfigError(
            f"checkpoint.init_from={cfg.checkpoint.init_from!r}: no such folder or file; give a transformers folder "
            "(config.json + safetensors) or a .safetensors file."
        )
    folder = folder_of(cfg.checkpoint.init_from)
    if folder is None:
        return cfg.model
    fields = checked_fields(folder, "checkpoint.init_from")
    if fields["sliding_window"] and cfg.training.seq_len > fields["sliding_window"]:
        raise ConfigError(
            f"checkpoint.init_from={str(folder)!r} has a sliding window of {fields['sliding_window']} tokens, and "
            f"training.seq_len={cfg.training.seq_len} is longer: meshloom computes full attention, which equals the "
            f"windowed attention only while a sequence fits in the window; set training.seq_len <= "
            f"{fields['sliding_window']}."
        )
    explicit = getattr(cfg, "explicit_keys", frozenset())
    clashes, values = [], {}
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
        values[name] = type(getattr(cfg.model, name))(value)
    if clashes:
        raise ConfigError("the model given disagrees with checkpoint.init_from:\n  - " + "\n  - ".join(clashes))
    from runtime.config import pad_problems

    # transformers' default fine-tune: nn.Embedding(padding_idx=pad_token_id) gives the pad row no lookup gradient.
    # Unless the key was given, meshloom does the same where the embedding is whole (tp 1; tensor parallelism
    # shards it by vocabulary, where the row is not held out: there every row trains, docs/checkpointing.md).
    if "model.freeze_pad_embedding" not in explicit:
        values["freeze_pad_embedding"] = fields["pad_token_id"] >= 0 and cfg.parallel.tp == 1
    if "model.moe_aux_loss_form" not in explicit and fields.get("moe_aux_loss_coef"):
        values["moe_aux_loss_form"] = "transformers"  # the loss the folder's own class adds (models/moe.py)
    model = dataclasses.replace(cfg.model, **values)
    problems = pad_problems(model, cfg.parallel.tp)
    if problems:
        raise ConfigError(f"checkpoint.init_from={str(folder)!r}: " + "; ".join(problems))
    return model


def weight_files(folder: Path) -> dict[str, Path]:
    """Step 4: tensor name -> the safetensors file holding it (from the index, or the one file)."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        fix = "export the folder again (its index lists each tensor's shard)."
        weight_map = read_json_object(folder / INDEX, fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{folder / INDEX}: has no 'weight_map' object of tensor name -> file name; {fix}")
        files = {name: folder / file for name, file in weight_map.items()}
        if (folder / SINGLE).is_file() and set(files.values()) != {folder / SINGLE}:
            # transformers reads the single file, an index reader the shards: two models under one name
            raise ConfigError(
                f"{folder} holds both {SINGLE} and {INDEX}, which names other files: two exports mixed in one "
                "folder, and which weights load depends on the reader. Export again into a new folder (or with "
                "--overwrite, which replaces the folder whole), or remove the stale files."
            )
        return files
    with safe_open(str(folder / SINGLE), framework="pt") as f:
        return {name: folder / SINGLE for name in f.keys()}


def is_model_folder(path: Path) -> bool:
    """config.json with one model.safetensors or an index of shards."""
    return (path / "config.json").is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())
