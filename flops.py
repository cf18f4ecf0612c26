"""Model FLOPs per token, achieved TFLOP/s per device, and MFU (model FLOPs utilization).

MFU = (model FLOPs per token x tokens per second) / (devices x peak FLOP/s of one device). "Model" FLOPs
are the ones the model needs, whatever the implementation does on top: activation checkpointing's
recomputation, tensor-parallel ranks repeating the same small ops, or padding do not count (counting them
gives the hardware FLOP utilization, HFU). The count, per token of a training step:

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

Peak FLOP/s: ``training.peak_tflops`` when set, otherwise a small table of dense (no sparsity) tensor-core
figures from NVIDIA's data sheets, looked up by the device's name, for bf16 and for fp32. fp32 uses the plain
FP32 figure: PyTorch does not use TF32 for fp32 matmuls unless told to (``torch.backends.cuda.matmul.
fp32_precision``); if you turn TF32 on, pass its figure as ``training.peak_tflops``. On a CPU there is no
table: TFLOP/s are always logged, MFU only with ``training.peak_tflops``.
"""

from __future__ import annotations

import torch

from models.llama import ModelArgs

# (name fragment, bf16 TFLOP/s, fp32 TFLOP/s), dense, per GPU. First match wins, so variants come first.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200 NVL", 835.0, 60.0),
    ("H200", 989.4, 66.9),
    ("H100 NVL", 835.0, 60.0),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),  # SXM
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
)


def matmul_params_per_token(args: ModelArgs) -> int:
    """Weights of the matmuls one token goes through (step 1 of the module docstring)."""
    head, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = args.dim * head + 2 * args.dim * kv + head * args.dim  # wq, wk + wv, wo
    dense_ffn = 3 * args.dim * args.hidden_dim  # w1, w3, w2
    total = args.dim * args.vocab_size  # output head
    for layer_id in range(args.n_layers):
        ffn = dense_ffn
        if args.is_moe_layer(layer_id):
            m = args.moe
            ffn = args.dim * m.n_experts + m.top_k * 3 * args.dim * m.hidden_dim  # router + the chosen experts
            ffn += dense_ffn if m.n_shared_experts else 0  # the shared expert has the dense FFN's size
        total += attention + ffn
    return total


def attention_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Score and value matmuls, forward and backward, per token (step 2 of the module docstring)."""
    return 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward)."""
    return 6 * matmul_params_per_token(args) + attention_flops_per_token(args, seq_len)


def table_peak_tflops(device_name: str, mixed_precision: str) -> float | None:
    """The table's figure for a device name (``torch.cuda.get_device_name``), or None if it is not listed."""
    for fragment, bf16, fp32 in PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return bf16 if mixed_precision == "bf16" else fp32
    return None


def peak_tflops(configured: float, device: torch.device, mixed_precision: str) -> float | None:
    """Peak TFLOP/s of one device: ``training.peak_tflops`` if > 0, else the table's (CUDA only), else None."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    return table_peak_tflops(torch.cuda.get_device_name(device), mixed_precision)


class Throughput:
    """Turns a step's tokens per second into TFLOP/s per device and MFU (the ``tflops``/``mfu`` fields)."""

    def __init__(self, args: ModelArgs, seq_len: int, world_size: int, peak: float | None):
        self.flops_per_token = flops_per_token(args, seq_len)
        self.world_size = world_size
        self.peak = peak

    def fields(self, tokens_per_s: float) -> dict:
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        return {"tflops": tflops, **({"mfu": tflops / self.peak} if self.peak else {})}
