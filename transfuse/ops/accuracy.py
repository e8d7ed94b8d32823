"""The error rule: is a computation as accurate as the one it replaces?

A fixed tolerance per dtype cannot decide this in low precision: one wide enough for honest bf16
rounding (about 0.4% an element) is wide enough for a formula that is 1% off. So a fused result is
judged against a *reference*, the original computation in higher precision (float64, or float32)
on the same inputs, next to the original's own low-precision error against that reference:

* ``rms``: ``||a - r|| / ||r||`` over the whole tensor. It sees every kind of error, but a small
  scale error hides under bf16 rounding (a 0.3% bias next to 0.15% rounding is 2.2x the rms);
* ``bias``: ``<a - r, r> / ||r||²``, the scale error, a signed mean. Honest rounding to nearest
  averages out over the tensor; a wrong constant or a missing term does not.

The fused result ``f`` passes when, with ``o`` the original's result and ``r`` the reference:

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
output dtype's rounding (half its machine epsilon). Without a reference the original's own result
stands in for it (its error is then zero and only the floors remain). Integer and boolean results
must be equal. Non-finite values must be the same values at the same places in the fused result,
the original's and the reference; elsewhere they refuse (``verify.non-finite``), and so does a
result with no finite value to compare. The same rule judges a fused module (``rewriter/``) and a
provider against its op's native definition (``conformance``). The constants, and the
measurements behind them, are in ``benchmarks/results/`` (``*verify_rule*``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "BIAS_FLOOR_ULPS",
    "BIAS_SIGMAS",
    "FLOOR_ULPS",
    "RMS_FACTOR",
    "RULE",
    "UNIT_ROUNDOFF",
    "Tolerance",
    "Error",
    "Judgement",
    "judge_tensors",
    "tensor_error",
]

# A fused result may round up to this many times as coarsely as the original (in rms).
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

MISMATCH = "verify.mismatch"
NON_FINITE = "verify.non-finite"


@dataclass(frozen=True)
class Error:
    """One tensor's error against its reference (see the module docstring)."""

    rms: float
    bias: float
    noise: float  # standard deviation of ``bias`` if the errors were independent, from their size

    def describe(self) -> str:
        return f"rms {self.rms:.3g}, bias {self.bias:+.3g}"


EXACT = Error(0.0, 0.0, 0.0)


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
    """The verdict on one result: passed, and if not, one sentence why and a tag."""

    passed: bool
    reason: str
    fused: Error | None = None  # against the reference
    original: Error | None = None  # the original's, against the reference
    apart: Error | None = None  # the fused against the original, relative to the reference
    tag: str = MISMATCH

    def describe(self) -> str:
        if self.fused is None:
            return self.reason
        against = f" (the original's: {self.original.describe()})" if self.original is not None else ""
        return f"{self.fused.describe()}{against}"


def floor(dtype: torch.dtype, table: dict[torch.dtype, float] = FLOOR_ULPS) -> float:
    """``table``'s floor for ``dtype``, in absolute terms."""
    return table.get(dtype, table[torch.float32]) * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.float32])


@dataclass(frozen=True)
class Tolerance:
    """The rule's constants, for a computation that declared wider ones: ``rms_factor`` times the
    original's rms error, plus at least ``rms_floor``; a scale difference of ``bias_floor`` at least."""

    rms_factor: float = RMS_FACTOR
    rms_floor: float = 0.0
    bias_floor: float = 0.0


RULE = Tolerance()


def limits(dtype: torch.dtype, own: Error, apart: Error, tolerance: Tolerance = RULE) -> tuple[float, float]:
    """(rms limit, bias limit) of a fused result whose original has error ``own`` and which differs
    from the original by ``apart``."""
    rms = tolerance.rms_factor * own.rms + max(floor(dtype), tolerance.rms_floor)
    bias = max(floor(dtype, BIAS_FLOOR_ULPS), BIAS_SIGMAS * apart.noise, tolerance.bias_floor)
    return rms, bias


