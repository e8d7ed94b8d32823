"""Triton kernels for rotary and rotary_one: ``x * cos + rotate(x) * sin`` for the query and the key
(or one tensor) in one launch, in every layout of ``transfuse/ops/rotary.py``.

Each program takes a block of positions of one sequence and a block of heads, of the query or of
the key (the query's blocks first): the positions' cos and sin are read once for the block. The
rotation pairs channel ``a`` with channel ``b``: ``(j, j + width / 2)`` for the halves, ``(2j, 2j +
1)`` for interleaved pairs (constexpr ``INTERLEAVED``). Channel ``i`` reads its table at ``i``, at
``i // 2`` (tables widened by ``repeat_interleave``) or at ``i % (width / 2)`` (widened by
``repeat``) (constexpr ``EXPAND``); a table's first half only is read where the layout cuts it,
which changes no index. The output is ``[x_a c_a - x_b s_a | x_b c_b + x_a s_b]`` for each pair,
rounded where the native ops round: each product to the dtype they compute in (constexpr
``COMPUTE``: float32 where the model computes from float32 copies, else the input's), then the sum
(``round(-x_b s_a) == -round(x_b s_a)``), stored in the output's dtype. The products
of two float16 or bfloat16 values are exact in float32, so after those roundings the result is
native's bit for bit. In float32 the kernels are compiled with ``enable_fp_fusion=False``, so that
no multiply-add is contracted into an FMA, which would round once where native rounds twice (on an
H200 with Triton's default contraction the PTX held 16 ``fma.rn.f32`` and 649,252 of 4.2M float32
outputs differed from native; without it, none and none). Channels past the rotary width (partial
rotary, constexpr ``PASS`` of them) are copied.

The backward is the same kernel on the outputs' gradient ``g``: native autograd computes
``round(round(g c) + rotate^T(round(g s)))`` with ``rotate^T`` the rotation's negation, that is
``[g_a c_a + g_b s_b | g_b c_b - g_a s_a]`` with the same roundings, and the passed channels'
gradient as it is. Only ``cos`` and ``sin`` are kept.

The outputs have the strides and dtype native's outputs have for the same inputs (PyTorch's
TensorIterator chooses the strides from the inputs'); they are found once per layout by running the
native definition on meta tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..rotary import EXPANDS, RotaryLayout, rotary_one_backward_native, rotary_one_native, rotary_width
from . import device_of
from .launch import Kernel

__all__ = [
    "rotary",
    "rotary_autograd",
    "rotary_backward",
    "rotary_one",
    "rotary_one_autograd",
    "rotary_one_backward",
]

# Launch shape, measured on an H200 (Llama-3-8B's 32 query and 8 key heads of 128, bf16, q and k
# slices of a merged projection; CUDA-graph replays): blocks of 8 heads (at most _TILE elements a half,
# capped by the smaller head count) at one position, 8 bytes a thread (4 warps), were within 3% of
# the best of 3 x 4 x 4 shapes (heads 8/16/32, positions 1-8, 2-16 warps) at 1, 256, 4096 and 32768
# tokens: 1.26, 3.13, 23.0 and 167 us, against torch.compile's 2.25, 4.51, 27.4 and 167. Blocks of
# several positions gained nothing (within 1%). A grid over rows with the head blocks fastest was
# 6% faster at 32768 tokens than the head blocks in a second grid axis.
_TILE, _THREAD_BYTES = 1024, 8
# The dtype the products round to, where the model computes in its inputs' dtype.
_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# Benchmarks and tests override the launch here: block_s, block_h, num_warps, masked (predicate even
# exact tiles), index_64 (64-bit offsets at any size).
TUNING: dict = {}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and back: where a PyTorch op in ``dtype`` stores."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _table_column(channel, PAIRS: tl.constexpr, EXPAND: tl.constexpr):
    """The table column channel ``channel`` reads: itself, or with the table widened by
    ``repeat_interleave`` (1) or ``repeat`` (2), its pair's."""
    column = channel
    if EXPAND == 1:
        column = channel // 2
    if EXPAND == 2:
        column = channel % PAIRS
    return column


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, b, s, s_mask, h0, H,
    x_sb, x_ss, x_sh, o_sb, o_ss, o_sh,
    ca, cb, sa, sb, ch_a, ch_b, pair_mask,
    PAIRS: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_H: tl.constexpr,
    COMPUTE: tl.constexpr, BACKWARD: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """Heads ``h0 : h0 + BLOCK_H`` of ``x`` at positions ``s`` (``[BLOCK_S, 1, 1]``), rotated into ``out``:
    the products rounded to ``COMPUTE``, the sums stored in ``out``'s dtype."""
    out_dtype = out_ptr.dtype.element_ty
    heads = h0 + tl.arange(0, BLOCK_H)[None, :, None]
    x = x_ptr + b * x_sb + s * x_ss + heads * x_sh
    out = out_ptr + b * o_sb + s * o_ss + heads * o_sh
    if EVEN:  # blocks that tile the positions, the heads and the pairs exactly need no predicate
        a = tl.load(x + ch_a).to(tl.float32)
        z = tl.load(x + ch_b).to(tl.float32)
    else:
        mask = s_mask & (heads < H) & pair_mask
        a = tl.load(x + ch_a, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(x + ch_b, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        oa = _round(a * ca, COMPUTE) + _round(z * sb, COMPUTE)
        ob = _round(z * cb, COMPUTE) - _round(a * sa, COMPUTE)
    else:
        oa = _round(a * ca, COMPUTE) - _round(z * sa, COMPUTE)
        ob = _round(z * cb, COMPUTE) + _round(a * sb, COMPUTE)
    if EVEN:
        tl.store(out + ch_a, oa.to(out_dtype))
        tl.store(out + ch_b, ob.to(out_dtype))
    else:
        tl.store(out + ch_a, oa.to(out_dtype), mask=mask)
        tl.store(out + ch_b, ob.to(out_dtype), mask=mask)
    if PASS > 0:  # the channels past the rotary width, as they are
        passed = 2 * PAIRS + tl.arange(0, BLOCK_PASS)[None, None, :]
        pass_mask = s_mask & (heads < H) & (passed < 2 * PAIRS + PASS)
        tl.store(out + passed, tl.load(x + passed, mask=pass_mask).to(out_dtype), mask=pass_mask)


@Kernel
@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    S, S_BLOCKS, HQ, HK, Q_BLOCKS, N_BLOCKS,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
    qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
    c_sb, c_ss, s_sb, s_ss,
    PAIRS: tl.constexpr, BLOCK_PAIRS: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, EXPAND: tl.constexpr,
    COMPUTE: tl.constexpr, BACKWARD: tl.constexpr, EVEN: tl.constexpr, INDEX_64: tl.constexpr,
):  # fmt: skip
    # One axis, the head blocks of a row of positions fastest: programs launched together read
    # neighbouring memory (a row's q heads, then its k heads, which a merged projection keeps beside
    # them), rather than one block of every row.
    pid = tl.program_id(0)
    if INDEX_64:  # offsets past 2**31 elements; below that, 32-bit address arithmetic is shorter
        pid = pid.to(tl.int64)
    row = pid // N_BLOCKS
    block = pid % N_BLOCKS
    b = row // S_BLOCKS
    s = (row % S_BLOCKS) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None, None]
    s_mask = s < S
    pairs = tl.arange(0, BLOCK_PAIRS)[None, None, :]
    if INTERLEAVED:
        ch_a, ch_b = 2 * pairs, 2 * pairs + 1
    else:
        ch_a, ch_b = pairs, pairs + PAIRS
    col_a, col_b = _table_column(ch_a, PAIRS, EXPAND), _table_column(ch_b, PAIRS, EXPAND)
    c_row = cos_ptr + b * c_sb + s * c_ss
    s_row = sin_ptr + b * s_sb + s * s_ss
    pair_mask = pairs < PAIRS
    # [BLOCK_S, 1, BLOCK_PAIRS]: each position's cos and sin, read once for the block of heads.
    if EVEN:
        ca, cb = tl.load(c_row + col_a).to(tl.float32), tl.load(c_row + col_b).to(tl.float32)
        sa, sb = tl.load(s_row + col_a).to(tl.float32), tl.load(s_row + col_b).to(tl.float32)
    else:
        cmask = s_mask & pair_mask
        ca = tl.load(c_row + col_a, mask=cmask, other=0.0).to(tl.float32)
        cb = tl.load(c_row + col_b, mask=cmask, other=0.0).to(tl.float32)
        sa = tl.load(s_row + col_a, mask=cmask, other=0.0).to(tl.float32)
        sb = tl.load(s_row + col_b, mask=cmask, other=0.0).to(tl.float32)
    if block < Q_BLOCKS:
        _rotate_heads(
            q_ptr, q_out_ptr, b, s, s_mask, block * BLOCK_H, HQ, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh,
            ca, cb, sa, sb, ch_a, ch_b, pair_mask, PAIRS, PASS, BLOCK_PASS, BLOCK_H, COMPUTE, BACKWARD, EVEN,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_out_ptr, b, s, s_mask, (block - Q_BLOCKS) * BLOCK_H, HK, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh,
            ca, cb, sa, sb, ch_a, ch_b, pair_mask, PAIRS, PASS, BLOCK_PASS, BLOCK_H, COMPUTE, BACKWARD, EVEN,
        )  # fmt: skip


