"""Triton kernels for rms_norm, fused_add_rms_norm and gated_rms_norm, rounding exactly as the native ops.

One program normalises ``ROWS`` whole rows held in registers: each input element is read
once and each output element written once, so the kernel runs at memory bandwidth. Every
rounding the native definition makes (the squares, mean and rsqrt in the input dtype when
it does not upcast; the normalised value cast back before the weight; ``1 + w`` in the
weight's dtype) is reproduced by a round trip through that dtype. The rounding choices are
``constexpr``: a model has one or two RMSNorm variants, each compiled once, and at a few rows
a call is latency-bound, where even a uniform branch shows. For the same reason the row width
is a constant, and so are the row strides of contiguous inputs (as in ``act_and_mul.py``).

The weight is loaded before the row (its latency overlaps the row's instead of following
the sum of squares) and kept in cache (every program reads it), the row evicted first.
Launch shapes come from ``benchmarks/sweep_triton_ops.py`` on an H200, hidden 4096, bf16
(``benchmarks/results/h200_sweep_triton_ops_2026-11-29.md``): up to a few waves of programs, two 16-byte
vectors per thread (8 warps; 4 and 16 are within 0.1 us). In that run one row takes 1.55 us
against 1.76 us for ``torch.compile``'s kernel (before these changes, in an earlier run: 1.94
against 1.66 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..dispatch import batch_invariant_active
from ..rms_norm import rms_norm_out_dtype
from . import device_of
from .launch import Kernel

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_autograd",
    "gated_rms_norm",
    "rms_norm",
    "rms_norm_autograd",
    "rms_norm_backward",
    "row_levels",
]


# The row count only bounds the last program: specialising on it would only multiply compilations.
@Kernel
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    w_ptr,
    gate_ptr,
    out_ptr,
    residual_out_ptr,
    n_rows,
    x_inner,
    x_outer_stride,
    x_row_stride,
    residual_row_stride,
    gate_row_stride,
    eps,
    N: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    UPCAST: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    OFFSET: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    GATE: tl.constexpr,
    ROUND_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    dtype = x_ptr.dtype.element_ty
    if CONTIGUOUS:  # every input's rows N apart: the index arithmetic is constant-folded
        x_rows = rows * N
        residual_row_stride = N
        gate_row_stride = N
    else:  # x's rows in two levels (a head of a token: ``[tokens, heads, N]`` of a wider projection)
        x_rows = (rows // x_inner) * x_outer_stride + (rows % x_inner) * x_row_stride
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    if ADD_RESIDUAL:
        r = tl.load(
            residual_ptr + rows[:, None] * residual_row_stride + cols[None, :],
            mask=mask,
            other=0.0,
            eviction_policy="evict_first",
        )
        x = (r.to(tl.float32) + x.to(tl.float32)).to(dtype)  # the sum rounds to the inputs' dtype
        tl.store(residual_out_ptr + rows[:, None] * N + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    if UPCAST:
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        h = h * rstd[:, None]
        if CAST_BEFORE_WEIGHT:
            h = h.to(dtype).to(tl.float32)
    else:
        # In the input dtype every step rounds: the squares, the mean, mean + eps, rsqrt, x * rstd.
        squares = (h * h).to(dtype).to(tl.float32)
        mean = (tl.sum(squares, axis=1) / N).to(dtype).to(tl.float32)
        rstd = tl.rsqrt((mean + eps).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        h = (h * rstd[:, None]).to(dtype).to(tl.float32)
    if HAS_WEIGHT:
        w = w.to(tl.float32)
        if OFFSET:
            w = 1.0 + w
            if not WEIGHT_FP32:
                w = w.to(w_ptr.dtype.element_ty).to(tl.float32)  # 1 + w rounds to the weight's dtype
        h = h * w[None, :]
    if GATE != 0:  # (norm * act(gate in float32)).to(x.dtype): the norm rounds to its own dtype first
        if ROUND_NORM:
            h = h.to(dtype).to(tl.float32)
        g = tl.load(
            gate_ptr + rows[:, None] * gate_row_stride + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
        ).to(tl.float32)
        if GATE == 1:
            g = g / (1.0 + tl.exp(-g))
        elif GATE == 2:
            g = 1.0 / (1.0 + tl.exp(-g))
        elif GATE == 3:
            g = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        else:
            y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            g = g / (1.0 + tl.exp(-2.0 * y))
        h = h * g
    # The product's own dtype is the output's whenever it is a half type: one rounding, here.
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)


# Up to this many rows a call is a few waves of programs and bound by latency, not bandwidth.
_LATENCY_BOUND_ROWS = 1024


def _launch_shape(n_rows: int, n_cols: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps): whole rows per program, several short rows together."""
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, min(2048 // block_n, triton.next_power_of_2(n_rows)))
    elements = block_n * rows
    if n_rows <= _LATENCY_BOUND_ROWS:
        vectors = elements * element_size // 16  # two 16-byte vectors per thread
        return block_n, rows, max(4, min(16, vectors // 64))
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16 if elements <= 32768 else 32
    return block_n, rows, num_warps


def _invariant_launch_shape(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) in batch-invariant mode: one row a program and a warp count set by
    the row's length alone, so a row's sum of squares is reduced by the same threads in the same
    order at every row count."""
    block_n = triton.next_power_of_2(n_cols)
    return block_n, 1, 4 if block_n <= 4096 else 8 if block_n <= 16384 else 16


def row_levels(x: Tensor) -> tuple[int, int, int] | None:
    """``x``'s rows (all but its unit-stride last dimension) as at most two levels of strides:
    ``(inner, outer_stride, row_stride)``, the row ``r`` starting at ``(r // inner) * outer_stride
    + (r % inner) * row_stride``; None when they need more (or the last dimension is strided).

    A head-wise norm of a merged projection's output (Qwen3's ``q_norm`` of ``[B, S, heads, D]``
    cut from ``[B, S, (q + k + v) * D]``) is two levels: the heads of a token, then the tokens."""
    if x.dim() == 0:
        return None
    if x.is_contiguous():  # the common case, on every call: no walk over the dimensions
        return 1, x.shape[-1], x.shape[-1]
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        return None
    # Merge leading dimensions from the innermost out while each continues the one inside it.
    groups: list[list[int]] = []  # [size, stride] per group, innermost first
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if groups and stride == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        return None
    n_cols = x.shape[-1]
    if not groups:
        return 1, n_cols, n_cols
    inner, row_stride = groups[0]
    if len(groups) == 1:
        return 1, row_stride, row_stride
    return inner, groups[1][1], row_stride


# Benchmarks override the launch shape here: rows and num_warps (``benchmarks/sweep_triton_ops.py``),
# the backward's backward_programs_per_sm and backward_warps (``benchmarks/train_kernels.py``).
TUNING: dict = {}


# The gate activations' codes in the kernel (``GATE``).
_GATES = {"silu": 1, "sigmoid": 2, "gelu": 3, "gelu_tanh": 4}


def _normalise(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    eps: float,
    flags: tuple,
    gate: Tensor | None = None,
    activation: str | None = None,
) -> tuple:
    upcast, cast_before_weight, offset, weight_fp32, cast_output = flags
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    norm_dtype = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, *flags)
    out_dtype = x.dtype if gate is not None else norm_dtype
    out = x.new_empty(x.shape, dtype=out_dtype)
    residual_out = out if residual is None else x.new_empty(x.shape)
    if n_rows == 0:
        return out, residual_out
    levels = row_levels(x)
    if levels is None:  # rows in more than two levels: one copy
        x = x.contiguous()
        levels = (1, n_cols, n_cols)
    inner, outer_stride, row_stride = levels
    gate2 = x if gate is None else gate.reshape(-1, n_cols)  # a view whenever the leading dimensions collapse
    residual2 = x if residual is None else residual.reshape(-1, n_cols)
    contiguous = n_rows == 1 or (
        outer_stride == inner * n_cols
        and row_stride == n_cols
        and (residual is None or residual2.stride(0) == n_cols)
        and (gate is None or gate2.stride(0) == n_cols)
    )
    if batch_invariant_active():
        block_n, rows, num_warps = _invariant_launch_shape(n_cols)
    else:
        block_n, rows, num_warps = _launch_shape(n_rows, n_cols, x.element_size())
        rows, num_warps = TUNING.get("rows", rows), TUNING.get("num_warps", num_warps)
    with device_of(x):
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x,
            residual2,
            x if weight is None else weight,
            gate2,
            out,
            residual_out,
            n_rows,
            inner,
            outer_stride,
            row_stride,
            residual2.stride(0) if residual is not None else n_cols,
            gate2.stride(0) if gate is not None else n_cols,
            eps,
            N=n_cols,
            CONTIGUOUS=contiguous,
            UPCAST=upcast,
            CAST_BEFORE_WEIGHT=cast_before_weight,
            OFFSET=offset,
            WEIGHT_FP32=weight_fp32,
            HAS_WEIGHT=weight is not None,
            ADD_RESIDUAL=residual is not None,
            GATE=0 if gate is None else _GATES[activation],
            ROUND_NORM=norm_dtype == x.dtype != torch.float32,
            BLOCK_N=block_n,
            ROWS=rows,
            num_warps=num_warps,
        )
    return out, residual_out


def rms_norm(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output) -> Tensor:
    """The triton provider of ``rms_norm`` (arguments as ``rms_norm_native``)."""
    flags = (upcast, cast_before_weight, offset, weight_fp32, cast_output)
    return _normalise(x, None, weight, eps, flags)[0]


def gated_rms_norm(x, gate, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output, activation):
    """The triton provider of ``gated_rms_norm`` (arguments as ``gated_rms_norm_native``)."""
    flags = (upcast, cast_before_weight, offset, weight_fp32, cast_output)
    return _normalise(x, None, weight, eps, flags, gate, activation)[0]


def fused_add_rms_norm(
    x, residual, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output
) -> tuple[Tensor, Tensor]:
    """The triton provider of ``fused_add_rms_norm`` (arguments as ``fused_add_rms_norm_native``)."""
    flags = (upcast, cast_before_weight, offset, weight_fp32, cast_output)
    return _normalise(x, residual, weight, eps, flags)


# ---- backward ------------------------------------------------------------------------------
#
# ``y = w' ⊙ n`` with ``n = h · r``, ``r = rsqrt(mean(h²) + eps)``, ``h`` the (upcast) input and
# ``w'`` the weight as the forward uses it (float32, ``1 + w``): then ``dn = dy ⊙ w'``, the weight's
# gradient is ``Σ_rows dy ⊙ n`` (``n`` as the forward multiplied it, rounded where it cast back),
# and ``dh = r · (dn - n · mean(dn ⊙ n))``. Every step is float32, whatever the dtypes, and the casts
# of the forward pass their gradient through (as autograd's do). Each program takes rows
# ``pid, pid + G, ...`` and keeps its share of the weight's gradient in registers: one pass over
# the inputs, then a [G, N] sum.


@Kernel
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    dresidual_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    x_inner,
    x_outer_stride,
    x_row_stride,
    dy_inner,
    dy_outer_stride,
    dy_row_stride,
    eps,
    N: tl.constexpr,
    UPCAST: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    OFFSET: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ADD_DRESIDUAL: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    dtype = x_ptr.dtype.element_ty
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if OFFSET:
            w = 1.0 + w
            if not WEIGHT_FP32:
                w = w.to(w_ptr.dtype.element_ty).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        row = tl.cast(row, tl.int64)
        offsets = row * N + cols
        if CONTIGUOUS:
            x_offsets = offsets
            dy_offsets = offsets
        else:  # x and dy in two levels of rows each (see ``row_levels``); dx and dresidual contiguous
            x_offsets = (row // x_inner) * x_outer_stride + (row % x_inner) * x_row_stride + cols
            dy_offsets = (row // dy_inner) * dy_outer_stride + (row % dy_inner) * dy_row_stride + cols
        h = tl.load(x_ptr + x_offsets, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_offsets, mask=in_row, other=0.0).to(tl.float32)
        if UPCAST:
            rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        else:
            squares = (h * h).to(dtype).to(tl.float32)
            mean = (tl.sum(squares, axis=0) / N).to(dtype).to(tl.float32)
            rstd = tl.rsqrt((mean + eps).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        n = h * rstd
        if HAS_WEIGHT:
            if CAST_BEFORE_WEIGHT or not UPCAST:
                dw += dy * n.to(dtype).to(tl.float32)
            else:
                dw += dy * n
            dn = dy * w
        else:
            dn = dy
        dh = rstd * (dn - n * (tl.sum(dn * n, axis=0) / N))
        if ADD_DRESIDUAL:
            dh += tl.load(dresidual_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offsets, dh.to(dx_ptr.dtype.element_ty), mask=in_row)
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + pid * N + cols, dw, mask=in_row)


def _backward_programs(n_rows: int, device) -> int:
    """Enough programs to fill the GPU a few times over, each summing many rows of the weight's
    gradient (fewer partial sums to add at the end). Eight an SM: at 8192 rows of 4096 on an H200,
    80 us against 95 for four, the best of 36 launches for the plain norm and within 2% of the best
    with the residual's gradient added (``benchmarks/results/h200_train_kernels_sweep_2026-12-02.md``)."""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    per_sm = TUNING.get("backward_programs_per_sm", 8)
    return max(1, min(n_rows, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, eps: float, flags: tuple, dresidual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(dx, dweight) of ``rms_norm`` at ``x``, given the output's gradient ``dy`` (and, for
    ``fused_add_rms_norm``, the gradient of the sum it also returns, ``dresidual``, added to dx)."""
    upcast, cast_before_weight, offset, weight_fp32, cast_output = flags
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    x_levels, dy_levels = row_levels(x), row_levels(dy)
    if x_levels is None:  # more than two levels of rows: one copy
        x, x_levels = x.contiguous(), (1, n_cols, n_cols)
    if dy_levels is None:
        dy, dy_levels = dy.contiguous(), (1, n_cols, n_cols)
    dres2 = dresidual.reshape(-1, n_cols).contiguous() if dresidual is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    contiguous = n_rows == 1 or all(levels[1:] == (levels[0] * n_cols, n_cols) for levels in (x_levels, dy_levels))
    programs = _backward_programs(n_rows, x.device)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device) if weight is not None else None
    if n_rows:
        with device_of(x):
            _rms_norm_backward_kernel[(programs,)](
                dy, x, x if weight is None else weight, x if dres2 is None else dres2, dx,
                x if dw_partial is None else dw_partial, n_rows, *x_levels, *dy_levels, eps,
                N=n_cols, UPCAST=upcast, CAST_BEFORE_WEIGHT=cast_before_weight, OFFSET=offset,
                WEIGHT_FP32=weight_fp32, HAS_WEIGHT=weight is not None, ADD_DRESIDUAL=dres2 is not None,
                CONTIGUOUS=contiguous, BLOCK_N=triton.next_power_of_2(n_cols), num_warps=_backward_warps(n_cols),
            )  # fmt: skip
    dw = None
    if weight is not None:
        dw = (dw_partial.sum(0) if n_rows else torch.zeros(n_cols, device=x.device)).to(weight.dtype)
    return dx, dw


def _backward_warps(n_cols: int) -> int:
    block = triton.next_power_of_2(n_cols)
    return TUNING.get("backward_warps", 4 if block <= 1024 else 8 if block <= 4096 else 16)


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with these kernels' backward: only the input and the weight are kept."""

    @staticmethod
    def forward(ctx, x, weight, eps, *flags):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.flags = eps, flags
        return _normalise(x, None, weight, eps, flags)[0]

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, ctx.eps, ctx.flags)
        return (dx, dw if ctx.needs_input_grad[1] else None, None, *([None] * len(ctx.flags)))


class _FusedAddRMSNormFunction(torch.autograd.Function):
    """``fused_add_rms_norm`` with these kernels' backward: only the sum and the weight are kept
    (the sum is an output, which the next residual add holds anyway)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, *flags):
        out, total = _normalise(x, residual, weight, eps, flags)
        ctx.save_for_backward(total, weight)
        ctx.eps, ctx.flags = eps, flags
        return out, total

    @staticmethod
    def backward(ctx, dy, dtotal):
        total, weight = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(total)
        d, dw = rms_norm_backward(dy, total, weight, ctx.eps, ctx.flags, dtotal)
        return (d, d, dw if ctx.needs_input_grad[2] else None, None, *([None] * len(ctx.flags)))


def rms_norm_autograd(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output) -> Tensor:
    """The triton provider of ``rms_norm`` for calls that need a backward (this file's kernels)."""
    return _RMSNormFunction.apply(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output)


def fused_add_rms_norm_autograd(
    x, residual, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output
) -> tuple[Tensor, Tensor]:
    """The triton provider of ``fused_add_rms_norm`` for calls that need a backward."""
    return _FusedAddRMSNormFunction.apply(
        x, residual, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output
    )
