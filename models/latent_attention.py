"""Multi-head latent attention (DeepSeek-V2/V3's MLA) in single-device PyTorch (no torch.distributed here).

Keys and values come from one small latent per token instead of per-head projections of x, and each q/k head
is split into a part without position (nope) and a part RoPE rotates (rope). For x (batch, seq, dim):

1. **Query**: ``wq`` (dim -> heads x (nope + rope)), or through a low rank (``q_lora_rank`` > 0):
   wq_b(RMSNorm(wq_a x)).
2. **Latent**: ``wkv_a`` maps x to kv_lora_rank + rope channels; the first kv_lora_rank are normalised
   (``kv_a_norm``) and expanded by ``wkv_b`` into every head's k_nope and value; the last rope channels are one
   key part that every head shares (multi-query style) and RoPE rotates.
3. **RoPE** rotates the rope parts of q and of the shared key. DeepSeek-V3 stores their pairs interleaved,
   (x0, x1), (x2, x3), ...: ``rope_interleave`` regroups them as (evens, odds) first, which is exactly
   transformers' ``apply_rotary_pos_emb_interleave`` (its output is in that order too).
4. **Attention**: each head's key is [k_nope, k_rope], its query [q_nope, q_rope], scaled by
   1 / sqrt(nope + rope) (SDPA's default for that width); values are v_head_dim wide, so the output is
   heads x v_head_dim, and ``wo`` maps it back to dim.

The two latent norms use eps 1e-6 whatever the model's ``norm_eps`` (transformers' DeepseekV3RMSNorm default).
Under TP (mesh/tensor_parallel.py) wq / wq_b and wkv_b split by heads, wo by rows; the low-rank projections
and their norms are small and are held whole, and the one shared rope key becomes each rank's own tensor
through ``shared_key_local`` (whose gradient TP sums over the ranks' heads). The KV cache (generation, one device) keeps the expanded keys
and values, not the latent: simple, not DeepSeek's memory saving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.rope import yarn_mscale

LATENT_NORM_EPS = 1e-6


def latent_attention_params(args) -> int:
    """Parameters of one latent attention: the projections and the two latent norms."""
    qk = args.head_dim + args.qk_rope_head_dim
    if args.q_lora_rank:
        q = args.dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * args.n_heads * qk
    else:
        q = args.dim * args.n_heads * qk
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
    kv += args.kv_lora_rank * args.n_heads * (args.head_dim + args.v_head_dim)
    return q + kv + args.n_heads * args.v_head_dim * args.dim


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): interleaved RoPE pairs as rotate-half pairs."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class LatentAttention(nn.Module):
    """Steps 1-4 of the module docstring; ``head_dim`` is DeepSeek's qk_nope_head_dim. ``norm``, ``rotate`` and
    ``attend`` come from models/llama.py."""

    def __init__(self, args, norm: type[nn.Module], rotate: Callable, attend: Callable):
        super().__init__()
        RMSNorm = norm  # noqa: N806 - the decoder's pieces, passed in (models/llama.py imports this file)
        self.rotate, self.local_attention = rotate, attend
        self.nope, self.rope, self.v_dim = args.head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank, self.interleave = args.kv_lora_rank, args.rope_interleave
        qk = self.nope + self.rope
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, args.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # YaRN with mscale_all_dim: DeepSeek scales the softmax by mscale^2 too (transformers' yarn_apply_mscale),
        # applied to q (the same scores): 1 otherwise
        s = args.rope_scaling
        mscale = yarn_mscale(s.factor, s.mscale_all_dim) if s.kind == "yarn" and s.mscale_all_dim else 1.0
        self.softmax_gain = mscale * mscale
        self.attend = attend  # the seam context parallelism replaces, as in models/llama.Attention
        # The seam TP replaces: the shared rope key as this rank's tensor (mesh/tensor_parallel.shared_key_local)
        self.shared_key_local = _same

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None, cache=None
    ) -> torch.Tensor:
        """x (batch, seq, dim) -> (batch, seq, dim); ``documents``: each token's document id under document masks
        (the tables are then per token: models/llama.Transformer.forward); ``cache``: a LayerCache when generating."""
        apply_rotary, causal_attention = self.rotate, self.local_attention
        bsz, seqlen, _ = x.shape
        start = 0 if cache is None else cache.start
        if cos.dim() == 2:
            cos, sin = cos[start : start + seqlen], sin[start : start + seqlen]
        masks = {} if documents is None else {"documents": documents}
        # 1. query, split per head (-1 heads: under TP, this rank's heads)
        q = self.query(x).view(bsz, seqlen, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        # 2. the latent: normalised, expanded per head; the shared rope key
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self.shared_key_local(k_rope).view(bsz, seqlen, 1, self.rope)
        # 3. RoPE on the rope parts
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        # 4. attention over [nope, rope] heads
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.softmax_gain != 1.0:
            q = q * self.softmax_gain
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if cache is None and self.attend is causal_attention:
            out = self.attend(q, k, v, **masks)
        elif cache is None:
            # A kernel that attends across ranks (context parallelism) moves k and v as one tensor: v is padded
            # with zero channels to k's width (they add zero columns to the output, cut off again).
            v = torch.nn.functional.pad(v, (0, k.shape[-1] - self.v_dim))
            out = self.attend(q, k, v, **masks)[..., : self.v_dim]
        else:
            k, v = cache.update(k, v)
            out = causal_attention(q, k, v)
        return self.wo(out.reshape(bsz, seqlen, -1))
