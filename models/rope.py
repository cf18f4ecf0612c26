"""Rotary position embedding frequencies, with the context-extension rescalings Llama models ship with.

RoPE rotates the pair (x_i, x_{i+d/2}) of a head of size d at position m by the angle m * w_i, with
w_i = theta^(-2i/d) for i = 0 .. d/2 - 1: fast-turning pairs (large w_i, short wavelength 2 pi / w_i) resolve
nearby positions, slow ones (long wavelength) tell far-apart positions apart. A model trained on contexts of
length L0 has only seen the angles m * w_i with m < L0; scaling lowers some frequencies so that a longer
context maps onto angles the model has seen.

1. ``none``: w_i as above.
2. ``linear`` (position interpolation): every w_i / factor, i.e. position m is read as m / factor.
3. ``llama3`` (Llama 3.1): per wavelength lambda_i = 2 pi / w_i, with L0 the original context length,
   lambda_hi = L0 / high_freq_factor and lambda_lo = L0 / low_freq_factor (lambda_hi < lambda_lo):
   - lambda_i < lambda_hi (turns many times within L0): w_i unchanged;
   - lambda_i > lambda_lo (turns less than low_freq_factor times within L0): w_i / factor;
   - in between, a blend linear in L0 / lambda_i (the number of turns within L0):
     s = (L0 / lambda_i - low_freq_factor) / (high_freq_factor - low_freq_factor), which goes from 0 at
     lambda_lo to 1 at lambda_hi, and w_i' = (1 - s) * w_i / factor + s * w_i.
   Neither type changes the attention scale (transformers' "attention factor" is 1 for both).
4. ``yarn`` (YaRN, Peng et al. 2023; DeepSeek-V3, GPT-OSS, long-context Qwen): pair i keeps w_i (extrapolation)
   below a dimension range and takes w_i / factor (interpolation) above it, with a linear ramp between. The
   range is where a pair turns between ``beta_fast`` and ``beta_slow`` times within L0: the dimension of r turns
   is d ln(L0 / (2 pi r)) / (2 ln theta), floored / ceiled when ``truncate``. YaRN also multiplies cos and sin by
   an attention factor, 0.1 ln(factor) + 1 (or the ratio of two such terms with ``mscale`` and
   ``mscale_all_dim``): ``attention_factor`` below, applied in models/llama.rotary_tables.

The frequencies are computed once, into the model's cos/sin tables (models/llama.rotary_tables), so every
layout, every pipeline stage and the KV cache read the same angles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclass
class RopeScaling:
    kind: str = "none"  # one of ROPE_SCALINGS
    factor: float = 1.0  # linear and llama3: how much longer the new context is
    low_freq_factor: float = 1.0  # llama3: wavelengths above L0 / low_freq_factor are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below L0 / high_freq_factor are kept
    original_max_seq_len: int = 8192  # llama3, yarn: L0, the context length the model was pre-trained on
    beta_fast: float = 32.0  # yarn: pairs turning more often than this within L0 keep their frequency
    beta_slow: float = 1.0  # yarn: pairs turning less often than this are interpolated (divided by factor)
    mscale: float = 0.0  # yarn: with mscale_all_dim, the attention factor's numerator coefficient (0: unused)
    mscale_all_dim: float = 0.0  # yarn: its denominator's; DeepSeek also scales the softmax by its square
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions

    def problems(self) -> list[str]:
        """Why these values cannot be used (empty: they can)."""
        if self.kind not in ROPE_SCALINGS:
            return [f"RoPE scaling {self.kind!r} is not supported; meshloom supports {', '.join(ROPE_SCALINGS)}"]
        out = []
        if self.kind != "none" and not self.factor > 0:
            out.append(f"RoPE scaling factor {self.factor} must be > 0")
        if self.kind == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                out.append(
                    f"llama3 RoPE scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                    f"({self.high_freq_factor})"
                )
            if self.original_max_seq_len < 1:
                out.append(f"llama3 RoPE scaling original_max_seq_len {self.original_max_seq_len} must be >= 1")
        return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (step 4); 1 for every other scaling."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_frequencies(w: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Step 4: extrapolated w below the ramp, w / factor above it, blended linearly between."""

    def dimension_of(turns: float) -> float:
        return head_dim * math.log(s.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=w.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency unchanged), 0: interpolate
    return (w / s.factor) * (1 - keep) + w * keep


def base_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """w_i = theta^(-2i/d), i = 0 .. d/2 - 1 (float32)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def scaled_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """The rotary frequencies after ``scaling`` (steps 1-3 of the module docstring)."""
    w = base_frequencies(head_dim, theta, device)
    if scaling is None or scaling.kind == "none":
        return w
    if scaling.kind == "linear":
        return w / scaling.factor
    if scaling.kind == "yarn":
        return yarn_frequencies(w, head_dim, theta, scaling)
    if scaling.kind != "llama3":
        raise ValueError(RopeScaling(scaling.kind).problems()[0])
    s = scaling
    wavelength = 2 * math.pi / w
    turns = s.original_max_seq_len / wavelength  # how many full turns within the original context
    blend = ((turns - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
    # blend is 1 where the wavelength is below L0 / high_freq_factor (kept), 0 above L0 / low_freq_factor
    # (divided by factor), linear in the number of turns in between.
    return (1 - blend) * w / s.factor + blend * w
