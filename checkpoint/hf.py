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
| layers.N.ffn_norm.weight               | model.layers.N.post_attention_layernorm.weight    |
| layers.N.feed_forward.w1/w3/w2.weight  | model.layers.N.mlp.gate_proj/up_proj/down_proj.weight |
| norm.weight                            | model.norm.weight                                 |
| output.weight                          | lm_head.weight                                    |

Import (``checkpoint.init_from``) follows mesh/materialize.py: for each parameter, read the full tensor
from the file, keep this rank's piece with ``distribute_tensor(..., src_data_rank=None)`` (a local slice by
the parameter's placements, no communication) and copy it in, one tensor at a time.
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

from mesh.materialize import canonical_name
from models.llama import ModelArgs, Transformer

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
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """The Hugging Face name of meshloom parameter ``name``; ValueError for names Llama does not have."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    match = _LAYER.match(name)
    if match and match.group(2) in IN_LAYER:
        return f"model.layers.{match.group(1)}.{IN_LAYER[match.group(2)]}"
    raise ValueError(f"{name!r} has no Hugging Face Llama name: only dense Llama models export (MoE layers do not map)")


def hf_config(args: ModelArgs, eos_token_id: int | None = None) -> dict:
    """A config.json that ``LlamaForCausalLM.from_pretrained`` reads as this architecture.

    ``bos_token_id`` is None (meshloom packs documents with an EOS after each and no BOS), and
    ``eos_token_id`` is the tokenizer's (None for bytes), so ``generate`` stops where our generate.py does.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
    }


def model_args_from_hf_config(config: dict) -> ModelArgs:
    """The inverse of ``hf_config``: meshloom's ModelArgs for an exported (dense Llama) config.json."""
    args = ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        vocab_size=config["vocab_size"],
        ffn_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=config.get("rope_theta", 10000.0),
        max_seq_len=config.get("max_position_embeddings", 2048),
    )
    if config.get("head_dim", args.head_dim) != args.head_dim or config.get("tie_word_embeddings"):
        raise ValueError(
            "config.json has a head_dim other than hidden_size / num_attention_heads, or tied "
            "embeddings; meshloom's Llama has neither"
        )
    return args


def export_tokenizer(tokenizer, out_dir: str | Path, model_max_length: int) -> list[Path]:
    """tokenizer.json (copied) and a tokenizer_config.json, so that ``AutoTokenizer.from_pretrained`` loads it.

    ``PreTrainedTokenizerFast`` takes tokenizer.json as it is (pre-tokenizer, normalizer, decoder), instead
    of a model-specific class that might rebuild them. A tokenizer.json with a post-processor that adds a
    BOS still adds it there; meshloom's packing never does (pass ``add_special_tokens=False`` to match).
    """
    out = Path(out_dir)
    shutil.copyfile(tokenizer.file, out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]


def expected_hf_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """HF name -> shape of every tensor of a model with ``args`` (ValueError for MoE models)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {hf_name(name): p.shape for name, p in model.named_parameters()}


def export_safetensors(
    model_state: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | Path, eos_token_id: int | None = None
) -> Path:
    """Write ``model_state`` (full tensors, meshloom names) as out_dir/model.safetensors + config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {  # a tied head is the embedding: written once, as model.embed_tokens.weight
        hf_name(name): t.detach().contiguous().cpu()
        for name, t in model_state.items()
        if args.stored_name(name) == name
    }
    expected = expected_hf_shapes(args)
    if set(tensors) != set(expected):
        raise ValueError(f"the state does not match the model: missing {sorted(set(expected) - set(tensors))[:5]}")
    # metadata format=pt: what transformers checks to accept a safetensors file as PyTorch weights.
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file with mode 0600; give it the mode the user's umask gives every other file.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out / "model.safetensors", 0o666 & ~umask)
    (out / "config.json").write_text(json.dumps(hf_config(args, eos_token_id), indent=2) + "\n")
    return out / "model.safetensors"


def safetensors_path(path: str | Path) -> Path:
    """``path`` itself, or ``path/model.safetensors`` when it is a folder."""
    p = Path(path)
    return p / "model.safetensors" if p.is_dir() else p


# Config keys that must agree with the model for the weights to mean the same thing (not just fit).
_CONFIG_FIELDS = {
    "hidden_size": "dim",
    "intermediate_size": "hidden_dim",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "num_hidden_layers": "n_layers",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
}


def safetensors_problems(path: str | Path, args: ModelArgs) -> list[str]:
    """Why ``path`` cannot initialise a model with ``args`` (empty: it can). Reads headers only.

    Checks names and shapes against the model, and the config.json beside the file when there is one
    (norm eps and RoPE theta do not change shapes but do change what the weights compute).
    """
    file = safetensors_path(path)
    if not file.is_file():
        return [f"{file} does not exist"]
    try:
        expected = expected_hf_shapes(args)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    try:
        with safe_open(str(file), framework="pt") as f:
            shapes = {name: torch.Size(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt file
        return [f"{file} is not a readable safetensors file ({exc})"]
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if extra:
        problems.append(f"tensors this model does not have {extra[:4]}{' ...' if len(extra) > 4 else ''}")
    for name in sorted(set(expected) & set(shapes)):
        if shapes[name] != expected[name]:
            problems.append(f"{name}: file {tuple(shapes[name])}, model {tuple(expected[name])}")
    config = file.parent / "config.json"
    if config.is_file():
        hf = json.loads(config.read_text())
        for key, attr in _CONFIG_FIELDS.items():
            if key in hf and hf[key] != getattr(args, attr):
                problems.append(f"config.json {key}={hf[key]} but the model has {getattr(args, attr)}")
    return problems


@torch.no_grad()
def import_safetensors(parts: list[nn.Module], path: str | Path) -> None:
    """Overwrite every parameter of ``parts`` with the file's value; each rank keeps its own piece."""
    with safe_open(str(safetensors_path(path)), framework="pt") as f:
        for part in parts:
            for name, param in part.named_parameters():
                # A tied model's pipeline last stage holds a copy of the embedding as output.weight: it reads
                # model.embed_tokens.weight (models/llama.py: ModelArgs.stored_name).
                stored = part.args.stored_name(canonical_name(name))
                full = f.get_tensor(hf_name(stored)).to(device=param.device, dtype=param.dtype)
                if isinstance(param, DTensor):
                    piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(piece.to_local())
                else:
                    param.copy_(full)