def _same_non_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """All tensors have their non-finite values at the same places, with the same values."""
    first = tensors[0]
    finite = torch.isfinite(first)
    rest = ~finite
    for other in tensors[1:]:
        other = other.to(first.device)
        if not torch.equal(torch.isfinite(other), finite):
            return False
        if rest.any() and not torch.equal(other[rest].to(first.dtype).nan_to_num(), first[rest].nan_to_num()):
            return False
    return True


def _judge_tensor(
    fused: torch.Tensor, original: torch.Tensor, reference: torch.Tensor | None, what: str, tolerance: Tolerance
) -> Judgement:
    if fused.shape != original.shape or fused.dtype != original.dtype:
        return Judgement(
            False,
            f"{what} is {fused.dtype} {tuple(fused.shape)}, the original's is {original.dtype} {tuple(original.shape)}",
        )
    if not (fused.is_floating_point() or fused.is_complex()):
        same = torch.equal(fused.detach().cpu(), original.detach().cpu())
        return Judgement(same, "" if same else f"{what} ({fused.dtype}) differs from the original's")
    fused, original = fused.detach(), original.detach()
    if reference is not None:
        reference = reference.detach().to(original.device)
    compared = [fused, original] + ([reference] if reference is not None else [])
    if not _same_non_finite(compared):
        return Judgement(
            False,
            f"{what} has non-finite values that the original's"
            f"{' or its higher-precision reference' if reference is not None else ''} does not have at the same places",
            tag=NON_FINITE,
        )
    where = torch.isfinite(original)
    if original.numel() and not where.any():
        return Judgement(False, f"{what} has no finite value to compare", tag=NON_FINITE)
    if not where.any():
        return Judgement(True, "")
    basis = reference if reference is not None else original
    got = tensor_error(fused, basis, where)
    own = tensor_error(original, basis, where) if reference is not None else EXACT
    apart = tensor_error(fused, original, where, basis)  # f - o, projected on the reference
    rms_limit, bias_limit = limits(original.dtype, own, apart, tolerance)
    # A scale no farther from the reference's than the original's is no scale error of the fused
    # result's own (a kernel that computes in float32 where the original rounds each step).
    closer = reference is not None and abs(got.bias) <= abs(own.bias)
    if got.rms > rms_limit:
        reason = f"{what}: rms error {got.rms:.3g} exceeds {rms_limit:.3g}"
    elif abs(apart.bias) > bias_limit and not closer:
        reason = f"{what}: its scale differs from the original's by {apart.bias:+.3g}, beyond ±{bias_limit:.3g}"
    else:
        return Judgement(True, "", got, own if reference is not None else None, apart)
    own_text = f"the original's {own.describe()}" if reference is not None else "no higher-precision reference"
    return Judgement(False, f"{reason} ({own_text})", got, own if reference is not None else None, apart)


def judge_tensors(
    fused: Sequence[torch.Tensor],
    original: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor | None] | None,
    names: Sequence[str] | None = None,
    tolerance: Tolerance = RULE,
) -> Judgement:
    """Whether each of ``fused`` is as accurate as the matching ``original`` against ``reference``
    (None, or None entries: no reference). The worst tensor speaks for the result. ``tolerance``:
    the rule's constants, or wider ones a provider declared (``dispatch.Provider.tolerance``)."""
    if len(fused) != len(original):
        return Judgement(False, f"the result has {len(fused)} tensors, the original's has {len(original)}")
    refs = list(reference) if reference is not None else [None] * len(original)
    if len(refs) != len(original):
        refs = [None] * len(original)
    worst: Judgement | None = None
    for i, (f, o, r) in enumerate(zip(fused, original, refs)):
        if r is not None and r.shape != o.shape:
            r = None  # a reference of another structure cannot speak for this tensor
        verdict = _judge_tensor(f, o, r, names[i] if names is not None else f"output {i}", tolerance)
        if not verdict.passed:
            return verdict
        if verdict.fused is not None and (worst is None or verdict.fused.rms > worst.fused.rms):
            worst = verdict
    return worst or Judgement(True, "")
