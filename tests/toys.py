"""Toy modules that imitate Hugging Face idioms, each named for what it imitates.

Each docstring ends in its verdict: "→ fuses" or "→ refused (tag)".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


# ---- RMSNorm written every way a modeling file writes it -----------------------------


class LlamaStyleNorm(nn.Module):
    """float32, cast back, then weight (Llama) → fuses."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaStyleNorm(nn.Module):
    """(1 + weight) in float32, cast last, through a helper method (Gemma) → fuses."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class SquareRsqrtPowNorm(nn.Module):
    """torch.square, pow(-0.5), weight times float32 then cast (OLMo 2 rounding) → fuses."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * (torch.square(h).mean(dim=-1, keepdim=True) + self.eps).pow(-0.5)
        return (self.scale * h).to(x.dtype)


class OperatorSpellingNorm(nn.Module):
    """x * x and ``** -0.5``, computed in the input dtype, no weight → fuses."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * ((x * x).mean(-1, keepdim=True) + self.eps) ** -0.5


class PowOperatorNorm(nn.Module):
    """``x ** 2`` and torch.mean with keyword arguments, zero-centred weight without a cast → fuses."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden) * 0.1)
        self.eps = eps

    def forward(self, x):
        normed = x * torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + self.eps)
        return normed * (1 + self.weight)


def _passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class DecoratedNorm(LlamaStyleNorm):
    """A forward under a functools.wraps decorator (like @deprecate_kwarg) → fuses."""

    @_passthrough
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LayerNormMath(nn.Module):
    """Mean subtraction: LayerNorm, not RMSNorm → refused (rms_norm.mean-subtracted)."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(var + self.eps))


class GatedRMSNorm(nn.Module):
    """A second input gates the norm (Mamba-2 style) → refused (rms_norm.inputs)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x, gate):
        x = x * F.silu(gate)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x


class TrailingComputeNorm(nn.Module):
    """A bias added after the norm → refused (rms_norm.trailing-compute)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return h * 2.0 + 1.0


class WrongDimNorm(nn.Module):
    """The mean over dimension 1, not the last → refused (rms_norm.reduce-dim)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps)


class LiteralEpsNorm(nn.Module):
    """eps written as a literal, not an attribute → refused (rms_norm.eps-source)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class BufferEpsNorm(nn.Module):
    """eps kept in a tensor buffer, not a float attribute → refused (rms_norm.eps-source)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("eps", torch.tensor(1e-6))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class BranchingRMSNorm(nn.Module):
    """A branch on an attribute the trace cannot see both ways → refused (rms_norm.control-flow)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps
        self.skip = False

    def forward(self, x):
        if self.skip:
            return x
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


# ---- tracer idioms ---------------------------------------------------------------------


class DataDependentBranch(nn.Module):
    """A branch on a tensor's values: the trace stops there and keeps the graph before it."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.proj(x)
        s = h.sum()
        if s > 0:
            h = h * 2
        return h


class ShapeUnpacking(nn.Module):
    """``b, s, _ = x.shape`` and a ``*``-splat into view: traces with meta values."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, cache=None):
        bsz, seq, _ = x.shape
        shape = (*x.shape[:-1], self.heads, -1)
        out, _unused = self.proj(x).view(shape), cache
        return out.reshape(bsz, seq, -1)


# ---- small models around the norms, for rewrite() -----------------------------------


class TinyNormModel(nn.Module):
    """Two projections around any norm class; a model for rewrite() without transformers."""

    def __init__(self, norm: nn.Module, hidden: int = 32):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.norm = norm
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))
