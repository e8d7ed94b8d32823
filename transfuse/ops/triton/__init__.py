"""Triton kernels, imported lazily: importing transfuse never imports Triton.

Providers backed by these kernels are registered eagerly (below) with a ``supported`` check
that only looks for the package; the kernel module is imported on first call. Under
``TRITON_INTERPRET=1`` (set before Triton is imported) the kernels run on CPU tensors,
which is how CI tests their logic without a GPU. Kernels live in one module per op family:
``rms_norm.py`` (rms_norm, fused_add_rms_norm, gated_rms_norm), ``act_and_mul.py`` and ``rotary.py``
(rotary and rotary_one; each with its backward kernels and the ``torch.autograd.Function`` that pairs
them: the provider's ``autograd``) and ``cross_entropy.py`` (a loss and its gradient in one kernel,
and the in-place scale of the saved gradients, for ``linear_cross_entropy``) and ``decode_attention.py`` (one query per sequence over a
buffer of keys and values, forward only).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from typing import Any, Callable

import torch

from ..accuracy import RULE, UNIT_ROUNDOFF, Tolerance
from ..act_and_mul import GELU_AND_MUL, SILU_AND_MUL
from ..batch_invariant import INVARIANT_ATTENTION, INVARIANT_BMM, INVARIANT_GROUPED_MM, INVARIANT_LINEAR
from ..checks import KERNEL_DTYPES, rows_fit, same_rows, weight_fits
from ..decode_attention import DECODE_ATTENTION
from ..dispatch import Provider
from ..fused_add_rms_norm import FUSED_ADD_RMS_NORM
from ..linear_cross_entropy import CROSS_ENTROPY_GRAD, SCALE_
from ..moe import MOE_EXPERTS, MOE_EXPERTS_FP8, MOE_ROUTE
from ..platform import current_platform
from ..rms_norm import GATED_RMS_NORM, RMS_NORM
from ..rotary import EXPANDS, ROTARY, ROTARY_ONE, RotaryLayout, rotary_width
from .moe_configs import token_thresholds

__all__ = ["MAX_HIDDEN", "available", "device_of", "interpreting", "on_device"]

# The rms_norm kernels hold a row in registers; wider rows go to the next provider.
MAX_HIDDEN = 65536
# act_and_mul tiles its rows, so any width the grid can cover.
_MAX_ACT_WIDTH = 2**30
# rotary holds a block of heads' halves in registers, at least one head a program.
_MAX_ROTARY_DIM = 1024


@functools.cache
def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``). Triton reads the variable when
    it is imported, so it is read once here too (and kept: every launch asks)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def available() -> bool:
    """Triton is installed and has somewhere to run: a CUDA or ROCm GPU, or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or current_platform().name in ("cuda", "rocm")


def on_device(*tensors: torch.Tensor) -> bool:
    """All tensors are where Triton kernels can read them: on the GPU, or on CPU when interpreting."""
    # ``is_cuda``/``is_cpu`` rather than ``.device``, which builds a device object per tensor per call.
    # (ROCm builds of torch report their GPUs as CUDA devices too.)
    if interpreting():
        return all(t.is_cpu for t in tensors)
    return all(t.is_cuda for t in tensors)


def device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``x``'s GPU the current one for a launch: Triton launches on the current device."""
    if x.device.type != "cuda" or x.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(x.device)


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """A provider implementation that imports ``transfuse.ops.triton.<module>`` on its first call."""

    @functools.cache
    def resolve() -> Callable[..., Any]:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)

    def impl(*args: Any, **kwargs: Any) -> Any:
        return resolve()(*args, **kwargs)

    impl.__name__ = impl.__qualname__ = f"triton_{name}"
    return impl


def _rms_norm_args(x, weight, eps, *flags) -> bool:
    return on_device(x) and rows_fit(x, MAX_HIDDEN) and weight_fits(weight, x)


def _fused_add_rms_norm_args(x, residual, weight, eps, *flags) -> bool:
    return _rms_norm_args(x, weight, eps) and same_rows(x, residual)


def _gated_rms_norm_args(x, gate, weight, eps, *flags) -> bool:
    return _rms_norm_args(x, weight, eps) and same_rows(x, gate)


