"""Model FLOPs per token: what one training token costs the model, layer by layer.

"Model" FLOPs are the ones the model needs, whatever the implementation does on top: activation
checkpointing's recomputation, tensor-parallel ranks repeating the same small ops, or padding do not count
(counting them gives the hardware FLOP utilization, HFU). training/mfu.py turns them into TFLOP/s
and MFU; planning/pipeline_split.py balances pipeline stages by them. The count, per token of a training step:

1. **Matmul weights.** Every weight matrix a token passes through costs 2 FLOPs per element in forward
   (a multiply and an add) and 4 in backward (the gradient of the input and of the weight): 6 x those
   parameters. Counted: wq, wk, wv, wo and the SwiGLU's w1, w3, w2 of every block, the output head. Not
   counted: the embedding (a lookup, no matmul) and the norm weights (elementwise, a few FLOPs per element
   of the activation, not of the weight). In an MoE layer a token touches the router, its ``top_k`` routed
   experts and the shared expert, not all ``n_experts``: only those count.
2. **Attention.** q·kᵀ and the weighted sum of v cost 2 x 2 x seq_len x (n_heads x head_dim) FLOPs per token
   and layer in forward, twice that in backward: 12 x n_layers x n_heads x head_dim x seq_len. This is the
   convention of PaLM (Chowdhery et al. 2022, appendix B) and torchtitan; it counts the full s x s
   scores, although a causal kernel only needs about half of them, so MFUs stay comparable across codebases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.latent_attention import latent_attention_params

if TYPE_CHECKING:
    from models.llama import ModelArgs


def layer_matmul_params(args: ModelArgs, layer_id: int) -> int:
    """Weights of the matmuls one token goes through in block ``layer_id`` (step 1 of the module docstring)."""
    head, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = args.dim * head + 2 * args.dim * kv + head * args.dim  # wq, wk + wv, wo
    if args.latent:  # every projection of latent attention is a matmul; its two norms are not
        attention = latent_attention_params(args) - args.kv_lora_rank - args.q_lora_rank
    dense_ffn = 3 * args.dim * args.hidden_dim  # w1, w3, w2
    if not args.is_moe_layer(layer_id):
        return attention + dense_ffn
    m = args.moe
    ffn = args.dim * m.n_experts + m.top_k * 3 * args.dim * m.hidden_dim  # the router + the chosen experts
    if m.n_shared_experts:  # the dense FFN's size unless the family gives its own (and Qwen2-MoE's gate)
        ffn += 3 * args.dim * (m.shared_hidden_dim or args.hidden_dim) + (args.dim if m.shared_gate else 0)
    return attention + ffn


def layer_attention_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Score and value matmuls of one block, forward and backward, per token (step 2 of the module docstring;
    latent attention: scores over nope + rope channels, values v_head_dim wide)."""
    if args.latent:
        return 6 * args.n_heads * (args.head_dim + args.qk_rope_head_dim + args.v_head_dim) * seq_len
    return 12 * args.n_heads * args.head_dim * seq_len


def layer_flops_per_token(args: ModelArgs, layer_id: int, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward) in block ``layer_id``."""
    return 6 * layer_matmul_params(args, layer_id) + layer_attention_flops_per_token(args, seq_len)


def head_flops_per_token(args: ModelArgs) -> int:
    """Model FLOPs of one training token in the output head (the embedding is a lookup: none)."""
    return 6 * args.dim * args.vocab_size


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward)."""
    return head_flops_per_token(args) + sum(layer_flops_per_token(args, i, seq_len) for i in range(args.n_layers))
