"""Triton kernel for decode_attention: the cache write and one query's attention in one launch.

One program per (sequence, key/value head) takes the query heads that share the key/value
head, writes the new token's key and value into the cache at position ``n``, and runs an
online softmax over blocks of the ``n + 1`` positions in float32 (scores, running maximum and
sum, the weighted values), rounding once when it stores the output. The new token's key and
value are taken from the inputs, not read back from the cache, so no program reads what it
writes. At decode sizes a layer's attention is a few microseconds of GPU time; what this kernel
saves is the host's launches (two concatenations of the cache and the attention's own kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from . import device_of
from .launch import Kernel

__all__ = ["decode_attention"]


@Kernel
@triton.jit(do_not_specialize=["n"])
def _decode_attention_kernel(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    k_ptr,
    v_ptr,
    allowed_ptr,
    out_ptr,
    n,
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
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < D
    vdims = tl.arange(0, BLOCK_DV)
    in_vdim = vdims < DV
    k_new = tl.load(k_new_ptr + b * k_new_batch_stride + h * k_new_head_stride + dims, mask=in_dim, other=0.0)
    v_new = tl.load(v_new_ptr + b * v_new_batch_stride + h * v_new_head_stride + vdims, mask=in_vdim, other=0.0)
    k_base = k_ptr + b * k_batch_stride + h * k_head_stride
    v_base = v_ptr + b * v_batch_stride + h * v_head_stride
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
    for start in range(0, n + 1, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        cached = pos < n  # position n is the new token, from the inputs
        is_new = pos == n
        k = tl.load(k_base + pos[:, None] * k_seq_stride + dims[None, :], mask=cached[:, None] & in_dim[None, :], other=0.0)
        k = tl.where(is_new[:, None], k_new[None, :], k).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [BLOCK_G, BLOCK_N]
        ok = pos <= n
        if MASKED:
            allowed = tl.load(allowed_ptr + b * allowed_batch_stride + pos, mask=cached, other=0)
            ok = (cached & (allowed != 0)) | is_new
        scores = tl.where(ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a block with nothing allowed yet
        rescale = tl.exp(running_max - safe_max)
        weights = tl.exp(scores - safe_max[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        v = tl.load(v_base + pos[:, None] * v_seq_stride + vdims[None, :], mask=cached[:, None] & in_vdim[None, :], other=0.0)
        v = tl.where(is_new[:, None], v_new[None, :], v).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max
    out = acc / total[:, None]
    tl.store(
        out_ptr + b * out_batch_stride + heads[:, None] * out_head_stride + vdims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=in_group[:, None] & in_vdim[None, :],
    )


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
    mask = allowed if allowed is not None else query  # not read when MASKED is False
    with device_of(query):
        _decode_attention_kernel[(batch, kv_heads)](
            query, key, value, keys, values, mask, out, n, scaling,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            allowed.stride(0) if allowed is not None else 0, out.stride(0), out.stride(2),
            GROUP=group, BLOCK_G=block_g, D=dim, DV=dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
            MASKED=allowed is not None, num_warps=4,
        )  # fmt: skip
    return out
