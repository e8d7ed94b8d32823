"""rms_norm: ``x * rsqrt(mean(x², -1) + eps)``, times ``weight`` or ``1 + weight``, with the model's rounding.

Models write the same formula with different rounding, and a fused kernel must
reproduce each exactly. ``RMSNormSpec`` names the choices (Llama: normalise in float32,
cast back, then multiply by the weight; Gemma: multiply by ``1 + weight`` in float32 and
cast last). The native definition below executes exactly those steps; it is the CPU
path and the reference for every provider.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .conformance import Rows
from .dispatch import Op, Provider

__all__ = [
    "GATE_ACTIVATIONS",
    "GATED_RMS_NORM",
    "RMSNormSpec",
    "PROMOTED_EXACTLY",
    "RMS_NORM",
    "INPUT_GATED_RMS_NORM",
    "gated_rms_norm",
    "gated_rms_norm_native",
    "input_gated_rms_norm",
    "input_gated_rms_norm_native",
    "rms_norm",
    "rms_norm_as_written",
    "rms_norm_native",
    "rms_norm_out_dtype",
]


@dataclass(frozen=True)
class RMSNormSpec:
    """Where an RMSNorm computes and rounds.

    upcast: normalise in float32 (else in the input dtype).
    cast_before_weight: cast the normalised value back to the input dtype before the
        weight multiply (Llama).
    offset: multiply by ``1 + weight`` (zero-centred weight, Gemma).
    weight_fp32: the weight is cast to float32 before use (and before the offset).
    cast_output: cast the result to the input dtype (Gemma, OLMo 2, ``F.rms_norm``).
    promote: the mean of squares is taken of the input in float32, and the *uncast* input is
        multiplied by its inverse root (older Llama, T5): the product is computed in the wider of
        the input's dtype and float32. For float32, bfloat16 and float16 inputs that is exactly
        ``upcast`` (widening to float32 is exact), which the op's providers compute; a wider input
        (float64) runs ``rms_norm_as_written``. Not one of the op's flags.
    divide: the value is divided by ``sqrt(mean + eps)`` instead of multiplied by its ``rsqrt``,
        which rounds differently: no provider computes it, ``rms_norm_as_written`` does.
    """

    upcast: bool = True
    cast_before_weight: bool = True
    offset: bool = False
    weight_fp32: bool = False
    cast_output: bool = False
    promote: bool = False
    divide: bool = False

    def flags(self) -> tuple[bool, bool, bool, bool, bool]:
        return (self.upcast, self.cast_before_weight, self.offset, self.weight_fp32, self.cast_output)

    def as_written(self, x: Tensor) -> bool:
        """Whether ``x`` must run ``rms_norm_as_written``: a divided norm, or a promoting norm of an input
        wider than float32."""
        return self.divide or (self.promote and x.dtype not in PROMOTED_EXACTLY)

    def describe(self) -> str:
        parts = ["float32" if self.upcast else "input dtype"]
        if self.promote:
            parts.append("uncast input times the float32 inverse root")
        if self.divide:
            parts.append("divided by the square root")
        if self.cast_before_weight:
            parts.append("cast back before weight")
        parts.append("(1 + weight)" if self.offset else "weight")
        if self.weight_fp32:
            parts.append("weight in float32")
        if self.cast_output:
            parts.append("cast output")
        return ", ".join(parts)


def rms_norm_native(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    upcast: bool,
    cast_before_weight: bool,
    offset: bool,
    weight_fp32: bool,
    cast_output: bool,
) -> Tensor:
    dtype = x.dtype
    h = x.to(torch.float32) if upcast else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return _weighted(h, dtype, weight, cast_before_weight, offset, weight_fp32, cast_output)


# Input dtypes whose product with a float32 tensor is the product of their float32 copies, bit for bit.
PROMOTED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_as_written(x: Tensor, weight: Tensor | None, eps: float, spec: RMSNormSpec) -> Tensor:
    """The norm step by step as the model writes it, for the forms no provider computes
    (``RMSNormSpec.as_written``): the mean of squares (of the float32 copy where ``upcast`` or
    ``promote``), the value (the uncast input where ``promote``) times its inverse root or divided by
    its square root, then the weight."""
    h = x.to(torch.float32) if spec.upcast and not spec.promote else x
    squared = x.to(torch.float32) if spec.promote else h
    total = squared.pow(2).mean(-1, keepdim=True) + eps
    h = h / torch.sqrt(total) if spec.divide else h * torch.rsqrt(total)
    return _weighted(h, x.dtype, weight, spec.cast_before_weight, spec.offset, spec.weight_fp32, spec.cast_output)


def _weighted(
    h: Tensor, dtype: torch.dtype, weight: Tensor | None, cast_before_weight: bool, offset: bool,
    weight_fp32: bool, cast_output: bool,
) -> Tensor:
    """A normalised ``h`` cast back (or not), times the weight (or ``1 + weight``), cast last (or not):
    the rounding every RMSNorm spelling shares after its sum of squares."""
    if cast_before_weight:
        h = h.to(dtype)
    if weight is not None:
        w = weight.to(torch.float32) if weight_fp32 else weight
        if offset:
            w = 1.0 + w
        h = w * h
    if cast_output:
        h = h.to(dtype)
    return h


def rms_norm_out_dtype(
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
    upcast: bool,
    cast_before_weight: bool,
    offset: bool,
    weight_fp32: bool,
    cast_output: bool,
) -> torch.dtype:
    """The dtype ``rms_norm_native`` returns, without running it (kernels allocate their output with it)."""
    if cast_output:
        return x_dtype
    normed = torch.float32 if upcast and not cast_before_weight else x_dtype
    if weight_dtype is None:
        return normed
    # ``1.0 + w`` keeps w's dtype: a Python scalar does not promote a tensor.
    return torch.promote_types(normed, torch.float32 if weight_fp32 else weight_dtype)


RMS_NORM = Op("rms_norm", rms_norm_native, sampler=Rows("x", grads=("x", "weight")), library=True)


def builtin_rounds_alike(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output) -> bool:
    """``F.rms_norm`` normalises in float32, multiplies by the weight there and casts last."""
    if offset or not upcast or (weight is not None and weight.dtype != x.dtype):
        return False
    if x.dtype == torch.float32:
        return True  # every cast is the identity: all specs compute the same
    # A weight multiplied into a float32 value is promoted to float32 exactly.
    weight_in_fp32 = weight is None or weight_fp32 or not cast_before_weight
    return not cast_before_weight and cast_output and weight_in_fp32


def _torch_rms_norm(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


RMS_NORM.register(Provider("torch", _torch_rms_norm, supports_args=builtin_rounds_alike, differentiable=True))


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, spec: RMSNormSpec = RMSNormSpec()) -> Tensor:
    """RMSNorm of ``x`` over its last dimension with the rounding of ``spec``."""
    if spec.as_written(x):
        return rms_norm_as_written(x, weight, eps, spec)
    return RMS_NORM(x, weight, eps, *spec.flags())


# ---- gated: ``(rms_norm(x) * act(gate.float())).to(x.dtype)`` --------------------------------
#
# The output gate of linear-attention blocks (qwen3_next, kimi_linear, olmo_hybrid): the norm with
# its own rounding, then, in float32, times the activation of the gate, cast to the input dtype.

GATE_ACTIVATIONS = ("silu", "sigmoid", "gelu", "gelu_tanh")


def _gate_activation(gate: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "sigmoid":
        return torch.sigmoid(gate)
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def gated_rms_norm_native(
    x: Tensor,
    gate: Tensor,
    weight: Tensor | None,
    eps: float,
    upcast: bool,
    cast_before_weight: bool,
    offset: bool,
    weight_fp32: bool,
    cast_output: bool,
    activation: str,
) -> Tensor:
    normed = rms_norm_native(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output)
    return (normed.to(torch.float32) * _gate_activation(gate.to(torch.float32), activation)).to(x.dtype)


GATED_RMS_NORM = Op("gated_rms_norm", gated_rms_norm_native, sampler=Rows("x", "gate", grads=("x", "gate", "weight")))


def gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Tensor | None, eps: float, spec: RMSNormSpec, activation: str
) -> Tensor:
    """``(rms_norm(x) * act(gate in float32)).to(x.dtype)``, the norm with the rounding of ``spec``; a
    gate that broadcasts against ``x`` runs the native definition, as the model's own product would."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gated_rms_norm has no activation {activation!r}; it has: {', '.join(GATE_ACTIVATIONS)}.")
    if spec.as_written(x):
        normed = rms_norm_as_written(x, weight, eps, spec)
        return (normed.to(torch.float32) * _gate_activation(gate.to(torch.float32), activation)).to(x.dtype)
    return GATED_RMS_NORM(x, gate, weight, eps, *spec.flags(), activation)


