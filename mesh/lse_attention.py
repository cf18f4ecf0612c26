"""Attention blocks that also return each query row's log-sum-exp (LSE), the heart of context parallelism.

SDPA returns only the attention output. A block of ring attention also needs the LSE of each query row, to
merge blocks (mesh/context_parallel.py), and a backward that takes the *merged* output and LSE. The aten
kernels behind SDPA give both (private ops, wrapped in mesh/private_api.py); this file picks one and calls it.
"""

from __future__ import annotations

import torch

from mesh.private_api import (
    sdpa_efficient,
    sdpa_efficient_backward,
    sdpa_flash,
    sdpa_flash_backward,
    sdpa_flash_cpu,
    sdpa_flash_cpu_backward,
)
from models.llama import cuda_flash_eligible

FUSED_KERNELS = ("cpu_flash", "flash", "efficient")


def fused_attention_kernel(q: torch.Tensor) -> str:
    """The fused kernel for queries like ``q``: ``cpu_flash`` (CPU), ``flash`` (CUDA bf16/fp16, head_dim % 8, <= 256,
    sm80+), else ``efficient`` (needs k/v repeated to the query heads, one block at a time)."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type != "cuda":
        raise NotImplementedError(f"no fused attention kernel with a log-sum-exp wired for {q.device.type}")
    if cuda_flash_eligible(q):
        return "flash"
    return "efficient"


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, kv_heads, m, d) -> (b, heads, m, d): each kv head serves heads / kv_heads consecutive query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``_repeat_heads``: sum over the query heads that shared each kv head."""
    return t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """One fused attention call: (output in q's dtype, lse fp32 (fp64 on CPU fp64), state for the backward). ``causal``
    is aligned top left (the diagonal block of a square)."""
    kernel = fused_attention_kernel(q)
    if kernel == "cpu_flash":
        out, lse = sdpa_flash_cpu(q, k, v, causal)
        return out, lse, (kernel,)
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = sdpa_flash(q, k, v, causal)
        return out, lse, (kernel, cum_q, cum_k, max_q, max_k, rng_state, unused)
    heads = q.shape[1]
    out, lse, seed, offset = sdpa_efficient(q, _repeat_heads(k, heads), _repeat_heads(v, heads), causal)
    # The memory-efficient kernel pads the LSE's last dim (to a multiple of 32 on CUDA); keep the real rows,
    # and the padded length for the backward.
    return out, lse[..., : q.shape[2]], (kernel, seed, offset, lse.shape[-1])


def attention_with_lse_backward(grad_out, q, k, v, out, lse, causal: bool, state):
    """(dq, dk, dv) of one block from the *merged* output and LSE, so the blocks' dq sum to the full attention's and
    each dk, dv is exact; dk, dv come back at k's kv heads."""
    kernel, *rest = state
    lse = lse.contiguous()  # a row slice of the merged LSE; the kernels index it as dense
    if kernel == "cpu_flash":
        return sdpa_flash_cpu_backward(grad_out, q, k, v, out, lse, causal)
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, rng_state, unused = rest
        return sdpa_flash_backward(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, causal, rng_state, unused)
    seed, offset, padded_len = rest
    heads, kv_heads = q.shape[1], k.shape[1]
    padded = torch.nn.functional.pad(lse, (0, padded_len - lse.shape[-1]))  # the kernel's own LSE layout
    dq, dk, dv, _ = sdpa_efficient_backward(
        grad_out, q, _repeat_heads(k, heads), _repeat_heads(v, heads), out, padded, seed, offset, causal
    )
    return dq, _fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)