def _act_and_mul_args(x, approximate: str = "none") -> bool:
    return on_device(x) and rows_fit(x, _MAX_ACT_WIDTH) and x.shape[-1] % 2 == 0 and approximate in ("none", "tanh")


def _rotary_args(q, k, cos, sin, *layout, **named) -> bool:
    """q and k, whose head counts may differ (GQA): see ``_rotates``."""
    return _rotates((q, k), cos, sin, RotaryLayout(*layout, **named))


def _rotary_one_args(x, cos, sin, *layout, **named) -> bool:
    return _rotates((x,), cos, sin, RotaryLayout(*layout, **named))


def _rotates(tensors: tuple, cos, sin, layout: RotaryLayout) -> bool:
    """The tensors ``[B, H, S, D]`` (unsqueeze_dim 1) or ``[B, S, H, D]`` (2), of one batch, length
    and head size, unit stride along D and any other strides; cos and sin ``[B or 1, S, width]``,
    whose rotary width (cut and widened as the layout says) is even and the head size, or with
    ``partial`` at most that; one float dtype; cos and sin without a gradient to compute (the
    kernels' backward has none for them)."""
    if not (on_device(*tensors, cos, sin) and all(t.dim() == 4 for t in tensors) and cos.dim() == 3):
        return False
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES or any(t.dtype != dtype for t in (*tensors, cos, sin)):
        return False
    if layout.unsqueeze_dim not in (1, -3, 2, -2) or layout.expand not in EXPANDS:
        return False
    heads_axis = 1 if layout.unsqueeze_dim in (1, -3) else 2
    sizes = {tuple(n for i, n in enumerate(t.shape) if i != heads_axis) for t in tensors}
    if len(sizes) != 1:
        return False
    (b, s, d), width = sizes.pop(), rotary_width(cos.shape[-1], layout.expand, layout.first_half)
    return (
        0 < d <= _MAX_ROTARY_DIM
        and 0 < width <= d
        and width % 2 == 0
        and (layout.partial or width == d)
        and cos.shape[0] in (1, b)
        and cos.shape[1] == s
        and sin.shape == cos.shape
        and all(t.stride(-1) == 1 for t in (*tensors, cos, sin))
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
    )


def _decode_attention_args(query, keys, values, bias, scaling, key=None, value=None, position=None) -> bool:
    """One float dtype for the query, the buffers, the bias and a token to write; unit stride along
    the head dimension (any other strides); the bias contiguous; heads of at most 256 and groups of
    at most 64 query heads a key/value head (a program holds them in registers)."""
    tensors = [t for t in (query, keys, values, bias, key, value) if t is not None]
    if not on_device(*tensors, *([position] if position is not None else [])):
        return False
    dtype = query.dtype
    if dtype not in KERNEL_DTYPES or any(t.dtype != dtype for t in tensors):
        return False
    if position is not None and (position.dtype != torch.long or position.numel() != 1):
        return False
    return (
        all(t.stride(-1) == 1 for t in tensors)
        and bias.is_contiguous()
        and max(query.shape[-1], values.shape[-1]) <= 256
        and query.shape[1] // keys.shape[1] <= 64
    )


