"""Triton kernels for silu_and_mul and gelu_and_mul: ``act(x[..., :d]) * x[..., d:]``.

Each program reads one block of the gate half and the matching block of the up half of one
row and writes one block of the output. Like ``F.silu(gate) * up`` in a half dtype, the
activation is computed in float32 and rounded to the input dtype before the multiply.

The half width ``D`` is a compile-time constant, and so is the row stride when rows are
contiguous (``2 * D``): at a few rows a call is bound by latency, and with the index arithmetic
folded into the code the first load issues a few dependent instructions sooner. On an H200
(``benchmarks/results/h200_act_variants_2026-11-30.md``, alternating replays against ``torch.compile``)
one row takes 0.982x compile's time and 16 rows 0.983x, against 1.022x and 1.012x with the width
and stride as runtime arguments. A model has
one or two widths, each compiled once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..act_and_mul import CONSUMABLE
from . import device_of
from .launch import Kernel

__all__ = [
    "act_and_mul_backward",
    "gelu_and_mul",
    "gelu_and_mul_autograd",
    "gelu_and_mul_backward_and_output",
    "silu_and_mul",
    "silu_and_mul_autograd",
    "silu_and_mul_backward_and_output",
]

SILU, GELU, GELU_TANH = 0, 1, 2
_GELU_APPROXIMATIONS = {"none": GELU, "tanh": GELU_TANH}

# Launch shapes, measured on an H200 (bf16, 4096 wide; ``benchmarks/results/h200_sweep_act_and_mul_2026-11-30.md``
# and, for the many-row blocks, ``h200_sweep_triton_ops_2026-11-29.md``):
# - up to _TINY_ROWS rows: blocks of 256 elements, 4 warps (two elements a thread; fastest at one
#   row, 1.19 us against 1.20 for blocks of 512);
# - up to _LATENCY_BOUND_ROWS rows: blocks of 1024, 8 bytes a thread (8 warps in bf16; 1.29 against
#   1.31 us for 4 warps at 16 rows, 3.14 against 3.21 at 256);
# - beyond, where bandwidth rules: blocks of 4096, one 16-byte vector a thread (16 warps), which
#   move 2-4% more bytes per second (185.4 against 192.4 us at 32768 rows).
_TINY_ROWS, _TINY_BLOCK, _TINY_WARPS = 4, 256, 4
_LATENCY_BOUND_ROWS, _BLOCK, _BLOCK_THREAD_BYTES = 1024, 1024, 8
_LARGE_BLOCK, _LARGE_THREAD_BYTES = 4096, 16
# Benchmarks and tests override the launch here: block, num_warps, masked (predicate even exact
# tiles), index_64 (64-bit offsets at any size); ``benchmarks/sweep_triton_ops.py``; and the
# backward's backward_block and backward_warps (``benchmarks/train_kernels.py``).
TUNING: dict = {}


@triton.jit
def _gated(gate, up, ACTIVATION: tl.constexpr, dtype: tl.constexpr):
    """``act(gate) * up`` in ``dtype``, from float32 gate and up: the activation rounded to ``dtype``
    before the multiply, as ``F.silu(gate) * up`` in a half dtype. The forward's formula, which the
    backward also uses where it writes the forward's output again."""
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        # 0.5 * g * (1 + tanh(y)) == g * sigmoid(2y): exact algebra, and no tanh is needed.
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * y))
    return (act.to(dtype).to(tl.float32) * up).to(dtype)


@Kernel
@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, x_row_stride,
    D: tl.constexpr, CONTIGUOUS: tl.constexpr,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, INDEX_64: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if INDEX_64:  # offsets past 2**31 elements; below that, 32-bit address arithmetic is shorter
        row = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else cols < D  # blocks that tile the row exactly need no predicate
    dtype = x_ptr.dtype.element_ty
    if CONTIGUOUS:  # the stride is 2 * D: a constant, like the rest of the index arithmetic
        start = x_ptr + row * (2 * D)
    else:
        start = x_ptr + row * x_row_stride
    gate = tl.load(start + cols, mask=mask).to(tl.float32)
    up = tl.load(start + D + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * D + cols, _gated(gate, up, ACTIVATION, dtype), mask=mask)


