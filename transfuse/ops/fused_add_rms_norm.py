"""fused_add_rms_norm: ``residual = residual + x``, then ``rms_norm(residual)``; both are returned.

A pre-norm decoder layer adds each block's output to the residual stream and normalises
the sum for the next block. One kernel reads ``x`` and ``residual`` once and writes the
normalised value and the new residual once, where unfused code reads the sum again.
The sum is taken in the inputs' dtype, as the model's own ``residual + hidden_states``
does, and the norm rounds as ``RMSNormSpec`` says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .conformance import Rows
from .dispatch import Op, Provider
from .rms_norm import RMSNormSpec, builtin_rounds_alike, rms_norm_as_written, rms_norm_native

__all__ = ["FUSED_ADD_RMS_NORM", "fused_add_rms_norm", "fused_add_rms_norm_native"]


def fused_add_rms_norm_native(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float,
    upcast: bool,
    cast_before_weight: bool,
    offset: bool,
    weight_fp32: bool,
    cast_output: bool,
) -> tuple[Tensor, Tensor]:
    residual = residual + x
    normed = rms_norm_native(residual, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output)
    return normed, residual


FUSED_ADD_RMS_NORM = Op(
    "fused_add_rms_norm", fused_add_rms_norm_native, sampler=Rows("x", "residual", grads=("x", "residual", "weight")),
    library=True,
)


def _torch_supports(x, residual, weight, eps, *flags) -> bool:
    return x.dtype == residual.dtype and builtin_rounds_alike(x, weight, eps, *flags)


def _torch_fused_add_rms_norm(x, residual, weight, eps, *flags):
    residual = residual + x
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps), residual


FUSED_ADD_RMS_NORM.register(
    Provider("torch", _torch_fused_add_rms_norm, supports_args=_torch_supports, differentiable=True)
)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, spec: RMSNormSpec = RMSNormSpec()
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(residual + x), residual + x)`` over the last dimension with the rounding of ``spec``."""
    if spec.as_written(x):
        residual = residual + x
        return rms_norm_as_written(residual, weight, eps, spec), residual
    return FUSED_ADD_RMS_NORM(x, residual, weight, eps, *spec.flags())
