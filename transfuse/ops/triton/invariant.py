"""Triton kernels of batch-invariant mode: a batched GEMM, a grouped GEMM and attention with fixed
reduction orders.

GEMM: one tile shape (``BLOCK_M x BLOCK_N``), one reduction tile ``BLOCK_K``, one warp count and
one chunk length for a given weight shape, whatever the row count: each output element is the sum,
from the first chunk to the last, of its chunks' partial sums, each reduced over the same
``BLOCK_K`` steps by the same instructions, in every batch and at every place in a tile. Whether
the chunks run in one program or in programs of their own (a split-K launch, where the tiles are
too few to fill the device) changes where the partials are added, not how.

Attention: a program takes a block of rows (queries of the heads that share a key/value head) and
walks their keys with tensor-core products in blocks of ``BLOCK_N`` at fixed offsets from the
sequence's first unmasked key (an online softmax). A row's products never depend on the other rows
of its block, and a left-padded sequence's keys fall in the same blocks at the same places as the
sequence alone; masked keys, and blocks past a row's last key, add exact zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_of, interpreting
from .launch import Kernel


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, ROWWISE: tl.constexpr):
    """``acc + a @ b`` in float32. ``ROWWISE`` (interpreted runs): each product formed and summed
    along ``k`` in order, because the interpreter's ``tl.dot`` is numpy's matmul, whose sums change
    with a row's place in the block; a GPU's tensor-core products do not."""
    if ROWWISE:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile(
    a_base, b_base, rm, rn, M, N, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
    IEEE: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The float32 products of rows ``rm`` (those below ``M``) of ``a`` with columns ``rn`` of ``b``,
    summed over ``k_lo <= k < k_hi`` in steps of ``BLOCK_K``, in order, from zero."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_base + rm[:, None] * stride_am + ks[None, :] * stride_ak, mask=(rm[:, None] < M) & (ks[None, :] < k_hi), other=0.0)
        b = tl.load(b_base + ks[:, None] * stride_bk + rn[None, :] * stride_bn, mask=(ks[:, None] < k_hi) & (rn[None, :] < N), other=0.0)
        acc = dot(a, b, acc, IEEE, ROWWISE)
    return acc


@triton.jit
def _chunked_tile(
    a_base, b_base, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    IEEE: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The one reduction of every GEMM of the mode: ``K`` cut in chunks of ``CHUNK``, each chunk's
    partial sum taken by ``_tile``, the partials added to zero from the first chunk to the last.
    ``_partial_kernel`` and ``_sum_partials_kernel`` take the same sum in two launches."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_lo in range(0, K, CHUNK):
        total += _tile(a_base, b_base, rm, rn, M, N, k_lo, tl.minimum(k_lo + CHUNK, K), stride_am, stride_ak,
                       stride_bk, stride_bn, IEEE, ROWWISE, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    return total


@Kernel
@triton.jit
def _bmm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_base = a_ptr + batch.to(tl.int64) * stride_ab
    b_base = b_ptr + batch.to(tl.int64) * stride_bb
    acc = _chunked_tile(a_base, b_base, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, IEEE, ROWWISE,
                        BLOCK_M, BLOCK_N, BLOCK_K, CHUNK)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + batch.to(tl.int64) * stride_cb + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@Kernel
@triton.jit
def _partial_kernel(
    a_ptr, b_ptr, part_ptr, M, N, K, CHUNKS,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    IEEE: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # Program (row tile, column tile, batch x chunk): one chunk's partial sum, as ``_chunked_tile``
    # takes it, into ``part`` [batch, chunks, M, N] (float32).
    pid_m, pid_n, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch, chunk = pid // CHUNKS, pid % CHUNKS
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = chunk * CHUNK
    acc = _tile(a_ptr + batch.to(tl.int64) * stride_ab, b_ptr + batch.to(tl.int64) * stride_bb, rm, rn, M, N, k_lo,
                tl.minimum(k_lo + CHUNK, K), stride_am, stride_ak, stride_bk, stride_bn, IEEE, ROWWISE, BLOCK_M, BLOCK_N,
                BLOCK_K)  # fmt: skip
    part = part_ptr + pid.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(part, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@Kernel
@triton.jit
def _sum_partials_kernel(
    part_ptr, bias_ptr, c_ptr, M, N, CHUNKS, stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # The partials of ``_partial_kernel`` added to zero from the first chunk to the last, then the
    # bias: the additions ``_chunked_tile`` makes, in its order.
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    batch = tl.program_id(1).to(tl.int64)
    inside = idx < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(0, CHUNKS):
        total += tl.load(part_ptr + (batch * CHUNKS + chunk) * M * N + idx, mask=inside, other=0.0)
    rn = idx % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + rn, mask=inside, other=0.0).to(tl.float32)
    c = c_ptr + batch * stride_cb + (idx // N) * stride_cm + rn * stride_cn
    tl.store(c, total.to(c_ptr.dtype.element_ty), mask=inside)


@Kernel
@triton.jit
def _grouped_kernel(
    a_ptr, b_ptr, ends_ptr, c_ptr, N, K, TILES_M,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    IEEE: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    # Program (group e, tile t of its rows): the group's bounds are read here, on the device, so the
    # launch depends on the shapes alone; a tile past the group's rows does nothing.
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    group = pid // TILES_M
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + group).to(tl.int64)
    rm = start + (pid % TILES_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if start + (pid % TILES_M) * BLOCK_M < end:
        acc = _chunked_tile(a_ptr, b_ptr + group.to(tl.int64) * stride_be, rm, rn, end, N, K, stride_am, stride_ak,
                            stride_bk, stride_bn, IEEE, ROWWISE, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK)  # fmt: skip
        c = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < end) & (rn[None, :] < N))


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How the mode's GEMM of one weight shape runs. The sum an output takes depends on ``block_k``
    (a tensor-core product's step along the reduction, summed into the output's accumulator in
    order) and on ``chunk`` (the partial sums added in order); ``block_m``, ``block_n``, ``warps``
    and ``stages`` say how many outputs a program takes and how it loads them."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    chunk: int


# Rows from which a 2-byte GEMM takes tall tiles (128 x 256, 8 warps) and the attention programs of
# 128 rows: a prefill's row counts, where the decode tiles run far below cuBLAS and FlashAttention.
TALL_ROWS = 1024


def gemm_tiles(n: int, k: int, rows: int = 1, element_size: int = 2) -> Tiles:
    """The tiles of a ``[k, n]`` weight for ``rows`` rows of ``element_size`` bytes. ``block_k`` and
    the chunk, which fix how each output is summed, come from the weight's shape alone; the block
    of outputs a program takes grows with the row count."""
    if interpreting():
        return Tiles(32, 16, 16, 1, 1, 32) if rows >= 64 else Tiles(16, 16, 16, 1, 1, 32)
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    if rows >= TALL_ROWS and n >= 256 and element_size <= 2:
        return Tiles(128, 256, block_k, 8, 3, 16 * block_k)
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    return Tiles(64, block_n, block_k, 4, 3, 16 * block_k)


def _tile_options(t: Tiles, dtype: torch.dtype) -> dict:
    """The launch options every GEMM kernel of the mode takes for tiles ``t``."""
    return dict(
        IEEE=dtype == torch.float32, ROWWISE=interpreting(), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        CHUNK=t.chunk, num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip


@functools.cache
def _processors(device: torch.device) -> int:
    """Programs one launch should cover for the device to be busy: its multiprocessors."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def bmm(a: Tensor, b: Tensor, bias: Tensor | None, out_dtype: torch.dtype, split: bool | None = None) -> Tensor:
    """``a @ b (+ bias)`` for ``a [batch, M, K]``, ``b [batch, K, N]`` (any strides).

    Two launches give the same bits: one program a tile taking every chunk's partial sum
    (``_bmm_kernel``), or, where the tiles are too few to fill the device (a few rows, at decode),
    one program a tile and chunk, the partials added after (``_partial_kernel``,
    ``_sum_partials_kernel``). ``split`` forces one of them."""
    batch, m, k = a.shape
    n = b.shape[-1]
    out = a.new_empty((batch, m, n), dtype=out_dtype)
    if out.numel() == 0:
        return out
    t = gemm_tiles(n, k, m, a.element_size())
    chunks = triton.cdiv(k, t.chunk)
    tiles = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    if split is None:
        split = chunks > 1 and tiles[0] * tiles[1] * batch < _processors(a.device)
    with device_of(a):
        if not split:
            _bmm_kernel[(*tiles, batch)](
                a, b, bias if bias is not None else a, out, m, n, k,
                a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
                out.stride(0), out.stride(1), out.stride(2),
                HAS_BIAS=bias is not None, **_tile_options(t, a.dtype),
            )  # fmt: skip
            return out
        parts = torch.empty((batch, chunks, m, n), dtype=torch.float32, device=a.device)
        _partial_kernel[(*tiles, batch * chunks)](
            a, b, parts, m, n, k, chunks, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
            **_tile_options(t, a.dtype),
        )  # fmt: skip
        block = 16 if interpreting() else 1024
        _sum_partials_kernel[(triton.cdiv(m * n, block), batch)](
            parts, bias if bias is not None else a, out, m, n, chunks, out.stride(0), out.stride(1), out.stride(2),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=1 if interpreting() else 4,
        )  # fmt: skip
    return out


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The triton provider of ``invariant_linear``."""
    rows = x.reshape(-1, x.shape[-1])
    out = bmm(rows[None], weight.t()[None], bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def invariant_bmm(a: Tensor, b: Tensor) -> Tensor:
    """The triton provider of ``invariant_bmm``."""
    return bmm(a, b, None, a.dtype)


def invariant_grouped_mm(rows: Tensor, matrices: Tensor, ends: Tensor) -> Tensor:
    """The triton provider of ``invariant_grouped_mm``: each group's rows times its matrix with the
    tiles and chunks of ``bmm`` for that matrix shape. Nothing is read on the host (a CUDA graph can
    hold it): the launch covers every group as if it held all the rows, and each program reads its
    group's bounds from ``ends``. Rows past the last end are zeros."""
    total, k = rows.shape
    groups, _, n = matrices.shape
    out = rows.new_zeros((total, n))
    if total == 0 or n == 0:
        return out
    t = gemm_tiles(n, k)
    tiles_m = triton.cdiv(total, t.block_m)
    with device_of(rows):
        _grouped_kernel[(groups * tiles_m, triton.cdiv(n, t.block_n))](
            rows, matrices, ends, out, n, k, tiles_m,
            rows.stride(0), rows.stride(1), matrices.stride(0), matrices.stride(1), matrices.stride(2),
            out.stride(0), out.stride(1),
            **_tile_options(t, rows.dtype),
        )  # fmt: skip
    return out


