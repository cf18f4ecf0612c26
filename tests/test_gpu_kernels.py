"""The CUDA kernels behind ring attention and the MoE experts (marked `gpu`; `pytest -m gpu` on a GPU machine).

On CPU these paths are tested in tests/test_private_api.py and the parity suites; CUDA has its own kernels
(flash for bf16, memory-efficient for fp32, ``torch._grouped_mm`` for bf16), checked here against plain
SDPA and the per-expert loop on one GPU. Not run yet: no machine this was written on had a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_private_api import blockwise_attention_against_sdpa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "dtype, kernel, tolerance",
    [
        # flash, bf16: both sides round to bf16 (one step is 2^-7 of a value near 1); a wrong block is >= 0.1
        (torch.bfloat16, "flash", 3e-2),
        # memory-efficient, fp32 (TF32 is off for SDPA's reference here too): sums in another order, ~1e-6
        (torch.float32, "efficient", 1e-4),
    ],
)
def test_cuda_attention_with_lse_merges_blocks_into_sdpa(dtype, kernel, tolerance):
    from mesh.lse_attention import fused_attention_kernel

    if kernel == "flash" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the flash kernel needs compute capability 8.0")
    assert fused_attention_kernel(torch.zeros(1, 1, 1, 16, device="cuda", dtype=dtype)) == kernel
    r = blockwise_attention_against_sdpa("cuda", dtype)
    assert r["lse_dtype"] == torch.float32 and r["lse_shape"] == (2, 4, 24), r
    assert max(r["out"], r["dq"], r["dk"], r["dv"]) < tolerance, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_ring_attention_on_one_rank_equals_sdpa(dtype):
    """cp = 1: the ring is its diagonal block alone; forward and backward against the model's own SDPA path."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ring_against_sdpa(dtype)
    finally:
        dist.destroy_process_group()


def ring_against_sdpa(dtype: torch.dtype) -> None:
    import torch.distributed as dist

    from mesh.context_parallel import ring_attention
    from models.llama import causal_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 256, h, 64, generator=gen, device="cuda").to(dtype) for h in (8, 2, 2))
    grad = torch.randn(2, 256, 8, 64, generator=gen, device="cuda").to(dtype)
    results = []
    for attend in (lambda q, k, v: ring_attention(q, k, v, group=dist.group.WORLD), causal_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4  # as in the test above
    for a, e in zip(*results, strict=True):
        assert ((a - e).abs().max() / e.abs().max()).item() < tolerance


def test_cuda_grouped_experts_equal_the_loop():
    from models.kernels import grouped_mm_works
    from models.moe import GroupedExperts

    device, dtype = torch.device("cuda"), torch.bfloat16
    if not grouped_mm_works(device, dtype, ((256, 512), (512, 256))):
        pytest.skip("torch._grouped_mm does not run on this GPU for bf16 (the experts loop instead)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 256, device=device, generator=gen).to(dtype)
    w1, w3 = (torch.randn(8, 256, 512, device=device, generator=gen).div(16).to(dtype) for _ in "13")
    w2 = torch.randn(8, 512, 256, device=device, generator=gen).div(512**0.5).to(dtype)
    counts = torch.tensor([0, 300, 100, 0, 250, 150, 100, 100], device=device)  # 300, 150, 250: not multiples of 8
    grad = torch.randn(1000, 256, device=device, generator=gen).to(dtype)
    results = []
    for run in (GroupedExperts.grouped, GroupedExperts.looped):  # grouped: rows padded to 8 (models/kernels.py)
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        out = run(leaves[0], counts, *leaves[1:])
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    # bf16 products summed in another order by another kernel: a few bf16 steps of the largest value, forward
    # (the output) and backward (the input's and every weight's gradient)
    for got, want in zip(*results, strict=True):
        assert ((got - want).abs().max() / want.abs().max()).item() < 3e-2


def test_ring_attention_memory_grows_linearly_on_one_gpu():
    """measure/ring_attention.py on one GPU: doubling the sequence doubles the peak bytes (no s_cp × s_cp tensor)."""
    from measure.ring_attention import measure

    rows = measure([4096, 8192], "cuda", "bf16", cp=1, repeats=1)["rows"]
    # linear: 2x per doubling, plus constants (kernel workspace); a score tensor would make it 4x
    assert rows[1]["ring_bytes"] / rows[0]["ring_bytes"] < 2.5, rows
