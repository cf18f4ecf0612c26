"""Shared checks for parity tests: the fp32 tolerance and the loss-curve comparison."""

from __future__ import annotations

# fp32 parity tolerance. Sharded runs add the same numbers in a different order (reduce-scatter, all-reduce,
# split matmuls): each sum differs by ~1e-7 relative, and a few optimizer steps grow that to ~1e-6 on the
# loss (measured: <= 3e-7 over 6 steps). 1e-5 leaves headroom yet still fails on any real bug, which shows
# up at 1e-3 or more (a gradient scaled by 1/dp, a wrong data slice, a different init).
LOSS_RTOL = 1e-5


def assert_same_curve(actual: list[dict], expected: list[dict], rtol: float = LOSS_RTOL, keys=("loss", "grad_norm")):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        for key in keys:
            rel = abs(a[key] - e[key]) / abs(e[key])
            assert rel <= rtol, f"step {e['step']} {key}: {a[key]!r} vs reference {e[key]!r} (rel {rel:.2e} > {rtol})"
        assert a["tokens_consumed"] == e["tokens_consumed"]
