"""Numerical judgement of a fused module: is it as accurate as the module it replaced?

A fixed tolerance per dtype cannot do this in low precision: one wide enough for honest bf16
rounding (about 0.4% an element) is wide enough for a formula that is 1% off. So a fused module
is judged against a *reference*, the original module run in higher precision (float64, or
float32 where it cannot run in float64) on the same inputs before its weights were merged, and
next to the original's own low-precision error against that reference:

* ``rms``: ``||a - r|| / ||r||`` over the whole tensor. It sees every kind of error, but a small
  scale error hides under bf16 rounding (a 0.3% bias next to 0.15% rounding is 2.2x the rms);
* ``bias``: ``<a - r, r> / ||r||²``, the scale error, a signed mean. Honest rounding to nearest
  averages out over the tensor; a wrong constant or a missing term does not.

The fused module ``f`` passes when, with ``o`` the original's output and ``r`` the reference:

* ``rms(f) <= RMS_FACTOR * rms(o) + floor``: it rounds at most about as coarsely as the original;
* ``|bias(f) - bias(o)| <= max(bias_floor, BIAS_SIGMAS * noise)``: its scale differs from the
  original's by no more than the difference ``f - o`` can give by chance, ``noise`` being the
  standard deviation of ``<f - o, r> / ||r||²`` were the elements of ``f - o`` independent
  (``sqrt(sum((f - o)² r²)) / ||r||²``, about their rms over the square root of the number of
  elements). A scale error makes ``f - o`` proportional to ``r``, so it stands out by the square
  root of the number of elements; the floor keeps a scale difference far below rounding from
  counting (float32 kernels that reduce in another order differ from native by a consistent
  1e-8 within a row).

``floor`` and ``bias_floor`` are ``FLOOR_ULPS[dtype]`` and ``BIAS_FLOOR_ULPS[dtype]`` units of the
output dtype's rounding (half its machine epsilon). Without a reference the
original's own output stands in for it (its error is then zero and only the floors remain).
Integer and boolean outputs must be equal, and non-finite values must sit where the original's are.

The constants, and the measurements behind them, are in ``benchmarks/results/verify_rule.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = [
    "BIAS_FLOOR_ULPS",
    "BIAS_SIGMAS",
    "FLOOR_ULPS",
    "MODEL_RMS",
    "RMS_FACTOR",
    "Error",
    "Judgement",
    "judge",
    "judge_model",
    "output_tensors",
    "relative_error",
    "tensor_error",
]

# A fused module may round up to this many times as coarsely as the original (in rms).
RMS_FACTOR = 2.0
# How many standard deviations of chance a scale difference from the original's may reach.
BIAS_SIGMAS = 5.0
# Absolute floors, in units of the output dtype's rounding (half its machine epsilon): where the
# original is exact against its reference, a fused op may still round once per output element.
UNIT_ROUNDOFF = {dtype: torch.finfo(dtype).eps / 2 for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
FLOOR_ULPS = {torch.float64: 64.0, torch.float32: 16.0, torch.float16: 1.0, torch.bfloat16: 0.5}
# In 16-bit types an honest kernel's consistent scale difference comes from float32 arithmetic,
# far below their rounding; rounding toward zero instead of to nearest (-0.27% on average in
# bf16) is not honest rounding, and is caught.
BIAS_FLOOR_ULPS = {torch.float64: 32.0, torch.float32: 8.0, torch.float16: 0.1, torch.bfloat16: 0.1}
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


@dataclass(frozen=True)
class Error:
    """One tensor's error against its reference (see the module docstring)."""

    rms: float
    bias: float
    noise: float  # standard deviation of ``bias`` if the errors were independent, from their size

    def describe(self) -> str:
        return f"rms {self.rms:.3g}, bias {self.bias:+.3g}"


_EXACT = Error(0.0, 0.0, 0.0)


