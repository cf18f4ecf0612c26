"""Named model shapes (Llama 3, Mixtral), defined once: for the runs and for the planner.

Values follow Meta's published configs (and Mistral's for Mixtral). A run takes one by name with the config key
``model.preset`` (configs/llama3_8b.toml: ``preset = "llama3-8b"``): ``preset_keys`` gives the ``[model]`` keys
it stands for, and any ``[model]`` key the file or the command line gives explicitly overrides the preset's.
The cluster planner (cluster/), the memory tables and the tests read ``PRESETS`` directly.
"""

from __future__ import annotations

from models.llama import ModelArgs
from models.moe import MoEArgs

PRESETS: dict[str, ModelArgs] = {
    "llama3-1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama3-8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama3-70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # meta-llama/llama-models, models/sku_list.py (Llama 3.1 405B): dim 16384, 126 layers, 128 heads, 8 kv
    # heads, ffn_dim_multiplier 1.2 and multiple_of 4096 (an FFN of 53,248), vocabulary 128,256, rope theta 5e5.
    "llama3-405b": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # mistralai/Mixtral-8x7B-v0.1's config.json (also transformers' MixtralConfig defaults): dim 4096, 32 layers,
    # 32 heads, 8 kv heads, every layer an MoE of 8 SwiGLU experts of 14,336, top-2, renormalised softmax
    # gates, no shared expert; vocabulary 32,000, rope theta 1e6.
    "mixtral-8x7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_dim=14336,
        rope_theta=1000000.0,
        max_seq_len=32768,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=14336),
    ),
}


def preset_keys(name: str) -> dict[str, object]:
    """The ``[model]`` config keys (runtime/config.py: ``ModelConfig``) that give preset ``name``'s shape."""
    args = PRESETS[name]
    keys: dict[str, object] = {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "ffn_dim": args.hidden_dim,  # the SwiGLU width the preset's rule gives (Llama's multiple_of, multiplier)
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_seq_len": args.max_seq_len,
    }
    if args.moe is not None:
        keys |= {
            "n_experts": args.moe.n_experts,
            "top_k": args.moe.top_k,
            "moe_every": args.moe_every,
            "moe_ffn_dim": args.moe.hidden_dim,
            "moe_shared_experts": args.moe.n_shared_experts,
            "moe_score_func": args.moe.score_func,
            "moe_route_norm": args.moe.route_norm,
        }
    return keys