@triton.jit
def _additive(mask_ptr, offsets, valid, other, BOOL: tl.constexpr):
    # The mask's additive float32 values at ``offsets`` (``other`` where not ``valid``): a boolean
    # mask (True: kept), read a byte an element, as 0 and -inf.
    if BOOL:
        kept = tl.load(mask_ptr + offsets, mask=valid, other=0) != 0
        return tl.where(valid, tl.where(kept, 0.0, float("-inf")), other)
    else:
        return tl.load(mask_ptr + offsets, mask=valid, other=other).to(tl.float32)


@triton.jit
def _kept(mask_ptr, rows, live, j, L, sml, BOOL: tl.constexpr):
    # Which keys ``j`` of the mask rows ``rows`` (offsets) are kept for a live row: a mask value
    # above half float32's lowest (transformers' masks hold the lowest value or -inf).
    inside = (j >= 0) & (j < L)
    valid = live[:, None] & inside[None, :]
    values = _additive(mask_ptr, rows[:, None] + j[None, :] * sml, valid, float("-inf"), BOOL)
    return (values > -1.7e38) & valid


@triton.jit
def _first_kept(mask_ptr, rows, live, L, sml, BLOCK_N: tl.constexpr, BOOL: tl.constexpr):
    # The first key kept for any live row (L if none), scanning blocks from the start and stopping
    # at the first block holding one.
    found = L
    j0 = 0
    while (found == L) & (j0 < L):
        j = j0 + tl.arange(0, BLOCK_N)
        found = tl.min(tl.min(tl.where(_kept(mask_ptr, rows, live, j, L, sml, BOOL), j[None, :], L), axis=1), axis=0)
        j0 += BLOCK_N
    return found


