"""Hugging Face Llama names: export a model to safetensors + config.json, import one as initial weights.

meshloom's decoder is the Llama architecture, so only the names differ (table below). Our RoPE rotates
(x_i, x_{i+d/2}) pairs ("rotate_half"), as Hugging Face's LlamaForCausalLM does, so q/k weights need no
permutation (Meta's original checkpoints, with interleaved pairs, are the ones that do); a grouped-query
key/value head serves consecutive query heads in both. tests/test_checkpoint.py compares the logits.

| meshloom                               | Hugging Face                                      |
|----------------------------------------|---------------------------------------------------|
| tok_embeddings.weight                  | model.embed_tokens.weight                         |
| layers.N.attention_norm.weight         | model.layers.N.input_layernorm.weight             |
| layers.N.attention.wq/wk/wv/wo.weight  | model.layers.N.self_attn.q_proj/k_proj/v_proj/o_proj.weight |
| layers.N.attention.wq/wk/wv.bias       | model.layers.N.self_attn.q_proj/k_proj/v_proj.bias (Qwen2)  |
| layers.N.attention.q_norm/k_norm.weight| model.layers.N.self_attn.q_norm/k_norm.weight (Qwen3)       |
| layers.N.ffn_norm.weight               | model.layers.N.post_attention_layernorm.weight    |
| layers.N.feed_forward.w1/w3/w2.weight  | model.layers.N.mlp.gate_proj/up_proj/down_proj.weight |
| norm.weight                            | model.norm.weight                                 |
| output.weight                          | lm_head.weight                                    |

The MoE families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3) add their router, shared expert, latent attention
and per-expert names (``in_layer_names``, ``expert_names``; docs/checkpointing.md, Appendix B): save_pretrained
writes one (out, in) matrix per expert, and meshloom's (E, in, out) expert weights are read from and written to
those (``ExpertStack``, ``hf_tensors``).

Import (``checkpoint.init_from``, a file or a transformers folder, checkpoint/hf_folder.py) reads, for each
parameter, only the block of the stored tensor that this rank holds (``safe_open(...).get_slice(name)``
indexed by the piece's offset and shape, from the DTensor's placements), one tensor at a time, with no
communication. A piece that is not one block (``_StridedShard``: FSDP over TP on the same dim) is cut from
the full tensor with ``distribute_tensor(..., src_data_rank=None)``. Export writes shards plus an index above
``--max-shard-size``, as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from checkpoint.hf_folder import is_model_folder, weight_files
from mesh.materialize import canonical_name
from mesh.private_api import contiguous_block
from models.llama import ModelArgs, Transformer
from models.local_tensor import local_tensor
from runtime.config import ConfigError
from runtime.files import read_json_object

TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
IN_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# The order of LlamaForCausalLM's state_dict (its modules' registration order), which save_pretrained fills
# its files in: the embedding, then per layer attention, MLP and the two norms, then the final norm, the head.
_HF_LAYER_ORDER = [
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def hf_order(name: str) -> tuple:
    """Sort key of an HF tensor name in LlamaForCausalLM's state_dict order (other names of a layer after
    those, by name: the MoE families' experts and router)."""
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if match:
        rest = match.group(2)
        known = _HF_LAYER_ORDER.index(rest) if rest in _HF_LAYER_ORDER else len(_HF_LAYER_ORDER)
        return (1, int(match.group(1)), known, rest)
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, 0, "")


# The MoE families' names inside a layer (the module docstring's second table). Where save_pretrained writes
# an MoE layer: Mixtral under block_sparse_moe (w1/w3/w2 per expert), the others under mlp (gate/up/down_proj).
_LATENT = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_SHARED = {"qwen2_moe": "mlp.shared_expert", "deepseek_v3": "mlp.shared_experts"}


def moe_prefix(family: str) -> str:
    return "block_sparse_moe" if family == "mixtral" else "mlp"


def expert_names(family: str) -> dict[str, str]:
    """meshloom expert weight (E, in, out) -> the HF name of expert e's (out, in) matrix, with {e} for e."""
    w = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    return {
        f"feed_forward.experts.{m}": f"{moe_prefix(family)}.experts.{{e}}.{h}.weight"
        for m, h in zip(("w1", "w3", "w2"), w, strict=True)
    }


