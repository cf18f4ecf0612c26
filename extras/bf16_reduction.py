"""``parallel.grad_compression = bf16``: FSDP reduces the gradients in bf16.

The trade (docs/dp_savers.md, section 3): half the bytes of every gradient reduction, the sum rounded to 8
significant bits, then stored back into the fp32 shards. It attaches where the model is parallelized:
planning/options.py puts ``reduce_dtype`` into mesh/parallelize.py's ``ParallelOptions`` (FSDP's
``MixedPrecisionPolicy.reduce_dtype``).
"""

from __future__ import annotations

import torch


def reduce_dtype(grad_compression: str) -> torch.dtype:
    """The dtype FSDP reduces gradients in: bf16 for ``grad_compression=bf16``, else fp32."""
    return torch.bfloat16 if grad_compression == "bf16" else torch.float32
