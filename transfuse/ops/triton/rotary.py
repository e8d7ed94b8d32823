"""Triton kernels for rotary: ``x * cos + rotate_half(x) * sin`` for the query and the key in one launch.

Each program takes a block of positions of one sequence and a block of heads, of the query or of
the key (the query's blocks first): the positions' cos and sin are read once for the block. With
``x = [x1 | x2]`` and ``c = [c1 | c2]``, ``s = [s1 | s2]`` split alike, the output is
``[x1 c1 - x2 s1 | x2 c2 + x1 s2]``, rounded where ``apply_rotary_pos_emb``'s separate ops round:
each product to the input dtype, then the sum (``round(-x2 s1) == -round(x2 s1)``). The products of
two float16 or bfloat16 values are exact in float32, so after those roundings the result is native's
bit for bit. In float32 the kernels are compiled with ``enable_fp_fusion=False``, so that no
multiply-add is contracted into an FMA, which would round once where native rounds twice (on an
H200 with Triton's default contraction the PTX held 16 ``fma.rn.f32`` and 649,252 of 4.2M float32
outputs differed from native; without it, none and none).

The backward is the same kernel on the outputs' gradient ``g``: native autograd computes
``round(round(g c) + rotate_half^T(round(g s)))`` with ``rotate_half^T(y) = [y2 | -y1]``, that is
``[g1 c1 + g2 s2 | g2 c2 - g1 s1]`` with the same roundings. Only ``cos`` and ``sin`` are kept.

The outputs have the strides native's outputs have for the same inputs (PyTorch's TensorIterator
chooses them from the inputs' strides); they are found once per layout by running the native
formula on meta tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..rotary import _rotate_half
from . import device_of
from .launch import Kernel

__all__ = ["rotary", "rotary_autograd", "rotary_backward"]

# Launch shape, measured on an H200 (Llama-3-8B's 32 query and 8 key heads of 128, bf16, q and k
# slices of a merged projection; CUDA-graph replays): blocks of 8 heads (at most _TILE elements a half,
# capped by the smaller head count) at one position, 8 bytes a thread (4 warps), were within 3% of
# the best of 3 x 4 x 4 shapes (heads 8/16/32, positions 1-8, 2-16 warps) at 1, 256, 4096 and 32768
# tokens: 1.26, 3.13, 23.0 and 167 us, against torch.compile's 2.25, 4.51, 27.4 and 167. Blocks of
# several positions gained nothing (within 1%). A grid over rows with the head blocks fastest was
# 6% faster at 32768 tokens than the head blocks in a second grid axis.
_TILE, _THREAD_BYTES = 1024, 8
# Benchmarks and tests override the launch here: block_s, block_h, num_warps, masked (predicate even
# exact tiles), index_64 (64-bit offsets at any size).
TUNING: dict = {}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and back: where a PyTorch op in ``dtype`` stores."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, b, s, s_mask, h0, H,
    x_sb, x_ss, x_sh, o_sb, o_ss, o_sh,
    c1, c2, s1, s2,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """Heads ``h0 : h0 + BLOCK_H`` of ``x`` at positions ``s`` (``[BLOCK_S, 1, 1]``), rotated into ``out``."""
    dtype = x_ptr.dtype.element_ty
    heads = h0 + tl.arange(0, BLOCK_H)[None, :, None]
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    x = x_ptr + b * x_sb + s * x_ss + heads * x_sh + cols
    out = out_ptr + b * o_sb + s * o_ss + heads * o_sh + cols
    if EVEN:  # blocks that tile the positions, the heads and the half exactly need no predicate
        a1 = tl.load(x).to(tl.float32)
        a2 = tl.load(x + HALF).to(tl.float32)
    else:
        mask = s_mask & (heads < H) & (cols < HALF)
        a1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        a2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = _round(a1 * c1, dtype) + _round(a2 * s2, dtype)
        o2 = _round(a2 * c2, dtype) - _round(a1 * s1, dtype)
    else:
        o1 = _round(a1 * c1, dtype) - _round(a2 * s1, dtype)
        o2 = _round(a2 * c2, dtype) + _round(a1 * s2, dtype)
    if EVEN:
        tl.store(out, o1.to(dtype))
        tl.store(out + HALF, o2.to(dtype))
    else:
        tl.store(out, o1.to(dtype), mask=mask)
        tl.store(out + HALF, o2.to(dtype), mask=mask)


@Kernel
@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    S, S_BLOCKS, HQ, HK, Q_BLOCKS, N_BLOCKS,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
    qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
    c_sb, c_ss, s_sb, s_ss,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr, EVEN: tl.constexpr, INDEX_64: tl.constexpr,
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
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    c_row = cos_ptr + b * c_sb + s * c_ss + cols
    s_row = sin_ptr + b * s_sb + s * s_ss + cols
    # [BLOCK_S, 1, BLOCK_HALF]: each position's cos and sin, read once for the block of heads.
    if EVEN:
        c1, c2 = tl.load(c_row).to(tl.float32), tl.load(c_row + HALF).to(tl.float32)
        s1, s2 = tl.load(s_row).to(tl.float32), tl.load(s_row + HALF).to(tl.float32)
    else:
        cmask = s_mask & (cols < HALF)
        c1 = tl.load(c_row, mask=cmask, other=0.0).to(tl.float32)
        c2 = tl.load(c_row + HALF, mask=cmask, other=0.0).to(tl.float32)
        s1 = tl.load(s_row, mask=cmask, other=0.0).to(tl.float32)
        s2 = tl.load(s_row + HALF, mask=cmask, other=0.0).to(tl.float32)
    if block < Q_BLOCKS:
        _rotate_heads(
            q_ptr, q_out_ptr, b, s, s_mask, block * BLOCK_H, HQ, q_sb, q_ss, q_sh, qo_sb, qo_ss, qo_sh,
            c1, c2, s1, s2, HALF, BLOCK_HALF, BLOCK_H, BACKWARD, EVEN,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_out_ptr, b, s, s_mask, (block - Q_BLOCKS) * BLOCK_H, HK, k_sb, k_ss, k_sh, ko_sb, ko_ss, ko_sh,
            c1, c2, s1, s2, HALF, BLOCK_HALF, BLOCK_H, BACKWARD, EVEN,
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
def _native_strides(shape: tuple, stride: tuple, cos_shape: tuple, cos_stride: tuple, sin_stride: tuple, dim: int):
    """The strides of native's output for an input of ``shape`` and ``stride``: the native formula's
    layout, worked out by PyTorch itself on meta tensors (no data, no device work)."""

    def meta(size, strides):
        return torch.empty_strided(size, strides, dtype=torch.float32, device="meta")

    x, cos, sin = meta(shape, stride), meta(cos_shape, cos_stride), meta(cos_shape, sin_stride)
    with torch.no_grad():
        cos, sin = cos.unsqueeze(dim), sin.unsqueeze(dim)
        return (x * cos + _rotate_half(x) * sin).stride()


def _like_native(x: Tensor, cos: Tensor, sin: Tensor, dim: int) -> Tensor:
    strides = _native_strides(tuple(x.shape), x.stride(), tuple(cos.shape), cos.stride(), sin.stride(), dim)
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)


def _launch_shape(hq: int, hk: int, half: int, element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_HALF, BLOCK_S, BLOCK_H, num_warps): blocks of heads no larger than the smaller head
    count (so that neither q's nor k's blocks are mostly padding), one position a block."""
    block_half = triton.next_power_of_2(half)
    heads = min(hq, hk) if hq and hk else max(hq, hk)
    block_h = TUNING.get("block_h", max(1, min(triton.next_power_of_2(heads), _TILE // block_half)))
    block_s = TUNING.get("block_s", 1)
    tile = block_s * block_h * block_half  # elements of one half-load
    num_warps = TUNING.get("num_warps", max(1, min(8, tile * element_size // _THREAD_BYTES // 32)))
    return block_half, block_s, block_h, num_warps


def _launch(
    q: Tensor | None, k: Tensor | None, cos: Tensor, sin: Tensor, q_out: Tensor | None, k_out: Tensor | None,
    dim: int, backward: bool,
) -> None:  # fmt: skip
    """Rotate ``q`` into ``q_out`` and ``k`` into ``k_out`` (either pair may be None) in one launch."""
    first = q if q is not None else k
    batch, d = first.shape[0], first.shape[-1]
    seq = first.shape[2] if dim == 1 else first.shape[1]
    hq = 0 if q is None else q.shape[1 if dim == 1 else 2]
    hk = 0 if k is None else k.shape[1 if dim == 1 else 2]
    if batch * seq == 0 or hq + hk == 0:
        return
    half = d // 2
    block_half, block_s, block_h, num_warps = _launch_shape(hq, hk, half, first.element_size())
    s_blocks, q_blocks, k_blocks = triton.cdiv(seq, block_s), triton.cdiv(hq, block_h), triton.cdiv(hk, block_h)
    even = half == block_half and seq % block_s == 0 and hq % block_h == 0 and hk % block_h == 0
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
            HALF=half, BLOCK_HALF=block_half, BLOCK_S=block_s, BLOCK_H=block_h,
            BACKWARD=backward, EVEN=even and not TUNING.get("masked", False), INDEX_64=index_64,
            num_warps=num_warps, enable_fp_fusion=False,
        )  # fmt: skip


def _dim(unsqueeze_dim: int) -> int:
    return unsqueeze_dim + 4 if unsqueeze_dim < 0 else unsqueeze_dim


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The triton provider of ``rotary``: both outputs from one launch, laid out as native's."""
    dim = _dim(unsqueeze_dim)
    q_out, k_out = _like_native(q, cos, sin, dim), _like_native(k, cos, sin, dim)
    _launch(q, k, cos, sin, q_out, k_out, dim, backward=False)
    return q_out, k_out


def rotary_backward(
    grad_q: Tensor | None, grad_k: Tensor | None, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of ``q`` and ``k`` for the outputs' gradients (None: that output had none),
    each laid out like its output's gradient would be by native (the forward's layout)."""
    dim = _dim(unsqueeze_dim)
    grads = [g if g is None or g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k)]
    outs = [None if g is None else _like_native(g, cos, sin, dim) for g in grads]
    if any(g is not None for g in grads):
        _launch(grads[0], grads[1], cos, sin, outs[0], outs[1], dim, backward=True)
    return outs[0], outs[1]


class _RotaryFunction(torch.autograd.Function):
    """``rotary`` with these kernels' backward: only cos and sin are kept."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.set_materialize_grads(False)  # an output nothing used gives its input no gradient
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return rotary(q, k, cos, sin, unsqueeze_dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad[:2]
        grad_q, grad_k = rotary_backward(grad_q if need_q else None, grad_k if need_k else None, cos, sin, ctx.unsqueeze_dim)
        return grad_q, grad_k, None, None, None


def rotary_autograd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The triton provider of ``rotary`` for calls that need a backward (of q and k; never of cos or sin)."""
    return _RotaryFunction.apply(q, k, cos, sin, unsqueeze_dim)
