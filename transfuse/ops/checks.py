"""Cheap per-call argument checks that kernel providers share (``supports_args`` building blocks).

Kernels read a ``[..., hidden]`` tensor as rows with unit stride along ``hidden`` and any
stride between rows; they compute in float32 from float32, float16 or bfloat16 storage.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KERNEL_DTYPES", "rows_fit", "same_rows", "weight_fits"]

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rows_fit(x: Tensor, max_width: int) -> bool:
    """``x`` is a non-empty float tensor whose last dimension is contiguous and at most ``max_width``."""
    return x.dtype in KERNEL_DTYPES and x.dim() >= 1 and 0 < x.shape[-1] <= max_width and x.stride(-1) == 1


def same_rows(x: Tensor, other: Tensor) -> bool:
    """``other`` has ``x``'s shape, dtype and device, with a contiguous last dimension."""
    return other.shape == x.shape and other.dtype == x.dtype and other.device == x.device and other.stride(-1) == 1


def weight_fits(weight: Tensor | None, x: Tensor) -> bool:
    """No weight, or a contiguous 1-D float weight of ``x``'s width on ``x``'s device."""
    if weight is None:
        return True
    return (
        weight.dtype in KERNEL_DTYPES
        and weight.shape == x.shape[-1:]
        and weight.stride(-1) == 1
        and weight.device == x.device
    )
