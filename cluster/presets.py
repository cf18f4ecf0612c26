"""Llama-3-shaped model presets for the planner (memory tables, layouts, published runs): shapes only.

Values follow Meta's published configs (and Mistral's for Mixtral); training never reads them.
"""

from __future__ import annotations

from models.llama import ModelArgs
from models.moe import MoEArgs

# Llama-3-shaped presets, for planning (memory tables, layouts). Values follow Meta's published configs.
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
