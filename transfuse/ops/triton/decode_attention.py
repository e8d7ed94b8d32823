"""Triton kernels for decode_attention: the cache write and one query's attention in one or two launches.

A program takes one (sequence, key/value head) and one slice of the ``n + 1`` positions, with the
query heads that share the key/value head, and runs an online softmax over blocks of its slice
in float32 (scores, running maximum and sum, the weighted values). At batch 1 a model has a few
key/value heads, so the positions are split over enough programs to fill the GPU; each slice's
maximum, sum and weighted values then go to a float32 scratch and a second kernel combines
them, rounding once when it stores the output (one slice: the first kernel stores it). The
first slice's program writes the new token's key and value into the cache at position ``n``;
every program takes them from the inputs, not from the cache, so none reads what another
writes. At decode sizes a layer's attention is a few microseconds of GPU time; what these
kernels save is the host's launches (two concatenations of the cache and the attention's own
kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_of
from .launch import Kernel

__all__ = ["decode_attention"]


@Kernel
@triton.jit(do_not_specialize=["n", "per_split"])
def _decode_attention_kernel(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    k_ptr,
    v_ptr,
    allowed_ptr,
    out_ptr,
    partial_ptr,
    n,
    per_split,
    scaling,
    q_batch_stride,
    q_head_stride,
    k_new_batch_stride,
    k_new_head_stride,
    v_new_batch_stride,
    v_new_head_stride,
    k_batch_stride,
    k_head_stride,
    k_seq_stride,
    v_batch_stride,
    v_head_stride,
    v_seq_stride,
    allowed_batch_stride,
    out_batch_stride,
    out_head_stride,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < D
    vdims = tl.arange(0, BLOCK_DV)
    in_vdim = vdims < DV
    k_new = tl.load(k_new_ptr + b * k_new_batch_stride + h * k_new_head_stride + dims, mask=in_dim, other=0.0)
    v_new = tl.load(v_new_ptr + b * v_new_batch_stride + h * v_new_head_stride + vdims, mask=in_vdim, other=0.0)
    k_base = k_ptr + b * k_batch_stride + h * k_head_stride
    v_base = v_ptr + b * v_batch_stride + h * v_head_stride
    if split == 0:
        tl.store(k_base + n * k_seq_stride + dims, k_new, mask=in_dim)
        tl.store(v_base + n * v_seq_stride + vdims, v_new, mask=in_vdim)

    groups = tl.arange(0, BLOCK_G)
    in_group = groups < GROUP
    heads = h * GROUP + groups
    q = tl.load(
        q_ptr + b * q_batch_stride + heads[:, None] * q_head_stride + dims[None, :],
        mask=in_group[:, None] & in_dim[None, :],
        other=0.0,
    ).to(tl.float32)
    running_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    first = split * per_split
    last = tl.minimum(first + per_split, n + 1)  # this program's positions: [first, last)
    for start in range(first, last, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        inside = pos < last
        cached = inside & (pos < n)  # position n is the new token, from the inputs
        is_new = pos == n
        k = tl.load(k_base + pos[:, None] * k_seq_stride + dims[None, :], mask=cached[:, None] & in_dim[None, :], other=0.0)
        k = tl.where(is_new[:, None], k_new[None, :], k).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [BLOCK_G, BLOCK_N]
        ok = inside
        if MASKED:
            allowed = tl.load(allowed_ptr + b * allowed_batch_stride + pos, mask=cached, other=0)
            ok = (cached & (allowed != 0)) | is_new
        scores = tl.where(ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing allowed yet
        rescale = tl.exp(running_max - safe_max)
        weights = tl.exp(scores - safe_max[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        v = tl.load(v_base + pos[:, None] * v_seq_stride + vdims[None, :], mask=cached[:, None] & in_vdim[None, :], other=0.0)
        v = tl.where(is_new[:, None], v_new[None, :], v).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    if SPLIT:
        # [batch, kv_heads, splits, group, DV + 2]: the weighted values, then the maximum and the sum.
        row = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + split) * GROUP + groups
        base = partial_ptr + row[:, None] * (DV + 2)
        tl.store(base + vdims[None, :], acc, mask=in_group[:, None] & in_vdim[None, :])
        tl.store(partial_ptr + row * (DV + 2) + DV, running_max, mask=in_group)
        tl.store(partial_ptr + row * (DV + 2) + DV + 1, total, mask=in_group)
    else:
        tl.store(
            out_ptr + b * out_batch_stride + heads[:, None] * out_head_stride + vdims[None, :],
            (acc / total[:, None]).to(out_ptr.dtype.element_ty),
            mask=in_group[:, None] & in_vdim[None, :],
        )


@Kernel
@triton.jit
def _combine_kernel(
    partial_ptr,
    out_ptr,
    splits,
    out_batch_stride,
    out_head_stride,
    GROUP: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Each (sequence, query head): the slices' softmax pieces combined, rounded once."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kv_head, g = head // GROUP, head % GROUP
    kv_heads = tl.num_programs(1) // GROUP
    s = tl.arange(0, BLOCK_S)
    vdims = tl.arange(0, BLOCK_DV)
    rows = ((b * kv_heads + kv_head) * splits + s) * GROUP + g
    in_split = s < splits
    maxima = tl.load(partial_ptr + rows * (DV + 2) + DV, mask=in_split, other=float("-inf"))
    sums = tl.load(partial_ptr + rows * (DV + 2) + DV + 1, mask=in_split, other=0.0)
    acc = tl.load(partial_ptr + rows[:, None] * (DV + 2) + vdims[None, :], mask=in_split[:, None] & (vdims < DV)[None, :], other=0.0)
    top = tl.max(maxima, axis=0)
    scale = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - top))
    out = tl.sum(acc * scale[:, None], axis=0) / tl.sum(sums * scale, axis=0)
    tl.store(out_ptr + b * out_batch_stride + head * out_head_stride + vdims, out.to(out_ptr.dtype.element_ty), mask=vdims < DV)


# Programs to aim for (a few per SM of an H200's 132): slices of the positions make up for few
# sequences times key/value heads.
TARGET_PROGRAMS = 264
# Fewest positions a slice takes: below this a slice's fixed cost outweighs its share.
MIN_SLICE = 64


def decode_attention(query: Tensor, key: Tensor, value: Tensor, keys: Tensor, values: Tensor, n: int, allowed, scaling):
    """The triton provider of ``decode_attention`` (arguments as ``decode_attention_native``)."""
    batch, heads, _, dim = query.shape
    kv_heads, dim_v = key.shape[1], value.shape[-1]
    group = heads // kv_heads
    out = query.new_empty((batch, 1, heads, dim_v))
    block_d, block_dv = triton.next_power_of_2(dim), triton.next_power_of_2(dim_v)
    block_g = triton.next_power_of_2(group)
    # The [group, block, dim] product held per step: about 8K float32 values for 4 warps.
    block_n = max(8, min(64, triton.next_power_of_2(max(1, 8192 // (block_g * max(block_d, block_dv))))))
    positions = n + 1
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, batch * kv_heads), triton.cdiv(positions, MIN_SLICE)))
    per_split = triton.cdiv(triton.cdiv(positions, splits), block_n) * block_n
    splits = triton.cdiv(positions, per_split)
    partial = out.new_empty((batch * kv_heads * splits * group, dim_v + 2), dtype=torch.float32) if splits > 1 else out
    mask = allowed if allowed is not None else query  # not read when MASKED is False
    with device_of(query):
        _decode_attention_kernel[(batch, kv_heads, splits)](
            query, key, value, keys, values, mask, out, partial, n, per_split, scaling,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            allowed.stride(0) if allowed is not None else 0, out.stride(0), out.stride(2),
            GROUP=group, BLOCK_G=block_g, D=dim, DV=dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
            MASKED=allowed is not None, SPLIT=splits > 1, num_warps=4,
        )  # fmt: skip
        if splits > 1:
            _combine_kernel[(batch, heads)](
                partial, out, splits, out.stride(0), out.stride(2),
                GROUP=group, DV=dim_v, BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
            )  # fmt: skip
    return out
