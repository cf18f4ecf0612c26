"""The private torch kernel that models/ calls: ``torch._grouped_mm``, every expert of an MoE layer in one call.

Private torch APIs live in mesh/private_api.py, which models/ cannot import (models/ is single-device code
and never imports mesh/ or torch.distributed); this is the one exception, named in that file's docstring and
exercised by tests/test_private_api.py.

``torch._grouped_mm(a, b, offs=offs)`` (torch 2.13): a (rows, k), b (groups, k, n), ``offs`` the int32
cumulative row ends, so rows offs[g−1] .. offs[g]−1 of a are multiplied by b[g] (an empty group is fine).
Rows past offs[−1] belong to no group: their output, and in backward their gradient, are left unwritten.
It runs on CPU for fp32, bf16 and fp16, on CUDA for bf16, and wants every matrix's leading stride to be a
multiple of 16 bytes. Two traps, handled here:

1. its backward fails on a gradient with stride 0 (as ``y.sum().backward()`` hands it): ``grouped_mm`` makes
   the incoming gradient contiguous;
2. where it is missing, or refuses a dtype or a shape, the caller must loop over experts instead:
   ``grouped_mm_works`` finds out once per (device, dtype, weight shapes), by a tiny trial forward and
   backward, and remembers the answer;
3. on CUDA each group's rows must start at a 16-byte aligned offset: a multiple of 8 rows in bf16 (torchtitan
   pads each expert's tokens the same way). ``padded_groups`` places each group at the next multiple of
   ``alignment_rows`` rows, on the device and without a host read (the padded buffer is sized for the worst
   case, rows + groups x (align - 1)); the padding rows are zeros, so they add nothing to any output row or
   any gradient, and an expert with no tokens stays an empty group. On CPU (alignment 1) nothing is padded;
   tests/test_gpu_kernels.py runs the padded path on CPU against the loop, forward and backward.
"""

from __future__ import annotations

import threading
import warnings

import torch

_WORKS: dict[tuple, bool] = {}


class _ContiguousGradient(torch.autograd.Function):
    """Identity in forward; hands backward a contiguous copy of a gradient that is not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group g of ``a`` times ``b[g]``; ``offs`` int32 cumulative row ends (module docstring)."""
    return _ContiguousGradient.apply(torch._grouped_mm(a, b, offs=offs))


def _trial(device: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> str | None:
    """Run a two-group grouped matmul of each (k, n) in ``shapes``, forward and backward; None if all ran, else the
    error. In a thread of its own: dispatch modes are per thread, so the caller's (selective checkpointing) never sees
    it."""
    failure = []

    def trial() -> None:
        try:
            for k, n in shapes:
                a = torch.ones(3, k, device=device, dtype=dtype, requires_grad=True)
                b = torch.ones(2, k, n, device=device, dtype=dtype, requires_grad=True)
                offs = torch.tensor([1, 3], device=device, dtype=torch.int32)
                grouped_mm(a, b, offs).sum().backward()
        except (RuntimeError, NotImplementedError, AttributeError) as err:
            failure.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=trial, name="grouped-mm-trial")
    thread.start()
    thread.join()
    return failure[0] if failure else None


def grouped_mm_works(device: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``grouped_mm`` runs for these weights on ``device`` in ``dtype``; tried once. Under torch.compile the
    trial runs on the meta device, whose function in torch 2.13 accepts bf16 only (CUDA's rule)."""
    return _works(device, dtype, shapes, torch.compiler.is_compiling())


# Uncompiled: traced, the lookup would guard on the cache's contents, and the first call's trial, which fills it,
# would make the second call recompile.
@torch.compiler.disable
def _works(device: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], compiling: bool) -> bool:
    key = (device.type, device.index, dtype, shapes, compiling)
    if key not in _WORKS:
        trial_device = torch.device("meta") if compiling else device
        why = _trial(trial_device, dtype, shapes) if hasattr(torch, "_grouped_mm") else "torch has no _grouped_mm"
        if why is not None:
            warnings.warn(
                f"torch._grouped_mm does not run for {dtype} weights {shapes} on {device}"
                f"{' under torch.compile' if compiling else ''} ({why}); "
                "the MoE experts run one after another instead",
                stacklevel=2,
            )
        _WORKS[key] = why is None
    return _WORKS[key]


def alignment_rows(device: torch.device, dtype: torch.dtype) -> int:
    """The row multiple each group of ``torch._grouped_mm`` must start on: 16 bytes of rows on CUDA (8 in bf16,
    4 in fp32), 1 (no padding) elsewhere."""
    return max(1, 16 // dtype.itemsize) if device.type == "cuda" else 1


def padded_groups(counts: torch.Tensor, align: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each grouped row goes when every group is padded to a multiple of ``align`` rows: (destination rows, int32
    cumulative ends, padded row count, an upper bound needing no host read)."""
    padded = (counts + align - 1) // align * align  # a group of 0 rows stays 0
    offs = padded.cumsum(0, dtype=torch.int32)
    groups = torch.arange(counts.numel(), device=counts.device)
    group_of_row = torch.repeat_interleave(groups, counts, output_size=rows)  # output_size: no host read
    shift = (offs - padded) - (counts.cumsum(0) - counts)  # padded start minus packed start, per group
    dest = torch.arange(rows, device=counts.device) + shift[group_of_row]
    return dest, offs, rows + counts.numel() * (align - 1)
