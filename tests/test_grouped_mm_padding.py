"""CUDA's grouped-GEMM path on CPU: ``torch._grouped_mm`` on CUDA needs each expert's rows to start on a 16-byte
aligned row (models/kernels.py, 3); the padding that provides it runs on any device, so it is checked here
against the per-expert loop (tests/test_gpu_kernels.py checks the kernel itself on a GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype, align", [(torch.float32, 4), (torch.bfloat16, 8)])
def test_padded_grouped_experts_equal_the_loop_forward_and_backward_on_cpu(dtype, align):
    """The CUDA path (each expert's rows padded to CUDA's alignment: 16 bytes, 8 rows in bf16) run on CPU,
    zero-token experts and counts that are not multiples of the alignment included, against the per-expert
    loop: the output and the gradients of the input and of every weight."""
    from models.kernels import alignment_rows, grouped_mm_works, padded_groups
    from models.moe import GroupedExperts

    assert alignment_rows(torch.device("cuda"), dtype) == align and alignment_rows(torch.device("cpu"), dtype) == 1
    if not grouped_mm_works(torch.device("cpu"), dtype, ((32, 48), (48, 32))):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    counts = torch.tensor([0, 13, 1, 0, 8, 22, 3, 0])
    dest, offs, capacity = padded_groups(counts, align, int(counts.sum()))
    ends = (counts + align - 1) // align * align
    assert offs.tolist() == ends.cumsum(0).tolist() and all(int(o) % align == 0 for o in offs)
    assert capacity >= int(offs[-1]) and len(set(dest.tolist())) == int(counts.sum())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), 32, generator=gen).to(dtype)
    w1, w3 = (torch.randn(8, 32, 48, generator=gen).div(32**0.5).to(dtype) for _ in "13")
    w2 = torch.randn(8, 48, 32, generator=gen).div(48**0.5).to(dtype)
    grad = torch.randn(x.shape[0], 32, generator=gen).to(dtype)
    results = []
    for run in (lambda *a: GroupedExperts.grouped(*a, align=align), GroupedExperts.looped):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        out = run(leaves[0], counts, *leaves[1:])
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    # fp32: the same products, summed in the same order per row (only the zero padding rows are added, which
    # contribute exact zeros): round-off at most. bf16: each kernel rounds its output and accumulates in its
    # own order, a few bf16 steps (2**-8) of the largest value, as in the CUDA test above.
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(*results, strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < tolerance