@triton.jit
def _last_kept(mask_ptr, rows, live, L, sml, BLOCK_N: tl.constexpr, BOOL: tl.constexpr):
    # The last key kept for any live row (-1 if none), scanning blocks from the end.
    found = -1
    j0 = L - BLOCK_N
    while (found == -1) & (j0 + BLOCK_N > 0):
        j = j0 + tl.arange(0, BLOCK_N)
        found = tl.max(tl.max(tl.where(_kept(mask_ptr, rows, live, j, L, sml, BOOL), j[None, :], -1), axis=1), axis=0)
        j0 -= BLOCK_N
    return found


@triton.jit
def _kept_span(mask_ptr, row, L, sml, SCAN: tl.constexpr, BOOL: tl.constexpr):
    # The first and the last key kept in one mask row (L and -1 if none), in one pass of wide
    # blocks whose loads do not wait on each other (a decode step's one row over a whole buffer).
    first = L
    last = -1
    for j0 in range(0, L, SCAN):
        j = j0 + tl.arange(0, SCAN)
        kept = (_additive(mask_ptr, row + j * sml, j < L, float("-inf"), BOOL) > -1.7e38) & (j < L)
        first = tl.minimum(first, tl.min(tl.where(kept, j, L), axis=0))
        last = tl.maximum(last, tl.max(tl.where(kept, j, -1), axis=0))
    return first, last