def tensor_error(
    actual: torch.Tensor, expected: torch.Tensor, where: torch.Tensor | None = None, basis: torch.Tensor | None = None
) -> Error:
    """The error of ``actual`` against ``expected`` over the positions ``where`` (default: all),
    relative to ``basis`` (default: ``expected``), the tensor whose scale and direction count."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(device=a.device, dtype=torch.float64)
    r = basis.detach().to(device=a.device, dtype=torch.float64) if basis is not None else e
    if where is not None:
        a, e, r = a[where], e[where], r[where]
    d = a - e
    energy = float((r * r).sum())
    if energy == 0.0:
        # A zero reference: no scale to be relative to; any difference is reported as it is.
        size = float(d.abs().max()) if d.numel() else 0.0
        return Error(size, 0.0, 0.0) if size == 0.0 else Error(math.inf, math.inf, 0.0)
    rms = math.sqrt(float((d * d).sum()) / energy)
    bias = float((d * r).sum()) / energy
    noise = math.sqrt(float((d * d * r * r).sum())) / energy
    return Error(rms, bias, noise)


@dataclass(frozen=True)
class Judgement:
    """The verdict on one output: passed, and if not, one sentence why."""

    passed: bool
    reason: str
    fused: Error | None = None  # against the reference
    original: Error | None = None  # the original's, against the reference
    apart: Error | None = None  # the fused against the original, relative to the reference

    def describe(self) -> str:
        if self.fused is None:
            return self.reason
        against = f" (the original's: {self.original.describe()})" if self.original is not None else ""
        return f"{self.fused.describe()}{against}"


def _floor(dtype: torch.dtype, table: dict[torch.dtype, float] = FLOOR_ULPS) -> float:
    return table.get(dtype, table[torch.float32]) * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.float32])


def _same_non_finite(fused: torch.Tensor, original: torch.Tensor) -> bool:
    finite = torch.isfinite(original)
    if not torch.equal(torch.isfinite(fused), finite):
        return False
    rest = ~finite
    return bool(torch.equal(fused[rest].nan_to_num(), original[rest].nan_to_num())) if rest.any() else True


def _judge_tensor(fused: torch.Tensor, original: torch.Tensor, reference: torch.Tensor | None, i: int) -> Judgement:
    what = f"output {i}"
    if fused.shape != original.shape or fused.dtype != original.dtype:
        return Judgement(
            False,
            f"{what} is {fused.dtype} {tuple(fused.shape)}, the original's is {original.dtype} {tuple(original.shape)}",
        )
    if not (fused.is_floating_point() or fused.is_complex()):
        same = torch.equal(fused.detach().cpu(), original.detach().cpu())
        return Judgement(same, "" if same else f"{what} ({fused.dtype}) differs from the original's")
    if not _same_non_finite(fused.detach(), original.detach()):
        return Judgement(False, f"{what} has non-finite values where the original's does not, or other ones")
    where = torch.isfinite(original)
    if reference is not None:
        reference = reference.to(original.device)
        where = where & torch.isfinite(reference)
    if not where.any():
        return Judgement(True, "")
    floor = _floor(original.dtype)
    basis = reference if reference is not None else original
    got = tensor_error(fused, basis, where)
    own = tensor_error(original, basis, where) if reference is not None else _EXACT
    apart = tensor_error(fused, original, where, basis)  # f - o, projected on the reference
    rms_limit = RMS_FACTOR * own.rms + floor
    bias_limit = max(_floor(original.dtype, BIAS_FLOOR_ULPS), BIAS_SIGMAS * apart.noise)
    if got.rms > rms_limit:
        reason = f"{what}: rms error {got.rms:.3g} exceeds {rms_limit:.3g}"
    elif abs(apart.bias) > bias_limit:
        reason = f"{what}: its scale differs from the original's by {apart.bias:+.3g}, beyond ±{bias_limit:.3g}"
    else:
        return Judgement(True, "", got, own if reference is not None else None, apart)
    own_text = f"the original's {own.describe()}" if reference is not None else "no higher-precision reference"
    return Judgement(False, f"{reason} ({own_text})", got, own if reference is not None else None, apart)


def judge(fused: Any, original: Any, reference: Any | None) -> Judgement:
    """Whether ``fused`` is as accurate as ``original`` against ``reference`` (module outputs of the
    same structure; ``reference`` may be None). The worst tensor speaks for the output."""
    got, want = output_tensors(fused), output_tensors(original)
    refs = output_tensors(reference) if reference is not None else [None] * len(want)
    if len(got) != len(want) or len(refs) != len(want):
        return Judgement(False, f"the output has {len(got)} tensors, the original's has {len(want)}")
    worst: Judgement | None = None
    for i, (f, o, r) in enumerate(zip(got, want, refs)):
        if r is not None and (r.shape != o.shape):
            r = None  # a reference of another structure cannot speak for this tensor
        verdict = _judge_tensor(f, o, r, i)
        if not verdict.passed:
            return verdict
        if verdict.fused is not None and (worst is None or verdict.fused.rms > worst.fused.rms):
            worst = verdict
    return worst or Judgement(True, "")


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
        if not _same_non_finite(f.detach(), o.detach()):
            return Judgement(False, f"output {i} has non-finite values where the original's does not, or other ones")
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
