"""Numerical judgement of a fused module: is it as accurate as the module it replaced?

The rule is the one every fused computation meets (``transfuse.ops.accuracy``): the fused
module's output against a *reference*, the original module run in higher precision (float64,
or float32 where it cannot run in float64) on the same inputs before its weights were merged,
next to the original's own low-precision error against that reference. This module applies it
to module outputs (a causal LM's logits, or every tensor of a module's output) and adds the
whole-model check, which only asks that the fused modules compose.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..ops.accuracy import (
    BIAS_FLOOR_ULPS,
    BIAS_SIGMAS,
    EXACT,
    FLOOR_ULPS,
    NON_FINITE,
    RMS_FACTOR,
    Error,
    Judgement,
    _same_non_finite,
    judge_tensors,
    limits,
    tensor_error,
)

__all__ = [
    "BIAS_FLOOR_ULPS",
    "BIAS_SIGMAS",
    "EXACT",
    "FLOOR_ULPS",
    "MODEL_RMS",
    "RMS_FACTOR",
    "Error",
    "Judgement",
    "judge",
    "judge_model",
    "limits",
    "output_tensors",
    "relative_error",
    "tensor_error",
]

# The whole model against its own output before the rewrite (rms over the logits): errors of many
# modules add up through the layers, so this is a check that the fused modules compose, not a
# judgement of their precision (each was judged alone against its reference).
MODEL_RMS = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output, in order; for a causal LM output, its logits."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return [logits]
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def judge(fused: Any, original: Any, reference: Any | None) -> Judgement:
    """Whether ``fused`` is as accurate as ``original`` against ``reference`` (module outputs of the
    same structure; ``reference`` may be None). The worst tensor speaks for the output."""
    got, want = output_tensors(fused), output_tensors(original)
    refs = output_tensors(reference) if reference is not None else None
    if refs is not None and len(refs) != len(want):
        return Judgement(False, f"the output has {len(got)} tensors, the original's has {len(want)}")
    return judge_tensors(got, want, refs)


def judge_model(fused: Any, original: Any) -> Judgement:
    """The whole model's output against its output before the rewrite: ``MODEL_RMS`` per dtype."""
    got, want = output_tensors(fused), output_tensors(original)
    if len(got) != len(want):
        return Judgement(False, f"the output has {len(got)} tensors, the original's has {len(want)}")
    worst = None
    for i, (f, o) in enumerate(zip(got, want)):
        if f.shape != o.shape or f.dtype != o.dtype:
            return Judgement(False, f"output {i} is {f.dtype} {tuple(f.shape)}, the original's is {o.dtype} {tuple(o.shape)}")
        if not f.is_floating_point():
            if not torch.equal(f, o):
                return Judgement(False, f"output {i} ({f.dtype}) differs from the original's")
            continue
        if not _same_non_finite([f.detach(), o.detach()]):
            return Judgement(False, f"output {i} has non-finite values where the original's does not, or other ones", tag=NON_FINITE)
        where = torch.isfinite(o)
        if not where.any():
            continue
        error = tensor_error(f, o, where)
        limit = MODEL_RMS.get(o.dtype, MODEL_RMS[torch.float32])
        if error.rms > limit:
            return Judgement(False, f"output {i}: rms difference {error.rms:.3g} exceeds {limit:.1g}", error)
        if worst is None or error.rms > worst.fused.rms:
            worst = Judgement(True, "", error)
    return worst or Judgement(True, "")


def relative_error(actual: Any, expected: Any) -> float:
    """Largest ``max|a - e| / max|e|`` over the outputs' tensors; inf if their structure differs.
    (For benchmarks' accuracy columns; verification uses ``judge``.)"""
    got, want = output_tensors(actual), output_tensors(expected)
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, e in zip(got, want):
        if a.shape != e.shape or a.dtype != e.dtype:
            return float("inf")
        if a.numel() == 0 or not a.is_floating_point():
            continue
        a64, e64 = a.detach().to(torch.float64), e.detach().to(torch.float64)
        if not torch.isfinite(a64).eq(torch.isfinite(e64)).all():
            return float("inf")
        finite = torch.isfinite(e64)
        diff = (a64 - e64).abs()[finite]
        if diff.numel() == 0:
            continue
        scale = e64.abs()[finite].max()
        err = (diff.max() / scale).item() if scale > 0 else (0.0 if diff.max() == 0 else float("inf"))
        worst = max(worst, err)
    return worst