def in_layer_names(family: str) -> dict[str, str]:
    """meshloom name inside a layer -> the HF name inside model.layers.N (experts: ``expert_names``)."""
    names = dict(IN_LAYER)
    if family == "deepseek_v3":
        names.update(_LATENT)
    prefix = moe_prefix(family)
    names["feed_forward.router.gate.weight"] = f"{prefix}.gate.weight"
    if family in _SHARED:
        for m, h in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            names[f"feed_forward.shared_expert.{m}.weight"] = f"{_SHARED[family]}.{h}.weight"
    if family == "qwen2_moe":
        names["feed_forward.shared_gate.weight"] = "mlp.shared_expert_gate.weight"
    if family == "deepseek_v3":
        names["feed_forward.expert_bias"] = "mlp.gate.e_score_correction_bias"
    return names


def hf_name(name: str, family: str = "llama") -> str:
    """The Hugging Face name of meshloom tensor ``name`` in ``family``'s files; ValueError for names it lacks."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    match = _LAYER.match(name)
    names = in_layer_names(family)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise ValueError(f"{name!r} has no name in a transformers {family!r} folder")


def hf_expert_names(name: str, family: str, n_experts: int) -> list[str] | None:
    """The HF names of an expert weight's n_experts matrices (each the transpose of one expert's slice), or
    None when ``name`` is not an expert weight."""
    match = _LAYER.match(name)
    pattern = expert_names(family).get(match.group(2)) if match else None
    if pattern is None:
        return None
    return [f"model.layers.{match.group(1)}.{pattern.format(e=e)}" for e in range(n_experts)]


def hf_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """meshloom tensor -> the HF tensors that hold it: one, or (experts) one transposed matrix per expert."""
    experts = hf_expert_names(name, args.family, tensor.shape[0]) if args.moe is not None else None
    if experts is not None:
        return {hf: tensor[e].t() for e, hf in enumerate(experts)}
    return {hf_name(name, args.family): tensor}


def hf_config(
    args: ModelArgs, eos_token_id: int | None = None, dtype: str = "float32", pad_token_id: int | None = None
) -> dict:
    """A config.json that ``AutoModelForCausalLM.from_pretrained`` reads as this family (``FAMILIES``), RoPE as
    ``rope_parameters`` (transformers >= 5); no BOS and the tokenizer's EOS, so ``generate`` stops where ours does."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    s = args.rope_scaling
    if s.kind in ("linear", "llama3"):
        rope.update(rope_type=s.kind, factor=s.factor)
    if s.kind == "yarn":
        rope.update(
            rope_type="yarn",
            factor=s.factor,
            original_max_position_embeddings=s.original_max_seq_len,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
            truncate=s.truncate,
            **({"mscale": s.mscale} if s.mscale else {}),
            **({"mscale_all_dim": s.mscale_all_dim} if s.mscale_all_dim else {}),
        )
    if s.kind == "llama3":
        rope.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_seq_len,
        )
    from checkpoint.hf_folder import FAMILIES

    expected = {
        "qwen2": (True, False),
        "qwen3": (False, True),
        "qwen2_moe": (args.qkv_bias, False),
        "qwen3_moe": (False, True),
        "olmoe": (False, True),
    }.get(args.family, (False, False))
    if (args.qkv_bias, args.qk_norm) != expected or args.qk_norm_full != (args.family == "olmoe"):
        raise ValueError(
            f"model.family={args.family!r} with qkv_bias={args.qkv_bias}, qk_norm={args.qk_norm}: no transformers "
            "class computes that (Qwen2 has the q/k/v biases, Qwen3 the q/k norms, Llama and Mistral neither)"
        )
    family = moe_config(args) if args.moe is not None else {}
    if args.family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        family.update(use_sliding_window=bool(args.sliding_window), sliding_window=args.sliding_window or None)
        family["max_window_layers"] = 0 if args.sliding_window else args.n_layers
    elif args.family in ("mistral", "mixtral"):
        family["sliding_window"] = args.sliding_window or None
    elif args.sliding_window:
        raise ValueError(f"model.sliding_window={args.sliding_window}: a Llama config has no sliding window")
    return {
        "architectures": [FAMILIES[args.family]],
        "model_type": args.family,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        **({} if args.family == "qwen2" else {"attention_bias": False}),
        **({"mlp_bias": False} if args.family == "llama" else {}),
        "tie_word_embeddings": args.tie_embeddings,
        **family,  # after the common fields: the MoE families override some (Mixtral's intermediate_size)
        "dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        **({"pad_token_id": pad} if (pad := args.pad_token_id if pad_token_id is None else pad_token_id) >= 0 else {}),
    }


