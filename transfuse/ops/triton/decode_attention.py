"""Triton kernels for decode_attention: one query per sequence over a buffer of keys and values.

The keys are split into chunks, one program per (sequence, key/value head, chunk): at a decode
step's size (one sequence, eight key/value heads, a few hundred keys) a program per head alone
would leave all but eight of the GPU's SMs idle, each reading its whole buffer. A program holds
the query heads that share its key/value head as one ``[groups, dim]`` tile, walks its chunk in
blocks of keys (scores, the bias added, the softmax online in float32, the weights rounded to the
values' dtype for the weighted sum as flash attention does) and keeps its running maximum, sum and
weighted sum; a second kernel, a program per query head, combines the chunks of each head. With
one chunk a head the first kernel writes the output itself.

The token's key and value are written by the program whose chunk holds the position, which also
uses them from registers in place of the loads at that position (other programs never read it),
so no ordering between the write and the reads is needed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..dispatch import batch_invariant_active

from . import device_of, interpreting
from .launch import Kernel

__all__ = ["decode_attention", "thresholds"]

# Keys a block; a chunk is a whole number of blocks.
_BLOCK_N = 64
# Programs to aim for (per SM): chunks are made smaller until the grid has about this many.
_PROGRAMS_PER_SM = 1
# Chunks the combine kernel reads as one tile.
_COMBINE_SPLITS = 32
# Benchmarks and tests override the launch here: block_n, splits, programs_per_sm, num_warps.
TUNING: dict = {}


@Kernel
@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, nk_ptr, nv_ptr, pos_ptr, acc_ptr, ml_ptr, out_ptr,
    KVH, LENGTH, CHUNK, SPLITS, scaling,
    q_sb, q_sh, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, nk_sb, nk_sh, nv_sb, nv_sh,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE: tl.constexpr, FINAL: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // KVH
    h = bh % KVH
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    g_mask = g < G
    d_mask = d < D
    dv_mask = dv < DV
    q = tl.load(q_ptr + b * q_sb + (h * G + g)[:, None] * q_sh + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + b * k_sb + h * k_sh
    v_base = v_ptr + b * v_sb + h * v_sh
    start = split * CHUNK
    if WRITE:
        pos = tl.load(pos_ptr)
        new_k = tl.load(nk_ptr + b * nk_sb + h * nk_sh + d, mask=d_mask, other=0.0).to(k_ptr.dtype.element_ty)
        new_v = tl.load(nv_ptr + b * nv_sb + h * nv_sh + dv, mask=dv_mask, other=0.0).to(v_ptr.dtype.element_ty)
        if (pos >= start) & (pos < start + CHUNK) & (pos < LENGTH):
            tl.store(k_base + pos * k_sn + d, new_k, mask=d_mask)
            tl.store(v_base + pos * v_sn + dv, new_v, mask=dv_mask)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, start + CHUNK, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < LENGTH
        k = tl.load(k_base + n[:, None] * k_sn + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * v_sn + dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        if WRITE:
            here = (n == pos)[:, None]
            k = tl.where(here, new_k[None, :], k)
            v = tl.where(here, new_v[None, :], v)
        bias = tl.load(bias_ptr + bh * LENGTH + n, mask=n_mask, other=float("-inf")).to(tl.float32)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps a maximum of -inf: subtract 0 there, not -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        if DOT_FP32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    if FINAL:
        out = acc / l_i[:, None]
        offsets = b * (KVH * G * DV) + (h * G + g)[:, None] * DV + dv[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & dv_mask[None, :])
    else:
        row = bh * SPLITS + split
        tl.store(acc_ptr + row * (BLOCK_G * BLOCK_DV) + g[:, None] * BLOCK_DV + dv[None, :], acc)
        tl.store(ml_ptr + row * (2 * BLOCK_G) + g, m_i)
        tl.store(ml_ptr + row * (2 * BLOCK_G) + BLOCK_G + g, l_i)


@Kernel
@triton.jit
def _combine_kernel(
    acc_ptr, ml_ptr, out_ptr, KVH, SPLITS,
    G: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # One program a query head, the chunks read BLOCK_S at a time as one tile: a loop over the
    # chunks one by one would be a chain of dependent loads (a head of 64 chunks, 64 round trips).
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // KVH
    h = bh % KVH
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    m = float("-inf")
    for s0 in range(0, SPLITS, BLOCK_S):
        row = bh * SPLITS + s0 + s
        m = tl.maximum(m, tl.max(tl.load(ml_ptr + row * (2 * BLOCK_G) + g, mask=s0 + s < SPLITS, other=float("-inf"))))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = 0.0
    out = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        here = s0 + s < SPLITS
        row = bh * SPLITS + s0 + s
        scale = tl.exp(tl.load(ml_ptr + row * (2 * BLOCK_G) + g, mask=here, other=float("-inf")) - m_safe)
        total += tl.sum(scale * tl.load(ml_ptr + row * (2 * BLOCK_G) + BLOCK_G + g, mask=here, other=0.0))
        acc = tl.load(acc_ptr + row[:, None] * (BLOCK_G * BLOCK_DV) + g * BLOCK_DV + dv[None, :], mask=here[:, None], other=0.0)
        out += tl.sum(scale[:, None] * acc, 0)
    out = out / total
    tl.store(out_ptr + b * (KVH * G * DV) + (h * G + g) * DV + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def thresholds(query, keys, values, bias, scaling, key=None, value=None, position=None) -> dict:
    """Where the launch changes (``_splits``), as conformance reads it: from two blocks of keys a
    head is split into chunks combined by a second kernel; at ``programs`` key/value heads of all
    sequences together each gets one chunk again; the longest buffer split into the most chunks."""
    block_n = TUNING.get("block_n", _BLOCK_N)
    programs = TUNING.get("programs_per_sm", _PROGRAMS_PER_SM) * _sms(query.device)
    kv_heads = keys.shape[1]
    most = triton.cdiv(programs, kv_heads)
    return {"length": (block_n + 1, most * block_n + 1), "batch": (triton.cdiv(programs, kv_heads),)}


def _splits(rows: int, length: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(chunks a head, keys a chunk): chunks of whole blocks, as many as bring the grid to about
    ``_PROGRAMS_PER_SM`` programs an SM, and no more than there are blocks."""
    blocks = triton.cdiv(length, block_n)
    programs = TUNING.get("programs_per_sm", _PROGRAMS_PER_SM) * _sms(device)
    splits = TUNING.get("splits") or min(blocks, max(1, triton.cdiv(programs, rows)))
    chunk = triton.cdiv(blocks, splits) * block_n
    return triton.cdiv(length, chunk), chunk


