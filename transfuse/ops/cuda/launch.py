"""Host side of the CUDA providers: view inputs as rows, allocate outputs, call the extension."""

from __future__ import annotations

from torch import Tensor

from .build import extension

__all__ = ["fused_add_rms_norm", "rms_norm", "silu_and_mul"]


def rms_norm(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output) -> Tensor:
    """The cuda provider of ``rms_norm``: float32 normalisation, output in the input dtype."""
    rows = x.reshape(-1, x.shape[-1])  # a view whenever the leading dimensions collapse
    out = x.new_empty(x.shape)
    if rows.shape[0]:
        extension().rms_norm(out.view(rows.shape), rows, weight, eps, cast_before_weight, offset, weight_fp32)
    return out


def fused_add_rms_norm(
    x, residual, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output
) -> tuple[Tensor, Tensor]:
    """The cuda provider of ``fused_add_rms_norm``: as ``rms_norm``, on ``residual + x``."""
    rows = x.reshape(-1, x.shape[-1])
    residual_rows = residual.reshape(rows.shape)
    out, residual_out = x.new_empty(x.shape), x.new_empty(x.shape)
    if rows.shape[0]:
        extension().fused_add_rms_norm(
            out.view(rows.shape),
            residual_out.view(rows.shape),
            rows,
            residual_rows,
            weight,
            eps,
            cast_before_weight,
            offset,
            weight_fp32,
        )
    return out, residual_out


def silu_and_mul(x: Tensor) -> Tensor:
    """The cuda provider of ``silu_and_mul``."""
    rows = x.reshape(-1, x.shape[-1])
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    if rows.shape[0]:
        extension().silu_and_mul(out.view(rows.shape[0], -1), rows)
    return out
