"""Building blocks of the Llama family: RMSNorm, rotary position embedding, SiLU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.kernels.support import KernelSupport
from kvserve.arch import ModelArchitecture
from kvserve.model.linear import GateUpSiluLinear, Linear, cat_rows


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, ops=None):
        """`ops`: the compiled module where KernelSupport turned rms_norm on, else None."""
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x); with `residual`, first `residual += x` in place and normalise that
        (the pre-norm residual stream of a decoder layer, one pass instead of two)."""
        if self.ops is not None and x.is_contiguous():
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        # statistics in fp32 as the reference does; the result goes back to the model dtype
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_attention_factor(arch: ModelArchitecture) -> float:
    """The factor on cos and sin (so on every attention logit, squared): YaRN's and LongRoPE's, else 1."""
    scaling = arch.rope_scaling
    if scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.rope_type == "longrope":
        if scaling.factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def _yarn_inverse_frequencies(arch: ModelArchitecture, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: dimensions that turn more than beta_fast times over the original context keep
    their frequency, those under beta_slow are interpolated (÷ factor), a linear ramp between."""
    s, dim, base = arch.rope_scaling, arch.rotary_dim, arch.rope_theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def longrope_long(arch: ModelArchitecture, max_positions: int) -> bool:
    """LongRoPE's choice of factors, once per model: the long ones where the engine serves more
    than the original context (llama.cpp chooses by its context size the same way;
    transformers by each sequence's length, which agrees below the original context).
    `max_positions`: the RoPE table's rows, the longest context served + 1."""
    return max_positions - 1 > arch.rope_scaling.original_max_position_embeddings


def rope_inverse_frequencies(
    arch: ModelArchitecture, rope_freqs: torch.Tensor | None = None, max_positions: int | None = None
) -> torch.Tensor:
    """θ_i = theta^(-2i/R) over the R = rotary_dim turned features, adjusted by the model's
    RoPE scaling. `max_positions`: the table's rows, the context served + 1 (LongRoPE's short
    or long factors)."""
    dim = arch.rotary_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = arch.rope_scaling
    if rope_freqs is not None:  # GGUF carries precomputed per-frequency divisors (llama3, longrope)
        inv_freq = inv_freq / rope_freqs.to(torch.float64)
    elif scaling.rope_type == "longrope":
        long = longrope_long(arch, max_positions or arch.max_position_embeddings + 1)
        factors = scaling.long_factor if long else scaling.short_factor
        if factors is None or len(factors) != dim // 2:
            raise ValueError(f"longrope needs {'long' if long else 'short'}_factor with {dim // 2} values")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn_inverse_frequencies(arch, inv_freq)
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(mid, blended, inv_freq)
    return inv_freq.to(torch.float32)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table computed once for every position."""

    def __init__(self, arch: ModelArchitecture, max_positions: int, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        inv_freq = rope_inverse_frequencies(arch, rope_freqs, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # [max_pos, H/2]: rotate-half uses the same angle for both halves of a row, so one
        # half is stored; the fused kernel reads it as is, `lookup` widens the rows it needs.
        # YaRN's attention factor is folded in here, as transformers scales its cos and sin
        factor = rope_attention_factor(arch)
        self.register_buffer("cos_half", (freqs.cos() * factor).contiguous(), persistent=False)
        self.register_buffer("sin_half", (freqs.sin() * factor).contiguous(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for these positions, [T, 1, H]; computed once per step, shared by all layers."""
        cos = self.cos_half.index_select(0, positions).to(dtype)
        sin = self.sin_half.index_select(0, positions).to(dtype)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, H]; cos/sin [T, 1, R]: rotate-half over the first R features (all of
    them but under partial rotary), the rest passed through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul whose method applies the SiLU."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, kernels: KernelSupport):
        super().__init__()
        self.gate_up = GateUpSiluLinear(gate, up, kernels)
        self.down = Linear(down, None, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x))


class GeluTanhMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's GeGLU): gate and up in one plain matmul, the
    activation by the kernels' gelu_tanh_and_mul where KernelSupport turned the MLP activation
    on (the fused decode step runs the same op), else in torch."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, kernels: KernelSupport):
        super().__init__()
        self.gate_up = Linear(cat_rows([gate, up]), None, kernels)
        self.down = Linear(down, None, kernels)
        self.act_ops = kernels.op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.act_ops is not None and gate_up.is_contiguous():
            return self.down(self.act_ops.gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(torch.nn.functional.gelu(gate, approximate="tanh") * up)