def _cross_entropy_grad_args(logits, targets, scale, ignore_index) -> bool:
    return (
        on_device(logits, targets, scale)
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


def _scale_args(x, scale) -> bool:
    return (
        on_device(x, scale)
        and x.is_contiguous()
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and scale.numel() == 1
        and scale.dtype.is_floating_point
    )


def _triton_routes(logits, correction_bias, top_k, scoring, float32, grouped, n_group, topk_group, *rest) -> bool:
    experts = logits.shape[-1]
    tensors = (logits,) if correction_bias is None else (logits, correction_bias)
    if not on_device(*tensors) or logits.dim() != 2 or experts > 1024 or top_k > experts:
        return False
    if grouped:
        per_group = experts // n_group
        # The kernel ranks groups in a [groups, per-group] tile: both must be powers of two.
        return experts % n_group == 0 and _pow2(n_group) and _pow2(per_group) and per_group >= 2
    return True


def _triton_runs_experts(x, weights, ids, w13, w2, b13, b2, activation, *flags) -> bool:
    tensors = [t for t in (x, weights, ids, w13, w2, b13, b2) if t is not None]
    if activation not in _MOE_ACTIVATIONS or not on_device(*tensors) or x.dim() != 2 or ids.dim() != 2:
        return False
    if x.dtype not in KERNEL_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    return ids.dtype in (torch.int32, torch.int64) and x.shape[0] > 0


def _triton_runs_fp8_experts(x, weights, ids, w13, s13, w2, s2, block_n, block_k, activation, *flags) -> bool:
    if activation not in _MOE_ACTIVATIONS or not on_device(x, weights, ids, w13, s13, w2, s2):
        return False
    if x.dim() != 2 or ids.dim() != 2 or x.dtype not in KERNEL_DTYPES or ids.dtype not in (torch.int32, torch.int64):
        return False
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return w13.dtype in fp8 and w2.dtype in fp8 and s13.dtype == s2.dtype == torch.float32 and x.shape[0] > 0


def _experts_thresholds(x, weights, ids, w13, *rest) -> dict:
    """The token counts at which ``moe_configs.regime`` moves to another path or tiles."""
    return {"tokens": token_thresholds(ids.shape[-1], w13.shape[0])}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# What the MoE kernels compute (``moe.EXPERT_ACTIVATIONS`` less the soft-capped SwiGLU).
_MOE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "clamped_swiglu")
# Row counts from which the kernels launch differently (``rms_norm._LATENCY_BOUND_ROWS``,
# ``act_and_mul._TINY_ROWS`` and ``_LATENCY_BOUND_ROWS``): conformance checks both sides.
_NORM_ROWS = {"rows": (1025,)}
_ACT_ROWS = {"rows": (5, 1025)}


# Triton's interpreter emulates bfloat16, rounding less exactly than a GPU does (some products and
# casts toward zero: a consistent scale error of up to about 0.6%, and a bf16 rounding's worth of
# error in float32 outputs computed from bf16 values): interpreted bf16 kernels are judged with
# twice the rule's rms factor, an rms floor of two bf16 roundings and a 1% scale allowance. On a
# GPU, and in every other dtype, the rule's own constants.
_INTERPRETED_BF16 = Tolerance(rms_factor=4.0, rms_floor=2 * UNIT_ROUNDOFF[torch.bfloat16], bias_floor=0.01)


def _tolerance(dtype: torch.dtype) -> Tolerance:
    return _INTERPRETED_BF16 if interpreting() and dtype == torch.bfloat16 else RULE


def _provider(op, module: str, name: str, supports_args, backward_and_output: bool = False, backward: bool = False,
              thresholds=None, batch_invariant: bool = False) -> None:  # fmt: skip
    """Register ``name`` of ``module`` as the op's triton provider, with ``name_autograd`` (the same
    kernels with their backward) for calls that need a backward, with ``backward_and_output`` the
    module's ``name_backward_and_output``, and with ``backward`` its ``name_backward``."""
    op.register(
        Provider(
            "triton", _lazy(module, name), available, supports_args, autograd=_lazy(module, f"{name}_autograd"),
            backward_and_output=_lazy(module, f"{name}_backward_and_output") if backward_and_output else None,
            backward=_lazy(module, f"{name}_backward") if backward else None, thresholds=thresholds,
            tolerance=_tolerance, batch_invariant=batch_invariant,
        )
    )  # fmt: skip