def moe_config(args: ModelArgs) -> dict:
    """The MoE family's config.json fields: every one its import reads (checkpoint/hf_folder.moe_fields), or a
    ValueError naming the model.* value the family's transformers class cannot compute."""
    m, kind = args.moe, args.family
    problems = []
    if m.capacity_factor > 0:
        problems.append(f"model.moe_capacity_factor={m.capacity_factor}: transformers' MoE classes are dropless (0)")
    if kind != "deepseek_v3" and (m.score_func != "softmax" or m.n_groups > 1 or m.route_scale != 1.0):
        problems.append(
            f"model.moe_score_func={m.score_func!r}, moe_groups={m.n_groups}, moe_route_scale={m.route_scale}: "
            f"{kind} routes by softmax, ungrouped, unscaled (DeepSeek-V3 alone has sigmoid, groups and a scale)"
        )
    if kind in ("mixtral", "olmoe") and (args.dense_layers or args.moe_every != 1 or m.n_shared_experts):
        problems.append(
            f"model.moe_dense_layers={args.dense_layers}, moe_every={args.moe_every}, moe_shared_experts="
            f"{m.n_shared_experts}: every {kind} layer is MoE without a shared expert"
        )
    if kind == "mixtral" and not m.route_norm:
        problems.append("model.moe_route_norm=false: Mixtral always renormalises the top-k gates")
    if kind == "qwen3_moe" and m.n_shared_experts:
        problems.append(f"model.moe_shared_experts={m.n_shared_experts}: Qwen3-MoE has no shared expert")
    if kind == "qwen2_moe" and not (m.n_shared_experts and m.shared_gate):
        problems.append("model.moe_shared_experts / moe_shared_gate: a Qwen2-MoE layer has one gated shared expert")
    if kind != "qwen2_moe" and m.shared_gate:
        problems.append(f"model.moe_shared_gate=true: only Qwen2-MoE gates its shared expert, not {kind}")
    shared = m.shared_hidden_dim or args.hidden_dim
    if kind == "deepseek_v3":
        if args.dense_layers != tuple(range(len(args.dense_layers))) or args.moe_every != 1:
            problems.append(
                f"model.moe_dense_layers={args.dense_layers}, moe_every={args.moe_every}: DeepSeek-V3's dense layers "
                "are the first k (first_k_dense_replace), every later one MoE"
            )
        if m.n_shared_experts and shared % m.hidden_dim:
            problems.append(
                f"model.moe_shared_ffn_dim={shared}: DeepSeek-V3's shared experts are n_shared_experts x "
                f"moe_intermediate_size={m.hidden_dim} wide"
            )
    if problems:
        raise ValueError(f"model.family={kind!r} cannot be written as that family: " + "; ".join(problems))
    aux = {"output_router_logits": m.aux_loss_coef > 0, "router_aux_loss_coef": m.aux_loss_coef}
    if kind == "mixtral":
        return {
            "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "intermediate_size": m.hidden_dim,
            "router_jitter_noise": 0.0,
            **aux,
        }
    if kind == "olmoe":
        return {
            "num_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "intermediate_size": m.hidden_dim,
            "norm_topk_prob": m.route_norm,
            "clip_qkv": None,
            **aux,
        }
    if kind in ("qwen2_moe", "qwen3_moe"):
        out = {
            "num_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.hidden_dim,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": args.moe_every,
            "mlp_only_layers": list(args.dense_layers),
            **aux,
        }
        if kind == "qwen2_moe":
            out.update(shared_expert_intermediate_size=shared, qkv_bias=args.qkv_bias)
        return out
    return {  # deepseek_v3
        "n_routed_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.hidden_dim,
        "n_shared_experts": shared // m.hidden_dim if m.n_shared_experts else 0,
        "first_k_dense_replace": len(args.dense_layers),
        "n_group": m.n_groups,
        "topk_group": m.topk_groups,
        "routed_scaling_factor": m.route_scale,
        "norm_topk_prob": m.route_norm,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_nope_head_dim": args.head_dim,
        "v_head_dim": args.v_head_dim,
        "head_dim": args.qk_rope_head_dim,
        "rope_interleave": args.rope_interleave,
        "num_key_value_heads": args.n_heads,
        "num_nextn_predict_layers": 0,
    }