@Kernel
@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, nk_ptr, nv_ptr, pos_ptr, H, KVH, Q, L, scale,
    sqb, sqh, sqq, skb, skh, skl, svb, svh, svl, smb, smh, smq, sml, sob, soh, soq, snkb, snkh, snvb, snvh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, ONE_ROW: tl.constexpr, CAUSAL: tl.constexpr,
    WRITE: tl.constexpr, IEEE: tl.constexpr, ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SCAN: tl.constexpr,
):  # fmt: skip
    # Program (block of rows, batch x key/value head). Row r is query r // GROUP of query head
    # r % GROUP of the key/value head's group: the heads that share keys share the program.
    pid = tl.program_id(1).to(tl.int64)
    b, kvh = pid // KVH, pid % KVH
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = r // GROUP
    hq = kvh * GROUP + r % GROUP
    live = qi < Q
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + hq[:, None] * sqh + qi[:, None] * sqq + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0)
    if WRITE:
        # A decode step's new key and value: stored at the position, and taken from registers
        # where the walk reads that position (the same bits a load after the store gives).
        pos = tl.load(pos_ptr)
        new_k = tl.load(nk_ptr + b * snkb + kvh * snkh + d, mask=d < D, other=0.0).to(k_ptr.dtype.element_ty)
        new_v = tl.load(nv_ptr + b * snvb + kvh * snvh + dv, mask=dv < DV, other=0.0).to(v_ptr.dtype.element_ty)
        if (tl.program_id(0) == 0) & (pos >= 0) & (pos < L):
            tl.store(k_ptr + b * skb + kvh * skh + pos * skl + d, new_k, mask=d < D)
            tl.store(v_ptr + b * svb + kvh * svh + pos * svl + dv, new_v, mask=dv < DV)
    row_end = tl.where(live, L, 0)
    if CAUSAL:
        row_end = tl.where(live, tl.minimum(L, qi + 1 + L - Q), 0)
    end = tl.max(row_end, axis=0)
    # The sequence's origin: the first unmasked key of its last query. Keys are walked in blocks of
    # BLOCK_N at fixed offsets from it, from the first key any of the block's rows keeps (earlier
    # keys are masked for every row) to the last, so a key falls at the same place of the same
    # block whatever padding is before the sequence and whatever rows share the program. Keys
    # outside that span are read as zeros: a block masked for every row changes no sum.
    origin = 0
    first = 0
    if HAS_MASK:
        rows = b * smb + kvh * smh + qi * smq
        if ONE_ROW:
            # Every row reads the same mask row (one query: a decode step): its span in one pass.
            first, last = _kept_span(mask_ptr, b * smb + kvh * smh, L, sml, SCAN, MASK_BOOL)
            origin = first % L
            end = tl.minimum(end, last + 1)
        else:
            last_query = b * smb + kvh * smh + (Q - 1) * smq + tl.zeros((1,), tl.int64)
            origin = _first_kept(mask_ptr, last_query, tl.zeros((1,), tl.int32) == 0, L, sml, BLOCK_N, MASK_BOOL) % L
            first = _first_kept(mask_ptr, rows, live, L, sml, BLOCK_N, MASK_BOOL)
            end = tl.minimum(end, _last_kept(mask_ptr, rows, live, L, sml, BLOCK_N, MASK_BOOL) + 1)
        first = tl.where(end > first, first, origin)  # no key kept for any row: nothing to walk
        end = tl.where(end > first, end, origin)
    walk = origin - tl.cdiv(tl.maximum(origin - first, 0), BLOCK_N) * BLOCK_N
    m = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for j0 in range(walk, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        inside = (j >= first) & (j < end)
        keys = tl.load(k_ptr + b * skb + kvh * skh + j[None, :] * skl + d[:, None], mask=inside[None, :] & (d[:, None] < D), other=0.0)
        if WRITE:
            keys = tl.where((j == pos)[None, :] & inside[None, :], new_k[:, None], keys)
        scores = dot(q, keys, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, ROWWISE) * scale
        if HAS_MASK:
            if ONE_ROW:  # one row of the mask for all rows, read once
                at = (b * smb + kvh * smh + j * sml)[None, :]
                valid = inside[None, :]
            else:
                at = b * smb + kvh * smh + qi[:, None] * smq + j[None, :] * sml
                valid = live[:, None] & inside[None, :]
            if MASK_BOOL:  # a key dropped is -inf, as the additive mask's -inf makes it
                scores = tl.where(tl.load(mask_ptr + at, mask=valid, other=1) != 0, scores, float("-inf"))
            else:
                scores += tl.load(mask_ptr + at, mask=valid, other=0.0).to(tl.float32)
        scores = tl.where(inside[None, :] & (j[None, :] < row_end[:, None]), scores, float("-inf"))
        top = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - top)
        p = tl.exp(scores - top[:, None])
        values = tl.load(v_ptr + b * svb + kvh * svh + j[:, None] * svl + dv[None, :], mask=inside[:, None] & (dv[None, :] < DV), other=0.0)
        if WRITE:
            values = tl.where((j == pos)[:, None] & inside[:, None], new_v[None, :], values)
        weights = p.to(values.dtype)
        # The row's total as a product too: ``tl.sum`` would add a row's weights in an order set by
        # the layout the compiler gives ``p``, which differs between this kernel's variants (with
        # or without a mask, a write, a group), so a decode step through a store and the same row
        # through ``scaled_dot_product_attention`` would differ in the last bit now and then.
        # Every column of ``weights @ ones`` is the row's sum in the tensor cores' order, and the
        # largest of equal values is that value. It sums the weights the values are weighted with.
        sums = dot(weights, tl.full((BLOCK_N, 16), 1.0, values.dtype), tl.zeros((BLOCK_M, 16), tl.float32), IEEE, ROWWISE)
        total = total * alpha + tl.max(sums, axis=1)
        acc = dot(weights, values, acc * alpha[:, None], IEEE, ROWWISE)
        m = top
    out = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b * sob + hq[:, None] * soh + qi[:, None] * soq + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (dv[None, :] < DV))  # fmt: skip