# ---- gated before the norm, in groups: ``rms_norm(x.float() * act(gate.float()))`` -----------
#
# The gated norm of Mamba-2's mixers (mamba2, bamba, granitemoehybrid, zamba2, nemotron_h): the
# input upcast to float32 times the activation of the gate in float32, then normalised, each group
# of ``group_size`` consecutive features on its own (None: the whole row), then the weight with the
# rounding of the spec. Without a gate, the same norm of the upcast input.


def input_gated_rms_norm_native(
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    eps: float,
    upcast: bool,
    cast_before_weight: bool,
    offset: bool,
    weight_fp32: bool,
    cast_output: bool,
    activation: str,
    group_size: int | None,
) -> Tensor:
    dtype = x.dtype
    h = x.to(torch.float32) if upcast else x
    if gate is not None:
        h = h * _gate_activation(gate.to(torch.float32), activation)
    shape = h.shape
    if group_size is not None:
        h = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        h = h.view(shape)
    return _weighted(h, dtype, weight, cast_before_weight, offset, weight_fp32, cast_output)


INPUT_GATED_RMS_NORM = Op(
    "input_gated_rms_norm", input_gated_rms_norm_native, sampler=Rows("x", "gate", grads=("x", "gate", "weight"))
)


def input_gated_rms_norm(
    x: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    eps: float,
    spec: RMSNormSpec,
    activation: str,
    group_size: int | None = None,
) -> Tensor:
    """``rms_norm(x in float32 * act(gate in float32))`` over groups of ``group_size`` features (None:
    the whole last dimension), the weight with the rounding of ``spec``; without a gate, the norm of
    ``x`` alone. Native only: no kernel computes it yet."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(
            f"input_gated_rms_norm has no activation {activation!r}; it has: {', '.join(GATE_ACTIVATIONS)}."
        )
    if group_size is not None and (group_size <= 0 or x.shape[-1] % group_size):
        raise ValueError(f"input_gated_rms_norm: groups of {group_size} do not divide the last dimension {x.shape[-1]}.")
    return INPUT_GATED_RMS_NORM(x, gate, weight, eps, *spec.flags(), activation, group_size)