# batch_invariant: the norms launch one row a program in that mode (``rms_norm._invariant_launch_shape``);
# the activations and rotary are elementwise.
_provider(RMS_NORM, "rms_norm", "rms_norm", _rms_norm_args, thresholds=_NORM_ROWS, batch_invariant=True)
_provider(
    FUSED_ADD_RMS_NORM, "rms_norm", "fused_add_rms_norm", _fused_add_rms_norm_args, thresholds=_NORM_ROWS,
    batch_invariant=True,
)  # fmt: skip
# Forward only: under autograd the native definition (differentiable torch ops) runs.
GATED_RMS_NORM.register(
    Provider(
        "triton", _lazy("rms_norm", "gated_rms_norm"), available, _gated_rms_norm_args, thresholds=_NORM_ROWS,
        tolerance=_tolerance, batch_invariant=True,
    )
)
_provider(
    SILU_AND_MUL, "act_and_mul", "silu_and_mul", _act_and_mul_args, backward_and_output=True, thresholds=_ACT_ROWS,
    batch_invariant=True,
)  # fmt: skip
_provider(
    GELU_AND_MUL, "act_and_mul", "gelu_and_mul", _act_and_mul_args, backward_and_output=True, thresholds=_ACT_ROWS,
    batch_invariant=True,
)  # fmt: skip
_provider(ROTARY, "rotary", "rotary", _rotary_args, backward=True, batch_invariant=True)
_provider(ROTARY_ONE, "rotary", "rotary_one", _rotary_one_args, backward=True, batch_invariant=True)
# Forward only: under autograd the native definition runs. In batch-invariant mode it runs the
# mode's attention, without splits of the keys (``invariant.decode_attention``).
DECODE_ATTENTION.register(
    Provider(
        "triton", _lazy("decode_attention", "decode_attention"), available, _decode_attention_args,
        thresholds=_lazy("decode_attention", "thresholds"), tolerance=_tolerance, batch_invariant=True,
    )
)  # fmt: skip
CROSS_ENTROPY_GRAD.register(
    Provider("triton", _lazy("cross_entropy", "cross_entropy_grad"), available, _cross_entropy_grad_args, tolerance=_tolerance)
)
SCALE_.register(Provider("triton", _lazy("cross_entropy", "scale_"), available, _scale_args, tolerance=_tolerance))
# Forward only, for inference on a GPU; the grouped path's tiles and the decode path by token count.
# batch_invariant: the routing kernel's programs take a number of tokens fixed by the expert count,
# each token's scores reduced alike; the experts take one path and one set of tiles in that mode
# (``moe_configs.INVARIANT_CONFIG``).
MOE_ROUTE.register(
    Provider("triton", _lazy("moe", "moe_route"), available, _triton_routes, tolerance=_tolerance, batch_invariant=True)
)
MOE_EXPERTS.register(
    Provider(
        "triton", _lazy("moe", "moe_experts"), available, _triton_runs_experts, thresholds=_experts_thresholds,
        tolerance=_tolerance, batch_invariant=True,
    )
)  # fmt: skip
MOE_EXPERTS_FP8.register(
    Provider("triton", _lazy("moe_fp8", "moe_experts_fp8"), available, _triton_runs_fp8_experts, tolerance=_tolerance)
)


def _invariant_linear_args(x, weight, bias=None) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return on_device(*tensors) and x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and weight.dim() == 2


def _invariant_bmm_args(a, b) -> bool:
    return on_device(a, b) and a.dtype in KERNEL_DTYPES and b.dtype == a.dtype and a.dim() == 3 and b.dim() == 3


def _invariant_attention_args(query, key, value, attn_mask=None, is_causal=False, scale=None) -> bool:
    tensors = [t for t in (query, key, value, attn_mask) if t is not None]
    return (
        on_device(*tensors)
        and query.dtype in KERNEL_DTYPES
        and key.dtype == value.dtype == query.dtype
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[1] == key.shape[1] == value.shape[1]
        and all(t.stride(-1) == 1 for t in (query, key, value))
        and max(query.shape[-1], value.shape[-1]) <= 256
    )


def _invariant_grouped_mm_args(rows, matrices, ends) -> bool:
    return (
        on_device(rows, matrices, ends)
        and rows.dtype in KERNEL_DTYPES
        and matrices.dtype == rows.dtype
        and rows.dim() == 2
        and matrices.dim() == 3
        and ends.dtype == torch.int32
        and ends.shape == (matrices.shape[0],)
    )


# Batch-invariant mode's kernels: one tile shape per weight shape, attention walked from each
# query's first key (``invariant.py``). Forward only.
for _op, _name, _args in (
    (INVARIANT_LINEAR, "invariant_linear", _invariant_linear_args),
    (INVARIANT_BMM, "invariant_bmm", _invariant_bmm_args),
    (INVARIANT_GROUPED_MM, "invariant_grouped_mm", _invariant_grouped_mm_args),
    (INVARIANT_ATTENTION, "invariant_attention", _invariant_attention_args),
):
    _op.register(
        Provider("triton", _lazy("invariant", _name), available, _args, tolerance=_tolerance, batch_invariant=True)
    )