def attention_tiles(rows: int, block_d: int, element_size: int = 2) -> tuple[int, int, int]:
    """(rows a program, keys a block, warps) of the mode's attention over ``rows`` query rows of a
    key/value head. The keys a block holds come from the head size alone: they fix how a row's
    sums are cut. The rows a program takes grow with the row count (a long prompt's); they do not
    change a row's sums."""
    if interpreting():
        return (32 if rows >= 64 else 16), 16, 1
    block_n = 64 if block_d <= 128 else 32
    if rows >= TALL_ROWS and block_d <= 128 and element_size <= 2:
        return 128, block_n, 8
    return 64, block_n, 4


def invariant_attention(query, key, value, attn_mask=None, is_causal=False, scale=None) -> Tensor:
    """The triton provider of ``invariant_attention`` (``[batch, heads, length, dim]``)."""
    batch, heads, q_len, _ = query.shape
    out = query.new_empty((batch, heads, q_len, value.shape[-1]))
    mask = None
    if attn_mask is not None:
        # A boolean mask is read as it is (a byte a key), an additive one in float32.
        kept = attn_mask.view(torch.uint8) if attn_mask.dtype == torch.bool else attn_mask.float()
        mask = kept.expand(batch, heads, q_len, key.shape[2])
    return attend(query, key, value, mask, bool(is_causal), scale, out)


