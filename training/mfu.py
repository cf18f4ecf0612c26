"""Achieved TFLOP/s per device and MFU (model FLOPs utilization).

MFU = (model FLOPs per token x tokens per second) / (devices x peak FLOP/s of one device); the FLOPs per
token come from models/flops.py.

Peak FLOP/s: ``training.peak_tflops`` when set, otherwise ``GPUS`` (planning/gpus.py), a small table of dense (no sparsity)
tensor-core figures from NVIDIA's data sheets, looked up by the device's name, for bf16 and for fp32. fp32
uses the plain FP32 figure: PyTorch does not use TF32 for fp32 matmuls unless told to
(``torch.backends.cuda.matmul.fp32_precision``); if you turn TF32 on, pass its figure as
``training.peak_tflops``. On a CPU there is no table: TFLOP/s are always logged, MFU only with
``training.peak_tflops``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from models.flops import flops_per_token
from planning.gpus import table_peak_tflops

if TYPE_CHECKING:
    from models.llama import ModelArgs


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