def _bsh(x: Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """``x``'s (batch, position, head) strides: ``[B, H, S, D]`` for unsqueeze_dim 1, ``[B, S, H, D]`` for 2."""
    if unsqueeze_dim == 1:
        return x.stride(0), x.stride(2), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _extent(x: Tensor) -> int:
    """One past the largest element offset ``x`` reaches from its first element."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()) if n > 0)


@functools.lru_cache(maxsize=1024)
def _native_output(shape, stride, dtype, cos_shape, cos_stride, sin_stride, cos_dtype, layout, backward):
    """The strides and dtype of native's output (or input gradient, ``backward``) for an input of
    ``shape``, ``stride`` and ``dtype``: worked out by PyTorch itself on meta tensors (no data, no
    device work)."""

    def meta(size, strides, dtype):
        return torch.empty_strided(size, strides, dtype=dtype, device="meta")

    x, cos, sin = meta(shape, stride, dtype), meta(cos_shape, cos_stride, cos_dtype), meta(cos_shape, sin_stride, cos_dtype)
    with torch.no_grad():
        out = (rotary_one_backward_native if backward else rotary_one_native)(x, cos, sin, *layout)
    return out.stride(), out.dtype


def _like_native(x: Tensor, cos: Tensor, sin: Tensor, layout: RotaryLayout, backward: bool = False) -> Tensor:
    strides, dtype = _native_output(
        tuple(x.shape), x.stride(), x.dtype, tuple(cos.shape), cos.stride(), sin.stride(), cos.dtype, layout, backward
    )
    return torch.empty_strided(x.shape, strides, dtype=dtype, device=x.device)


def _launch_shape(hq: int, hk: int, pairs: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_PAIRS, BLOCK_S, BLOCK_H, num_warps): blocks of heads no larger than the smaller head
    count (so that neither q's nor k's blocks are mostly padding), one position a block."""
    block_pairs = triton.next_power_of_2(pairs)
    heads = min(hq, hk) if hq and hk else max(hq, hk)
    block_h = TUNING.get("block_h", max(1, min(triton.next_power_of_2(heads), _TILE // block_pairs)))
    block_s = TUNING.get("block_s", 1)
    tile = block_s * block_h * block_pairs  # elements of one half-load
    num_warps = TUNING.get("num_warps", max(1, min(8, tile * element_size // _THREAD_BYTES // 32)))
    return block_pairs, block_s, block_h, num_warps


def _launch(
    q: Tensor | None, k: Tensor | None, cos: Tensor, sin: Tensor, q_out: Tensor | None, k_out: Tensor | None,
    layout: RotaryLayout, backward: bool,
) -> None:  # fmt: skip
    """Rotate ``q`` into ``q_out`` and ``k`` into ``k_out`` (either pair may be None) in one launch."""
    dim = layout.unsqueeze_dim
    first = q if q is not None else k
    batch, d = first.shape[0], first.shape[-1]
    seq = first.shape[2] if dim == 1 else first.shape[1]
    hq = 0 if q is None else q.shape[1 if dim == 1 else 2]
    hk = 0 if k is None else k.shape[1 if dim == 1 else 2]
    if batch * seq == 0 or hq + hk == 0:
        return
    width = rotary_width(cos.shape[-1], layout.expand, layout.first_half) if layout.partial else d
    pairs, passed = width // 2, d - width
    block_pairs, block_s, block_h, num_warps = _launch_shape(hq, hk, pairs, first.element_size())
    s_blocks, q_blocks, k_blocks = triton.cdiv(seq, block_s), triton.cdiv(hq, block_h), triton.cdiv(hk, block_h)
    even = pairs == block_pairs and seq % block_s == 0 and hq % block_h == 0 and hk % block_h == 0
    tensors = [t for t in (q, k, q_out, k_out, cos, sin) if t is not None]
    index_64 = TUNING.get("index_64", max(map(_extent, tensors)) >= 2**31)
    # A missing pair borrows the other's pointers and strides: its blocks are never launched.
    q, q_out = (q, q_out) if q is not None else (k, k_out)
    k, k_out = (k, k_out) if k is not None else (q, q_out)
    c_sb = cos.stride(0) if cos.shape[0] != 1 else 0
    s_sb = sin.stride(0) if sin.shape[0] != 1 else 0
    with device_of(first):
        _rotary_kernel[(batch * s_blocks * (q_blocks + k_blocks),)](
            q, k, cos, sin, q_out, k_out,
            seq, s_blocks, hq, hk, q_blocks, q_blocks + k_blocks,
            *_bsh(q, dim), *_bsh(k, dim), *_bsh(q_out, dim), *_bsh(k_out, dim),
            c_sb, cos.stride(1), s_sb, sin.stride(1),
            PAIRS=pairs, BLOCK_PAIRS=block_pairs, PASS=passed, BLOCK_PASS=triton.next_power_of_2(max(passed, 1)),
            BLOCK_S=block_s, BLOCK_H=block_h, INTERLEAVED=layout.interleaved, EXPAND=EXPANDS.index(layout.expand),
            COMPUTE=tl.float32 if layout.upcast else _TRITON_DTYPES[first.dtype], BACKWARD=backward,
            EVEN=even and not TUNING.get("masked", False), INDEX_64=index_64, num_warps=num_warps, enable_fp_fusion=False,
        )  # fmt: skip


def _layout(*parameters) -> RotaryLayout:
    """The layout, its unsqueeze dimension counted from the front (1 or 2)."""
    layout = RotaryLayout(*parameters)
    dim = layout.unsqueeze_dim
    return layout._replace(unsqueeze_dim=dim + 4 if dim < 0 else dim)


def rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False,
    expand: str = "none", first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The triton provider of ``rotary``: both outputs from one launch, laid out as native's."""
    layout = _layout(unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    q_out, k_out = _like_native(q, cos, sin, layout), _like_native(k, cos, sin, layout)
    _launch(q, k, cos, sin, q_out, k_out, layout, backward=False)
    return q_out, k_out


def rotary_one(
    x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False, expand: str = "none",
    first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> Tensor:  # fmt: skip
    """The triton provider of ``rotary_one``, laid out as native's output."""
    layout = _layout(unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    out = _like_native(x, cos, sin, layout)
    _launch(x, None, cos, sin, out, None, layout, backward=False)
    return out


def _gradients(grads: list[Tensor | None], cos: Tensor, sin: Tensor, layout: RotaryLayout) -> list[Tensor | None]:
    """The inputs' gradients for the outputs' (None: that output had none), each laid out like
    native's."""
    grads = [g if g is None or g.stride(-1) == 1 else g.contiguous() for g in grads]
    outs = [None if g is None else _like_native(g, cos, sin, layout, backward=True) for g in grads]
    if any(g is not None for g in grads):
        _launch(grads[0], grads[1] if len(grads) > 1 else None, cos, sin, outs[0], outs[1] if len(outs) > 1 else None,
                layout, backward=True)  # fmt: skip
    return outs


def rotary_backward(
    grad_q: Tensor | None, grad_k: Tensor | None, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1,
    interleaved: bool = False, expand: str = "none", first_half: bool = False, partial: bool = False,
    upcast: bool = False, cast: bool = False,
) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """The gradients of ``q`` and ``k`` for the outputs' gradients (None: that output had none)."""
    layout = _layout(unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    grad_q, grad_k = _gradients([grad_q, grad_k], cos, sin, layout)
    return grad_q, grad_k


def rotary_one_backward(
    grad: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False, expand: str = "none",
    first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> Tensor:  # fmt: skip
    """The gradient of ``rotary_one``'s ``x`` for its output's gradient."""
    layout = _layout(unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    return _gradients([grad], cos, sin, layout)[0]


class _RotaryFunction(torch.autograd.Function):
    """``rotary`` with these kernels' backward: only cos and sin are kept."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, *layout):
        ctx.set_materialize_grads(False)  # an output nothing used gives its input no gradient
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        return rotary(q, k, cos, sin, *layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad[:2]
        grad_q, grad_k = rotary_backward(grad_q if need_q else None, grad_k if need_k else None, cos, sin, *ctx.layout)
        return grad_q, grad_k, None, None, *(None,) * len(ctx.layout)


class _RotaryOneFunction(torch.autograd.Function):
    """``rotary_one`` with these kernels' backward: only cos and sin are kept."""

    @staticmethod
    def forward(ctx, x, cos, sin, *layout):
        ctx.save_for_backward(cos, sin)
        ctx.layout = layout
        return rotary_one(x, cos, sin, *layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotary_one_backward(grad, cos, sin, *ctx.layout), None, None, *(None,) * len(ctx.layout)


def rotary_autograd(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False,
    expand: str = "none", first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The triton provider of ``rotary`` for calls that need a backward (of q and k; never of cos or sin)."""
    return _RotaryFunction.apply(q, k, cos, sin, unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)


def rotary_one_autograd(
    x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False, expand: str = "none",
    first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> Tensor:  # fmt: skip
    """The triton provider of ``rotary_one`` for calls that need a backward (of x; never of cos or sin)."""
    return _RotaryOneFunction.apply(x, cos, sin, unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