def export_args(args: ModelArgs, state: dict[str, torch.Tensor]) -> ModelArgs:
    """The family an export writes. A folder's family is kept; meshloom's own MoE (family llama) is written as
    the family whose layout and routing it computes: Mixtral (softmax top-k, renormalised, no shared expert,
    every layer MoE, no q/k norm, no biases). Anything else is a ValueError that names the model.* values."""
    from dataclasses import replace

    from checkpoint.hf_folder import MOE_FAMILIES

    if args.moe is None or args.family in MOE_FAMILIES:
        biased = [n for n, t in state.items() if n.endswith("expert_bias") and bool(t.abs().sum())]
        if biased and args.family != "deepseek_v3":
            raise ValueError(
                f"{biased[0]} is not zero (model.moe_bias_update_rate trained it): only DeepSeek-V3 routes with an "
                f"expert bias (e_score_correction_bias), and this is a {args.family!r} model"
            )
        return args
    if args.family not in ("llama", "mistral") or args.qkv_bias or args.qk_norm:
        raise ValueError(f"model.family={args.family!r} with MoE layers: no transformers MoE class matches")
    candidate = replace(args, family="mixtral")
    moe_config(candidate)  # the ValueError naming what Mixtral does not compute
    return export_args(candidate, state)


def generation_config(eos_token_id: int | None) -> dict:
    """generation_config.json: what ``model.generate`` starts from (no BOS, the tokenizer's EOS)."""
    return {"bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}


def model_args_from_hf_config(config: dict, where: str = "config.json") -> ModelArgs:
    """meshloom's ModelArgs for a transformers config.json (checkpoint/hf_folder.py: refusals, both dialects)."""
    from checkpoint.hf_folder import checked_model
    from runtime.config import model_args
    from runtime.schema import Config

    cfg = Config()
    for name, value in checked_model(config, where).items():
        setattr(cfg.model, name, type(getattr(cfg.model, name))(value))
    return model_args(cfg)


def export_tokenizer(tokenizer, out_dir: str | Path, model_max_length: int) -> list[Path]:
    """tokenizer.json (copied) and a tokenizer_config.json for ``AutoTokenizer.from_pretrained``
    (``PreTrainedTokenizerFast``, which rebuilds nothing); meshloom's packing adds no BOS
    (``add_special_tokens=False``)."""
    out = Path(out_dir)
    shutil.copyfile(tokenizer.file, out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    # The chat template of the tokenizer's folder is carried along: a chat fine-tune is then sampled (and
    # rendered by transformers) with the template it was trained on.
    written = [out / "tokenizer.json", out / "tokenizer_config.json"]
    source = Path(tokenizer.file).parent
    if (source / "chat_template.jinja").is_file():
        shutil.copyfile(source / "chat_template.jinja", out / "chat_template.jinja")
        written.append(out / "chat_template.jinja")
    elif (source / "tokenizer_config.json").is_file():
        try:
            template = read_json_object(source / "tokenizer_config.json", "").get("chat_template")
        except ConfigError:
            template = None
        if template:
            config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


def stored_tensors(model: nn.Module, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` a folder holds: every parameter, and DeepSeek-V3's expert bias (a buffer)."""
    tensors = dict(model.named_parameters())
    if args.family == "deepseek_v3":
        tensors.update({n: b for n, b in model.named_buffers() if n.endswith("feed_forward.expert_bias")})
    return tensors


def expected_hf_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """HF name -> shape of every tensor of a model with ``args``. A tied model has no lm_head.weight of its
    own: transformers leaves it out of the file and ties it on load."""
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {
        hf: t.shape for name, p in stored_tensors(model, args).items() for hf, t in hf_tensors(name, p, args).items()
    }
    if args.tie_embeddings:
        shapes.pop(TOP_LEVEL["output.weight"], None)
    return shapes


def empty_shared_experts(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 with ``n_shared_experts: 0``: transformers still builds the shared-expert MLP, zero channels wide,
    and writes its three zero-width matrices; meshloom has no shared expert then. Import ignores them (they hold
    nothing), export writes them back so that the folder is the one transformers writes."""
    if args.family != "deepseek_v3" or args.moe is None or args.moe.n_shared_experts:
        return {}
    dim, out = args.dim, {}
    for layer in range(args.n_layers):
        if args.is_moe_layer(layer):
            prefix = f"model.layers.{layer}.{_SHARED['deepseek_v3']}"
            for name, shape in (("gate_proj", (0, dim)), ("up_proj", (0, dim)), ("down_proj", (dim, 0))):
                out[f"{prefix}.{name}.weight"] = torch.zeros(shape, dtype=dtype)
    return out


HF_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}  # config.json's dtype

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10^9 bytes (KB/MB/GB decimal, KiB/MiB/GiB binary, as transformers reads them)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB.")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()])


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Files of at most ``max_bytes`` filled in order, as ``save_pretrained`` fills them (a larger tensor gets a file of
    its own)."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if n > max_bytes:
            shards.append({name: t})
            continue
        if size + n > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    return [*shards, current] if current else shards


def _write(path: Path, text_or_tensors) -> None:
    if isinstance(text_or_tensors, str):
        path.write_text(text_or_tensors)
    else:
        # metadata format=pt: what transformers checks to accept a safetensors file as PyTorch weights.
        save_file(text_or_tensors, str(path), metadata={"format": "pt"})
        # safetensors creates the file with mode 0600; give it the mode the user's umask gives every other file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)


def export_safetensors(
    model_state: dict[str, torch.Tensor],
    args: ModelArgs,
    out_dir: str | Path,
    eos_token_id: int | None = None,
    max_shard_bytes: int = 5 * 10**9,
    config: dict | None = None,
) -> list[Path]:
    """Write ``model_state`` (full tensors, meshloom names) as safetensors + config.json +
    generation_config.json: one model.safetensors when it fits in ``max_shard_bytes``, else
    model-0000k-of-0000n.safetensors shards and model.safetensors.index.json. Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = export_args(args, model_state)
    tensors = {  # a tied head is the embedding: written once, as model.embed_tokens.weight
        hf: piece.detach().contiguous().cpu()
        for name, t in model_state.items()
        if args.stored_name(name) == name and not (name.endswith("expert_bias") and args.family != "deepseek_v3")
        for hf, piece in hf_tensors(name, t, args).items()
    }
    expected = expected_hf_shapes(args)
    if set(tensors) != set(expected):
        raise ValueError(f"the state does not match the model: missing {sorted(set(expected) - set(tensors))[:5]}")
    tensors.update(empty_shared_experts(args, next(iter(tensors.values())).dtype))
    shards = plan_shards(dict(sorted(tensors.items(), key=lambda item: hf_order(item[0]))), max_shard_bytes)
    written = []
    if len(shards) == 1:
        written.append(out / "model.safetensors")
        _write(written[-1], shards[0])
    else:
        weight_map = {}
        for k, shard in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            _write(out / name, shard)
            written.append(out / name)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        written.append(out / "model.safetensors.index.json")
        _write(written[-1], json.dumps(index, indent=2) + "\n")
    for name, content in (
        ("config.json", config or hf_config(args, eos_token_id, HF_DTYPES[next(iter(tensors.values())).dtype])),
        ("generation_config.json", generation_config(eos_token_id)),
    ):
        written.append(out / name)
        _write(written[-1], json.dumps(content, indent=2) + "\n")
    return written


def tensor_files(path: str | Path) -> dict[str, Path]:
    """HF name -> the file holding it: a folder (its index, or its model.safetensors), or one .safetensors file."""
    p = Path(path).expanduser()
    if p.is_dir():
        return weight_files(p)
    with safe_open(str(p), framework="pt") as f:
        return {name: p for name in f.keys()}


def safetensors_problems(path: str | Path, args: ModelArgs) -> list[str]:
    """Why ``path`` cannot initialise a model with ``args`` (empty: it can), from the headers' names and shapes only."""
    p = Path(path).expanduser()
    if not (p.is_file() or is_model_folder(p) or (p / "model.safetensors").is_file()):
        return [
            f"{p} is neither a .safetensors file nor a folder with config.json and model.safetensors (or its index)"
        ]
    try:
        expected = expected_hf_shapes(args)
    except ValueError as exc:
        return [str(exc)]
    problems, shapes = [], {}
    index = p / "model.safetensors.index.json"
    reading = p if p.is_file() else index if index.is_file() else p / "model.safetensors"
    try:
        files = tensor_files(p)
        for file in sorted(set(files.values())):
            reading = file  # the file named when it cannot be parsed
            with safe_open(str(file), framework="pt") as f:
                shapes.update({name: torch.Size(f.get_slice(name).get_shape()) for name in f.keys()})
                unlisted = sorted(name for name in f.keys() if files.get(name) != file)
            if unlisted:  # the index is what an import follows: a tensor it does not place is never read
                problems.append(
                    f"{file.name} holds {unlisted[:4]}{' ...' if len(unlisted) > 4 else ''}, which {index.name} "
                    "does not place in that file; export the folder again (or rebuild its index)"
                )
    except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt file or index
        return [f"{p} is not a readable safetensors model ({reading}: {exc})"]
    if args.tie_embeddings:  # a tied folder may still carry the head's copy: not read
        shapes.pop(TOP_LEVEL["output.weight"], None)
    for name in empty_shared_experts(args):  # zero-width: nothing to read (DeepSeek-V3 without shared experts)
        if name in shapes and shapes[name].numel() == 0:
            del shapes[name]
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if extra:
        problems.append(f"tensors this model does not have {extra[:4]}{' ...' if len(extra) > 4 else ''}")
    for name in sorted(set(expected) & set(shapes)):
        if shapes[name] != expected[name]:
            problems.append(f"{name}: file {tuple(shapes[name])}, model {tuple(expected[name])}")
    return problems


def _source_name(part: nn.Module, name: str, files: dict[str, Path]) -> str | list[str]:
    """The file's name for parameter ``name`` of ``part``; a tied or missing head reads the embedding
    (``ModelArgs.stored_name``)."""
    name = canonical_name(name)
    args = getattr(part, "args", None)
    family = args.family if args is not None else "llama"
    if args is not None and args.moe is not None:
        experts = hf_expert_names(name, family, args.moe.n_experts)
        if experts is not None:
            return experts
    key = hf_name(args.stored_name(name) if args is not None else name, family)
    if key not in files and key == TOP_LEVEL["output.weight"]:
        return TOP_LEVEL["tok_embeddings.weight"]
    return key


class ExpertStack:
    """An expert weight (E, in, out) read from its E per-expert (out, in) matrices, sliced like one tensor."""

    def __init__(self, handles: list):
        self.handles = handles

    def __getitem__(self, index):
        if not isinstance(index, tuple):  # [:], the whole weight
            index = (slice(None),) * 3
        experts, rows, cols = index
        return torch.stack([h[cols, rows].t() for h in self.handles[experts]])


def read_piece(stored, param: torch.Tensor, sliced: bool = True) -> torch.Tensor:
    """This rank's piece of ``param`` from ``stored``: only its block when ``sliced`` and one block, else the full
    tensor cut locally with ``distribute_tensor``."""
    if not isinstance(param, DTensor):
        return stored[:]
    block = contiguous_block(param) if sliced else None
    if block is not None:
        shape, offset = block
        return stored[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    full = stored[:].to(param.dtype)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


@torch.no_grad()
def import_safetensors(parts: list[nn.Module], path: str | Path, sliced: bool = True) -> None:
    """Overwrite every parameter of ``parts`` with the stored value, each rank reading only its own piece;
    ``sliced=False`` reads full tensors (measure/hf_import_memory.py compares)."""
    files = tensor_files(path)
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    experts: list[tuple[list[str], torch.Tensor]] = []
    for part in parts:
        args = getattr(part, "args", None)
        tensors = stored_tensors(part, args) if args is not None else dict(part.named_parameters())
        for name, param in tensors.items():
            key = _source_name(part, name, files)
            absent = [k for k in (key if isinstance(key, list) else [key]) if k not in files]
            if absent:
                raise ConfigError(
                    f"{path}: the tensor {absent[0]} is in no file its index names; export the folder again "
                    "(or rebuild model.safetensors.index.json)."
                )
            if isinstance(key, list):  # an expert weight: its E matrices, possibly in several files
                experts.append((key, param))
            else:
                by_file.setdefault(files[key], []).append((key, param))
    for file, items in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key, param in items:
                _copy(param, finite(read_piece(f.get_slice(key), param, sliced), file, key))
    if experts:
        opened = {
            file: safe_open(str(file), framework="pt") for file in {files[k] for keys, _ in experts for k in keys}
        }
        for keys, param in experts:
            piece = read_piece(ExpertStack([opened[files[k]].get_slice(k) for k in keys]), param, sliced)
            _copy(param, finite(piece, files[keys[0]], keys[0].replace(".0.", ".*.", 1)))


def finite(piece: torch.Tensor, file: Path, key: str) -> torch.Tensor:
    """``piece`` when every value is finite; else a ConfigError naming the file and tensor (a NaN weight would
    only show as a diverged first step, or a generation that fails mid-way)."""
    if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
        bad = int((~torch.isfinite(piece)).sum())
        raise ConfigError(
            f"{file}: the tensor {key} holds {bad:,} NaN or infinite values; the file is damaged or was saved from a "
            "diverged run: export it again from a good checkpoint."
        )
    return piece


def _copy(param: torch.Tensor, piece: torch.Tensor) -> None:
    local = local_tensor(param)
    local.copy_(piece.to(device=local.device, dtype=local.dtype))
