"""Older RMSNorm spellings: each fuses with the original's numbers bit for bit in float32, bfloat16
and float16, or is refused with a tag.

* older Llama / T5: the mean of squares of the float32 copy, the *uncast* input times its inverse
  root (the product promotes to float32) → fuses (``RMSNormSpec.promote``);
* ``x / torch.sqrt(mean(x * x) + eps)`` with the weight first → fuses (``RMSNormSpec.divide``, run as
  written: no provider divides);
* the weight moved to the input's device first (``self.weight.to(x.device) * f(x)``, the norm in a
  module-level function) → fuses.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import transfuse
from transfuse.ops import RMSNormSpec, rms_norm
from transfuse.ops.layers import RMSNorm

HIDDEN = 48


class OlderLlamaNorm(nn.Module):
    """Squared in float32, the uncast input normalised, weight first, cast last → fuses."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class OlderT5Norm(nn.Module):
    """The same without the cast back: the float32 product times the weight → fuses."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class DividedNorm(nn.Module):
    """``g * (x / sqrt(mean(x * x) + eps))`` in the input's dtype → fuses."""

    def __init__(self, hidden):
        super().__init__()
        self.g = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.eps = 1e-5

    def forward(self, x):
        h = x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return self.g * h


class DividedUpcastNorm(nn.Module):
    """Divided in float32, cast back before the weight → fuses."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _normalised(hidden_states, variance_epsilon=1e-6):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return (hidden_states * torch.rsqrt(variance + variance_epsilon)).to(input_dtype)


class DeviceMovedWeightNorm(nn.Module):
    """The weight moved to the input's device, times a module-level function's norm → fuses."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        return self.weight.to(hidden_states.device) * _normalised(hidden_states, self.variance_epsilon)


class SquaredOtherValueNorm(nn.Module):
    """The input squared, its sigmoid normalised → refused (``rms_norm.form``)."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = 1e-6

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (torch.sigmoid(x) * torch.rsqrt(variance + self.eps))


NORMS = (OlderLlamaNorm, OlderT5Norm, DividedNorm, DividedUpcastNorm, DeviceMovedWeightNorm)


class _Norms(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.norms = nn.ModuleList(cls(HIDDEN) for cls in classes)

    def forward(self, x):
        return torch.stack([norm(x) for norm in self.norms])


def _rewritten(model: nn.Module, x: torch.Tensor) -> transfuse.RewriteReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transfuse.rewrite(model, example_inputs=(x,))
    return transfuse.report(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_older_forms_fuse_and_round_as_the_model_did_bit_for_bit(dtype):
    torch.manual_seed(0)
    model = _Norms(NORMS).to(dtype)
    originals = [norm for norm in model.norms]
    report = _rewritten(model, torch.randn(2, 5, HIDDEN).to(dtype))
    assert [type(n) for n in model.norms] == [RMSNorm] * len(NORMS), report
    assert [n.spec.promote for n in model.norms] == [True, True, False, False, False]
    assert [n.spec.divide for n in model.norms] == [False, False, True, True, False]
    for shape in [(3, 7, HIDDEN), (1, 1, HIDDEN), (4, HIDDEN)]:
        x = (torch.randn(*shape) * 3).to(dtype)
        with torch.no_grad():
            for fused, original in zip(model.norms, originals):
                got, want = fused(x), original(x)
                assert got.dtype == want.dtype and torch.equal(got, want), type(original).__name__


def test_a_promoting_norm_of_a_float64_input_runs_as_written():
    """In float64 the product stays float64 (not float32): the op's flags cannot say so, the norm as
    written does."""
    torch.manual_seed(1)
    norm = OlderLlamaNorm(HIDDEN).double()
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    spec = RMSNormSpec(upcast=True, cast_before_weight=False, cast_output=True, promote=True)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon, spec), norm(x))


def test_another_value_normalised_than_the_one_squared_is_refused():
    model = _Norms([SquaredOtherValueNorm])
    report = _rewritten(model, torch.randn(2, 5, HIDDEN))
    assert isinstance(model.norms[0], SquaredOtherValueNorm)
    assert [s.tag for s in report.skipped if s.kind == "rms_norm"] == ["rms_norm.form"]
