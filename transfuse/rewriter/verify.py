"""Numerical comparison of a rewritten module's outputs with the original's.

The error of a tensor is its largest absolute difference over the reference's largest
magnitude (the logit scale, for logits). Tolerances are per dtype: a fused op that
rounds differently within one ulp of the dtype passes; a wrong formula does not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["LOCAL_TOLERANCE", "MODEL_TOLERANCE", "relative_error", "tolerance", "output_tensors"]

# One fused module against the module it replaced.
LOCAL_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The whole model's output: errors of many fused modules add up.
MODEL_TOLERANCE = {dtype: 8 * tol for dtype, tol in LOCAL_TOLERANCE.items()}


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a module's output; for a causal LM output, its logits."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return [logits]
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def relative_error(actual: Any, expected: Any) -> float:
    """Largest ``max|a - e| / max|e|`` over the outputs' tensors; inf if their structure differs."""
    got, want = output_tensors(actual), output_tensors(expected)
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, e in zip(got, want):
        if a.shape != e.shape or a.dtype != e.dtype:
            return float("inf")
        if a.numel() == 0:
            continue
        a64, e64 = a.detach().to(torch.float64), e.detach().to(torch.float64)
        if not torch.isfinite(a64).eq(torch.isfinite(e64)).all():
            return float("inf")
        finite = torch.isfinite(e64)
        diff = (a64 - e64).abs()[finite]
        scale = e64.abs()[finite].max() if finite.any() else torch.tensor(0.0, dtype=torch.float64)
        if diff.numel() == 0:
            continue
        err = (diff.max() / scale).item() if scale > 0 else (0.0 if diff.max() == 0 else float("inf"))
        worst = max(worst, err)
    return worst


def tolerance(output: Any, table: dict[torch.dtype, float]) -> float:
    """The tolerance for the least precise dtype among the output's tensors."""
    tensors = output_tensors(output)
    return max((table.get(t.dtype, 1e-5) for t in tensors), default=table[torch.float32])
