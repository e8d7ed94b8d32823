"""A norm that branches on an optional kernel imported at module level (None where the import
failed) and on the input being on a GPU: with the global None only one path is possible, so the
branch is decided as None → fuses, the report says which branch; the fused layer checks the global
per call and runs the original forward once it is not None."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from torch import nn

import transfuse
from transfuse.ops.layers import RMSNorm

try:
    from transfuse_absent_kernels import fused_rms_norm  # an optional package, never installed
except ImportError:
    fused_rms_norm = None

HIDDEN = 40


class OptionalKernelNorm(nn.Module):
    """``if fused_rms_norm is not None and x.is_cuda:`` the kernel, else Llama's norm → fuses."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(hidden))
        self.eps = 1e-6

    def forward(self, x):
        if fused_rms_norm is not None and x.is_cuda:
            return fused_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class OptionalKernelAnywhereNorm(OptionalKernelNorm):
    """``if fused_rms_norm is not None:`` the kernel on any device → fuses, guarded."""

    def forward(self, x):
        if fused_rms_norm is not None:
            return fused_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _Harness(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


def _rewritten(norm: nn.Module, dtype: torch.dtype) -> nn.Module:
    model = _Harness(norm).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, HIDDEN).to(dtype),))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_branch_on_an_absent_optional_kernel_is_decided_and_reported(dtype):
    torch.manual_seed(0)
    original = OptionalKernelNorm(HIDDEN).to(dtype)
    model = _rewritten(copy.deepcopy(original), dtype)
    assert isinstance(model.norm, RMSNorm)
    (fusion,) = transfuse.report(model).fusions
    assert f"{__name__}.fused_rms_norm None" in fusion.into
    x = (torch.randn(3, 7, HIDDEN) * 2).to(dtype)
    with torch.no_grad():
        assert torch.equal(model(x), original(x))


def test_the_original_forward_runs_once_the_global_is_set():
    torch.manual_seed(1)
    model = _rewritten(OptionalKernelAnywhereNorm(HIDDEN), torch.float32)
    assert isinstance(model.norm, RMSNorm)
    calls = []

    def kernel(x, weight, eps):
        calls.append(x.shape)
        return torch.full_like(x, 7.0)

    module = sys.modules[__name__]
    x = torch.randn(2, HIDDEN)
    module.fused_rms_norm = kernel
    try:
        with torch.no_grad():
            assert torch.equal(model(x), torch.full_like(x, 7.0)) and calls == [x.shape]
    finally:
        module.fused_rms_norm = None
    with torch.no_grad():
        assert not torch.equal(model(x), torch.full_like(x, 7.0)) and len(calls) == 1