def attend(query, key, value, mask, is_causal, scale, out, new=None) -> Tensor:
    """Each query ``[batch, heads, q, dim]`` over its key/value head (``heads // kv_heads`` query
    heads a key/value head) with the ``mask`` ``[batch, heads or kv_heads, q, length]`` (float32,
    added to the scores; uint8, a boolean mask's bytes, True kept; or None), into ``out``
    (``[batch, heads, q, dv]`` by its strides). ``new``: a decode step's
    key and value ``[batch, kv_heads, 1, dim]`` and their position (one element), written into
    ``key`` and ``value`` there first."""
    import math

    batch, heads, q_len, dim = query.shape
    kv_heads, length, dim_v = key.shape[1], key.shape[2], value.shape[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if out.numel() == 0:
        return out
    group = heads // kv_heads
    strides_m = (0, 0, 0, 0) if mask is None else tuple(0 if n == 1 else st for n, st in zip(mask.shape, mask.stride()))
    if mask is not None and mask.shape[1] == heads and group > 1:
        raise ValueError("a mask per query head with grouped key/value heads")
    new_k, new_v, position = new if new is not None else (query, query, query)
    block_d, block_dv = max(16, triton.next_power_of_2(dim)), max(16, triton.next_power_of_2(dim_v))
    block_m, block_n, warps = attention_tiles(q_len * group, max(block_d, block_dv), query.element_size())
    with device_of(query):
        _attention_kernel[(triton.cdiv(q_len * group, block_m), batch * kv_heads)](
            query, key, value, mask if mask is not None else query, out, new_k, new_v, position,
            heads, kv_heads, q_len, length, scale,
            *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *strides_m, *out.stride()[:3],
            *new_k.stride()[:2], *new_v.stride()[:2],
            D=dim, DV=dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, HAS_MASK=mask is not None,
            MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
            ONE_ROW=mask is not None and (q_len == 1 or strides_m[2] == 0), CAUSAL=is_causal, WRITE=new is not None,
            IEEE=query.dtype == torch.float32, ROWWISE=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group,
            SCAN=32 if interpreting() else 1024, num_warps=warps,
        )  # fmt: skip
    return out


def decode_attention(query, keys, values, bias, scaling, key=None, value=None, position=None) -> Tensor:
    """``decode_attention`` in batch-invariant mode (its triton provider calls this there): the
    token written (by the kernel), then the queries of each key/value head walked over their kept
    keys from the first (``attend``), whatever the batch and the buffer's length."""
    batch, heads = query.shape[:2]
    kv_heads, length = keys.shape[1], keys.shape[2]
    out = query.new_empty((batch, 1, heads, values.shape[-1]))
    if out.numel() == 0:
        if key is not None:
            keys.index_copy_(2, position, key.to(keys.dtype))
            values.index_copy_(2, position, value.to(values.dtype))
        return out
    mask = bias.view(batch, kv_heads, 1, length)
    new = (key, value, position) if key is not None else None
    # ``out`` [batch, 1, heads, dv] written as [batch, heads, 1, dv] through its strides.
    attend(query, keys, values, mask, False, scaling, out.transpose(1, 2), new)
    return out