def decode_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    scaling: float,
    key: Tensor | None = None,
    value: Tensor | None = None,
    position: Tensor | None = None,
) -> Tensor:
    """The triton provider of ``decode_attention``: ``[batch, 1, heads, dim]``; in batch-invariant
    mode, the mode's attention with no splits of the keys (``invariant.decode_attention``)."""
    if batch_invariant_active():
        from .invariant import decode_attention as invariant

        return invariant(query, keys, values, bias, scaling, key, value, position)
    batch, heads, _, dim = query.shape
    kv_heads, length, value_dim = keys.shape[1], keys.shape[2], values.shape[-1]
    groups = heads // kv_heads
    out = torch.empty(batch, 1, heads, value_dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    block_n = TUNING.get("block_n", _BLOCK_N)
    block_g = max(16, triton.next_power_of_2(groups))  # tl.dot's smallest tile
    block_d, block_dv = max(16, triton.next_power_of_2(dim)), max(16, triton.next_power_of_2(value_dim))
    rows = batch * kv_heads
    splits, chunk = _splits(rows, length, block_n, query.device)
    final = splits == 1
    acc = out if final else torch.empty(rows * splits * block_g * block_dv, dtype=torch.float32, device=query.device)
    ml = out if final else torch.empty(rows * splits * 2 * block_g, dtype=torch.float32, device=query.device)
    write = key is not None
    new_k, new_v, pos = (key, value, position) if write else (query, query, query)
    # float32 stays float32 (no TF32); Triton's interpreter multiplies bfloat16 wrongly, so there
    # the tiles are multiplied in float32 (after the same rounding of the weights).
    dot_fp32 = query.dtype != torch.float32 and interpreting()
    precision = "ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32"
    num_warps = TUNING.get("num_warps", 4)
    with device_of(query):
        _partial_kernel[(rows, splits)](
            query, keys, values, bias, new_k, new_v, pos, acc, ml, out,
            kv_heads, length, chunk, splits, float(scaling),
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
            G=groups, D=dim, DV=value_dim, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
            WRITE=write, FINAL=final, PRECISION=precision, DOT_FP32=dot_fp32, num_warps=num_warps,
        )  # fmt: skip
        if not final:
            _combine_kernel[(rows, groups)](
                acc, ml, out, kv_heads, splits, G=groups, DV=value_dim, BLOCK_G=block_g, BLOCK_DV=block_dv,
                BLOCK_S=min(_COMBINE_SPLITS, triton.next_power_of_2(splits)), num_warps=num_warps,
            )  # fmt: skip
    return out