def _launch_shape(n_rows: int, d: int, element_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the block clipped to the row, and warps for the clipped block (never
    more threads than elements)."""
    if n_rows <= _TINY_ROWS:
        block = min(TUNING.get("block", _TINY_BLOCK), triton.next_power_of_2(d))
        warps = min(_TINY_WARPS, max(1, block // 32))
    else:
        large = n_rows > _LATENCY_BOUND_ROWS
        block = min(TUNING.get("block", _LARGE_BLOCK if large else _BLOCK), triton.next_power_of_2(d))
        thread_bytes = _LARGE_THREAD_BYTES if large else _BLOCK_THREAD_BYTES
        warps = max(1, min(16, block * element_size // thread_bytes // 32))
    return block, TUNING.get("num_warps", warps)


def _act_and_mul(x: Tensor, activation: int) -> Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # a view whenever the leading dimensions collapse
    out = x.new_empty((*x.shape[:-1], d))
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out
    block, num_warps = _launch_shape(n_rows, d, x.element_size())
    even = d % block == 0 and not TUNING.get("masked", False)
    last = (n_rows - 1) * max(x2.stride(0), 2 * d) + 2 * d  # one past the largest offset either side
    index_64 = TUNING.get("index_64", last >= 2**31)
    with device_of(x):
        _act_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0),
            D=d, CONTIGUOUS=n_rows == 1 or x2.stride(0) == 2 * d,
            ACTIVATION=activation, BLOCK=block, EVEN=even, INDEX_64=index_64, num_warps=num_warps,
        )  # fmt: skip
    return out


def silu_and_mul(x: Tensor) -> Tensor:
    """The triton provider of ``silu_and_mul``."""
    return _act_and_mul(x, SILU)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """The triton provider of ``gelu_and_mul`` (``approximate`` as ``F.gelu``'s)."""
    return _act_and_mul(x, _GELU_APPROXIMATIONS[approximate])


# ---- backward ------------------------------------------------------------------------------
#
# ``y = a(g) · u`` on ``x = [g | u]``: ``du = dy · a(g)`` (the activation rounded to the input dtype,
# as the forward multiplied it) and ``dg = dy · u · a'(g)``, in float32, written as ``[dg | du]`` in
# the input dtype. Only ``x`` is kept for the backward; the activation is recomputed.


@Kernel
@triton.jit
def _act_and_mul_backward_kernel(
    x_ptr, dy_ptr, dx_ptr, y_ptr,
    D: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, INDEX_64: tl.constexpr, WRITE_Y: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if INDEX_64:
        row = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dtype = x_ptr.dtype.element_ty
    start = row * (2 * D)
    gate = tl.load(x_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + start + D + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        s = 1.0 / (1.0 + tl.exp(-gate))
        act = gate * s
        slope = s * (1.0 + gate * (1.0 - s))
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.erf(gate * 0.7071067811865476))
        act = gate * cdf
        slope = cdf + gate * 0.3989422804014327 * tl.exp(-0.5 * gate * gate)
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        s = 1.0 / (1.0 + tl.exp(-2.0 * inner))  # (1 + tanh(inner)) / 2
        act = gate * s
        slope = s + gate * 2.0 * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * gate * gate)
    act = act.to(dtype).to(tl.float32)
    if WRITE_Y:  # the forward's output again, for a caller that did not keep it (its own formula)
        tl.store(y_ptr + row * D + cols, _gated(gate, up, ACTIVATION, dtype), mask=mask)
    tl.store(dx_ptr + start + cols, (dy * up * slope).to(dtype), mask=mask)
    tl.store(dx_ptr + start + D + cols, (dy * act).to(dtype), mask=mask)


def act_and_mul_backward(
    dy: Tensor, x: Tensor, activation: int, in_place: bool = False, output: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """The gradient ``[dgate | dup]`` of ``act_and_mul`` at ``x``, given the output's gradient ``dy``;
    with ``in_place`` (``x`` contiguous), written over ``x`` (each program reads its elements of
    ``x`` before it writes the same elements). With ``output``, ``(gradient, act_and_mul(x))``: the
    forward's output, bit for bit, from the same read of ``x``."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    dy2 = dy.reshape(-1, d).contiguous()
    dx = x2 if in_place and x2.data_ptr() == x.data_ptr() else torch.empty_like(x2)
    y = x.new_empty((*x.shape[:-1], d)) if output else dx
    n_rows = x2.shape[0]
    if n_rows:
        block = min(TUNING.get("backward_block", _BLOCK), triton.next_power_of_2(d))
        num_warps = TUNING.get("backward_warps", max(1, min(8, block // 128)))
        with device_of(x):
            _act_and_mul_backward_kernel[(n_rows, triton.cdiv(d, block))](
                x2, dy2, dx, y, D=d, ACTIVATION=activation, BLOCK=block, INDEX_64=x2.numel() >= 2**31,
                WRITE_Y=output, num_warps=num_warps,
            )  # fmt: skip
    return (dx.view(x.shape), y) if output else dx.view(x.shape)


class _ActAndMulFunction(torch.autograd.Function):
    """``act_and_mul`` with these kernels' backward: only the input is kept."""

    @staticmethod
    def forward(ctx, x, activation):
        ctx.save_for_backward(x)
        ctx.activation = activation
        # An input that nothing else reads (a merged gate/up projection's output, marked by it) may
        # take its gradient in place.
        ctx.consumable = getattr(x, CONSUMABLE, False) and x.is_contiguous()
        return _act_and_mul(x, activation)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        # A consumable input takes its gradient in place: one [tokens, 2 x width] tensor less at the
        # step's peak. Its version is bumped, so a later autograd use of it (a second backward
        # through the graph) fails autograd's check rather than read the gradient.
        in_place = ctx.consumable
        grad = act_and_mul_backward(dy, x, ctx.activation, in_place=in_place)
        if in_place:
            torch.autograd.graph.increment_version(x)
        return grad, None


def silu_and_mul_autograd(x: Tensor) -> Tensor:
    """The triton provider of ``silu_and_mul`` for calls that need a backward."""
    return _ActAndMulFunction.apply(x, SILU)


def gelu_and_mul_autograd(x: Tensor, approximate: str = "none") -> Tensor:
    """The triton provider of ``gelu_and_mul`` for calls that need a backward."""
    return _ActAndMulFunction.apply(x, _GELU_APPROXIMATIONS[approximate])


def silu_and_mul_backward_and_output(
    dy: Tensor, x: Tensor, in_place: bool = False, output: bool = True
) -> tuple[Tensor, Tensor | None]:
    """The gradient of ``silu_and_mul`` at ``x`` and (with ``output``) its output, from one read of ``x``."""
    return _backward_and_output(dy, x, SILU, in_place, output)


def gelu_and_mul_backward_and_output(
    dy: Tensor, x: Tensor, approximate: str = "none", in_place: bool = False, output: bool = True
) -> tuple[Tensor, Tensor | None]:
    """The gradient of ``gelu_and_mul`` at ``x`` and (with ``output``) its output, from one read of ``x``."""
    return _backward_and_output(dy, x, _GELU_APPROXIMATIONS[approximate], in_place, output)


def _backward_and_output(dy: Tensor, x: Tensor, activation: int, in_place: bool, output: bool):
    if output:
        return act_and_mul_backward(dy, x, activation, in_place, output=True)
    return act_and_mul_backward(dy, x, activation, in_place), None
