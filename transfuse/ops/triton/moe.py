"""Triton fused MoE: routing, then the experts by a decode path (few pairs) or a grouped path.

``moe_route(logits) → (weights, ids)`` and ``moe_experts(x, weights, ids, w13, w2) → out``, with
the semantics of ``transfuse.ops.moe``'s native definitions:

1. ``_route_kernel``: per token, scores (softmax / sigmoid / none), correction bias,
   group-limited choice, top-k by repeated arg-max, renormalisation, scale, cast. One
   program holds a few tokens' full score rows.

Decode path (few (token, slot) pairs; weight-bandwidth bound, so launches and bytes count):

2. ``_decode_gate_up_kernel``: programs (block of intermediate features, pair), each reading
   its pair's expert's gate and up rows once over the whole hidden size; the act-and-mul is
   fused.
3. ``_decode_down_kernel``: programs (block of output features, token), each reading the
   down weights of the token's k experts and adding the k weighted projections in float32:
   the combine needs no kernel of its own and is deterministic.

Grouped path (everything else):

2. Alignment: the (token, slot) pairs are grouped by expert, each expert's run padded to
   a multiple of ``BLOCK_M`` rows, so a GEMM block never mixes experts. Counting and
   ranking use one-hot tiles and prefix sums, not atomics, so the order is deterministic.
   Small batches do it in one program (``_align_small_kernel``); large ones in three
   (count per chunk, offsets, scatter).
3. ``_gate_up_kernel``: ``act(x·W_gate) * (x·W_up)`` for each block of pairs of one
   expert, both products accumulated in one pass over the token rows (the act-and-mul is
   fused, the ``[pairs, 2I]`` projection is never written).
4. ``_down_kernel``: ``(h·W_down)`` times the pair's routing weight, rounded to the token
   dtype, written per pair; ``_sum_slots_kernel`` adds each token's k pairs in float32.

Weights are read in place through their strides: ``[E, 2I, H]`` or ``[E, H, 2I]``, halves
or interleaved gate/up, optional biases. The path and its tiles come from
``moe_configs.config_for``, fitted to the device's shared memory (``moe_configs.fit``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..dispatch import batch_invariant_active
from . import device_of, interpreting
from .invariant import dot
from .launch import Kernel
from .moe_configs import (
    DecodeConfig,
    MoEConfig,
    config_for,
    fit,
    invariant_config,
    k_pad,
    shared_memory_limit,
)

__all__ = ["moe_experts", "moe_route"]

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "clamped_swiglu": 4}
_SCORING_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2, "topk_sigmoid": 3}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: on the host that goes through Triton's JIT machinery


# ---- routing ---------------------------------------------------------------------------


@triton.jit
def _limit_groups(choice, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr):
    """-inf outside each token's TOPK_GROUP best groups, a group scored by its two best choices."""
    PER: tl.constexpr = E_PAD // N_GROUP
    grouped = tl.reshape(choice, (BLOCK_T, N_GROUP, PER))
    inner = tl.arange(0, PER)
    first = tl.max(grouped, axis=2)
    first_at = tl.min(tl.where(grouped == first[:, :, None], inner[None, None, :], PER), axis=2)
    second = tl.max(tl.where(inner[None, None, :] == first_at[:, :, None], float("-inf"), grouped), axis=2)
    group_score = first + second
    groups = tl.arange(0, N_GROUP)
    keep = tl.zeros((BLOCK_T, N_GROUP), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_score, axis=1)
        at = tl.min(tl.where(group_score == best[:, None], groups[None, :], N_GROUP), axis=1)
        hit = groups[None, :] == at[:, None]
        keep = tl.where(hit, 1, keep)
        group_score = tl.where(hit, float("-inf"), group_score)
    masked = tl.where(keep[:, :, None] != 0, grouped, float("-inf"))
    return tl.reshape(masked, (BLOCK_T, E_PAD))


@Kernel
@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_tokens, num_experts, stride_logits,
    renorm_eps, renorm_min, scale,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    RENORM: tl.constexpr, HAS_EPS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # padded experts never win; padded tokens stay finite
    if SCORING == 0:
        shifted = tl.exp(x - tl.max(x, axis=1)[:, None])
        shifted = tl.where(col_ok[None, :], shifted, 0.0)
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
    elif SCORING == 1:
        scores = tl.sigmoid(x)
    else:
        scores = x
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(col_ok[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        choice = _limit_groups(choice, BLOCK_T, E_PAD, N_GROUP, TOPK_GROUP)
    slots = tl.arange(0, K_PAD)
    top_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        at = tl.min(tl.where(choice == best[:, None], cols[None, :], E_PAD), axis=1)
        hit = cols[None, :] == at[:, None]
        picked = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        top_w = tl.where(slots[None, :] == j, picked[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, at[:, None], top_i)
        choice = tl.where(hit, float("-inf"), choice)
    in_k = slots[None, :] < TOP_K
    if SCORING == 2:
        shifted = tl.where(in_k, tl.exp(top_w - tl.max(tl.where(in_k, top_w, float("-inf")), axis=1)[:, None]), 0.0)
        top_w = shifted / tl.sum(shifted, axis=1)[:, None]
    elif SCORING == 3:
        top_w = tl.sigmoid(top_w)
    if RENORM:
        total = tl.sum(tl.where(in_k, top_w, 0.0), axis=1)
        if HAS_EPS:
            total = total + renorm_eps
        if HAS_MIN:
            total = tl.maximum(total, renorm_min)
        top_w = top_w / total[:, None]
    if HAS_SCALE:
        top_w = top_w * scale
    offsets = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    mask = row_ok[:, None] & in_k
    tl.store(weights_ptr + offsets, top_w.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + offsets, top_i.to(ids_ptr.dtype.element_ty), mask=mask)


def moe_route(
    logits, correction_bias, top_k, scoring, float32, grouped, n_group, topk_group,
    renormalize, renorm_eps, renorm_min, scale, out_dtype,
):  # fmt: skip
    """Triton provider of ``transfuse.ops.moe.moe_route_native``."""
    tokens, experts = logits.shape
    if out_dtype is None:
        out_dtype = torch.float32 if (float32 and scoring != "sigmoid") else logits.dtype
    weights = torch.empty((tokens, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    e_pad = _next_pow2(experts)
    block_t = max(1, min(16, 2048 // e_pad))
    with device_of(logits):
        _route_kernel[(_cdiv(tokens, block_t),)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids,
            tokens, experts, logits.stride(0),
            float(renorm_eps or 0.0), float(renorm_min or 0.0), float(scale or 1.0),
            TOP_K=top_k, K_PAD=k_pad(top_k), E_PAD=e_pad, BLOCK_T=block_t,
            SCORING=_SCORING_CODES[scoring], HAS_BIAS=correction_bias is not None,
            N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group if grouped else 1,
            RENORM=renormalize, HAS_EPS=renorm_eps is not None, HAS_MIN=renorm_min is not None,
            HAS_SCALE=scale is not None,
        )  # fmt: skip
    return weights, ids


# ---- alignment -------------------------------------------------------------------------


# The int32 workspace: per GEMM block its expert (-1: unused) and the end of its expert's valid
# rows, then each row's pair index (token · k + slot), then (many pairs) per-chunk counts and bases.
#   [block_expert: max_blocks | block_end: max_blocks | rows: max_blocks · BLOCK_M | counts | bases]


@triton.jit
def _write_blocks(totals, meta_ptr, max_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr):  # fmt: skip
    """Each expert's run of rows starts at a multiple of BLOCK_M; block b belongs to the expert
    whose padded run holds row b·BLOCK_M (-1: past the last run) and is valid up to that run's
    last real row. Returns each expert's first row."""
    experts = tl.arange(0, E_PAD)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    valid_end = run_start + totals
    for first in range(0, max_blocks, BLOCKS_CHUNK):
        blocks = first + tl.arange(0, BLOCKS_CHUNK)
        row = blocks * BLOCK_M
        inside = (row[:, None] >= run_start[None, :]) & (row[:, None] < run_end[None, :])
        expert = tl.max(tl.where(inside, experts[None, :], -1), axis=1)
        end = tl.max(tl.where(inside, valid_end[None, :], 0), axis=1)
        tl.store(meta_ptr + blocks, expert, mask=blocks < max_blocks)
        tl.store(meta_ptr + max_blocks + blocks, end, mask=blocks < max_blocks)
    return run_start


@triton.jit
def _onehot(ids_ptr, first, num_pairs, SUB: tl.constexpr, E_PAD: tl.constexpr):
    """The pairs ``first .. first + SUB`` as a one-hot [SUB, E_PAD] int32 tile, and their indices."""
    pairs = first + tl.arange(0, SUB)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    return (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32), pairs


@triton.jit
def _place(ids_ptr, meta_ptr, first, count, num_pairs, base, max_blocks, SUB: tl.constexpr, E_PAD: tl.constexpr):
    """Write the row of each pair in ``first .. first + count``: ``base`` of its expert (the first
    free row of that expert's run, [E_PAD]) plus its rank among the pairs before it."""
    for sub in range(first, first + count, SUB):
        onehot, pairs = _onehot(ids_ptr, sub, num_pairs, SUB, E_PAD)
        rank = tl.sum((tl.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        row = tl.sum(onehot * base[None, :], axis=1) + rank
        tl.store(meta_ptr + 2 * max_blocks + row, pairs, mask=(pairs < num_pairs) & (pairs < first + count))
        base += tl.sum(onehot, axis=0)


@triton.jit
def _count(ids_ptr, first, count, num_pairs, SUB: tl.constexpr, E_PAD: tl.constexpr):
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for sub in range(first, first + count, SUB):
        onehot, pairs = _onehot(ids_ptr, sub, num_pairs, SUB, E_PAD)
        totals += tl.sum(tl.where((pairs < first + count)[:, None], onehot, 0), axis=0)
    return totals


@Kernel
@triton.jit
def _align_small_kernel(ids_ptr, meta_ptr, num_pairs, max_blocks, SUB: tl.constexpr, E_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):  # fmt: skip
    """All pairs in one program: count, place each expert's run, rank each pair in its run."""
    totals = _count(ids_ptr, 0, num_pairs, num_pairs, SUB, E_PAD)
    run_start = _write_blocks(totals, meta_ptr, max_blocks, BLOCK_M, E_PAD, BLOCKS_CHUNK)
    _place(ids_ptr, meta_ptr, 0, num_pairs, num_pairs, run_start, max_blocks, SUB, E_PAD)


@Kernel
@triton.jit
def _count_kernel(ids_ptr, meta_ptr, num_pairs, max_blocks, CHUNK: tl.constexpr, SUB: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Pairs per expert in one chunk of the pairs."""
    chunk = tl.program_id(0)
    counts = _count(ids_ptr, chunk * CHUNK, CHUNK, num_pairs, SUB, E_PAD)
    counts_ptr = meta_ptr + max_blocks * (2 + BLOCK_M)
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), counts)


@Kernel
@triton.jit
def _offsets_kernel(meta_ptr, num_chunks, max_blocks, C_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):  # fmt: skip
    """Each chunk's first row per expert: the expert's run start plus the earlier chunks' counts."""
    chunks = tl.arange(0, C_PAD)
    experts = tl.arange(0, E_PAD)
    where = chunks[:, None] * E_PAD + experts[None, :]
    counts_ptr = meta_ptr + max_blocks * (2 + BLOCK_M)
    counts = tl.load(counts_ptr + where, mask=chunks[:, None] < num_chunks, other=0)
    earlier = tl.cumsum(counts, axis=0) - counts
    totals = tl.sum(counts, axis=0)
    run_start = _write_blocks(totals, meta_ptr, max_blocks, BLOCK_M, E_PAD, BLOCKS_CHUNK)
    bases_ptr = counts_ptr + num_chunks * E_PAD
    tl.store(bases_ptr + where, run_start[None, :] + earlier, mask=chunks[:, None] < num_chunks)


@Kernel
@triton.jit
def _scatter_kernel(ids_ptr, meta_ptr, num_pairs, num_chunks, max_blocks, CHUNK: tl.constexpr, SUB: tl.constexpr,
                    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Each pair's row: its chunk's first row for its expert plus its rank within the chunk."""
    chunk = tl.program_id(0)
    bases_ptr = meta_ptr + max_blocks * (2 + BLOCK_M) + num_chunks * E_PAD
    base = tl.load(bases_ptr + chunk * E_PAD + tl.arange(0, E_PAD))
    _place(ids_ptr, meta_ptr, chunk * CHUNK, CHUNK, num_pairs, base, max_blocks, SUB, E_PAD)


# Pairs that one program groups alone; above, a count / offsets / scatter pass over up to
# _MAX_CHUNKS chunks. One-hot tiles are [SUB, experts] with SUB · experts ≤ _TILE.
_SMALL_PAIRS = 256
_MAX_CHUNKS = 64
_TILE = 8192
_BLOCKS_CHUNK = 64


def _sub(experts: int) -> int:
    return max(16, min(128, _TILE // _next_pow2(experts)))


def _chunking(pairs: int, experts: int) -> tuple[int, int] | None:
    """(chunk size, chunks) for the three-kernel alignment; None when one program does it all."""
    if pairs <= _SMALL_PAIRS:
        return None
    sub = _sub(experts)
    chunk = max(sub, _next_pow2(_cdiv(pairs, _MAX_CHUNKS)))
    return chunk, _cdiv(pairs, chunk)


def _workspace_size(pairs: int, experts: int, block_m: int, max_blocks: int) -> int:
    chunking = _chunking(pairs, experts)
    extra = 2 * chunking[1] * _next_pow2(experts) if chunking else 0
    return max_blocks * (2 + block_m) + extra


def _align(ids: torch.Tensor, experts: int, block_m: int, max_blocks: int, meta: torch.Tensor) -> None:
    """Group the (token, slot) pairs of ``ids`` by expert, in ``meta`` (the workspace above)."""
    pairs = ids.numel()
    e_pad, sub = _next_pow2(experts), _sub(experts)
    chunking = _chunking(pairs, experts)
    if chunking is None:
        # Tiles no larger than the pairs and blocks need, and one warp: the program is a chain of
        # small steps, which more warps only wait on (H100, 128 experts: 2.7 us against 7.3 at 8
        # pairs, 17 against 24 at 256; ``benchmarks/align_sweep.py``). The placement is the same.
        _align_small_kernel[(1,)](
            ids, meta, pairs, max_blocks, SUB=max(16, min(sub, _next_pow2(pairs))), E_PAD=e_pad, BLOCK_M=block_m,
            BLOCKS_CHUNK=max(16, min(_BLOCKS_CHUNK, _next_pow2(max_blocks))), num_warps=1,
        )  # fmt: skip
        return
    chunk, chunks = chunking
    _count_kernel[(chunks,)](ids, meta, pairs, max_blocks, CHUNK=chunk, SUB=sub, E_PAD=e_pad, BLOCK_M=block_m)
    _offsets_kernel[(1,)](
        meta, chunks, max_blocks, C_PAD=_next_pow2(chunks), E_PAD=e_pad, BLOCK_M=block_m, BLOCKS_CHUNK=_BLOCKS_CHUNK
    )
    _scatter_kernel[(chunks,)](ids, meta, pairs, chunks, max_blocks, CHUNK=chunk, SUB=sub, E_PAD=e_pad, BLOCK_M=block_m)


# ---- grouped GEMMs ---------------------------------------------------------------------


@triton.jit
def _activate(gate, up, alpha, limit, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """act(gate) * up from float32 projections, rounding where the models' code rounds."""
    if ACT == 4:  # clamped SwiGLU: (clamp(up, ±limit) + 1) · g·σ(α·g), g = clamp(gate, max=limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = (gate * tl.sigmoid((gate * alpha).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)).to(DTYPE)
        return ((up + 1.0).to(DTYPE).to(tl.float32) * glu.to(tl.float32)).to(DTYPE)
    if ACT == 0:
        act = gate * tl.sigmoid(gate)
    elif ACT == 1:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        act = tl.maximum(gate, 0.0)
    return (act.to(DTYPE).to(tl.float32) * up).to(DTYPE)


@Kernel
@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, meta_ptr, max_blocks,
    hidden, inter, n_blocks, gate_offset, up_offset, alpha, limit,
    stride_xm, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
    TOP_K: tl.constexpr, N_STEP: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    block = pid // n_blocks
    expert = tl.load(meta_ptr + block)
    if expert < 0:
        return
    dtype = out_ptr.dtype.element_ty
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(meta_ptr + max_blocks + block)
    token = (tl.load(meta_ptr + 2 * max_blocks + rows, mask=row_ok, other=0) // TOP_K).to(tl.int64)
    cols = (pid % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_n = cols * N_STEP + gate_offset
    up_n = cols * N_STEP + up_offset
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + gate_n[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    u_ptrs = w_base + up_n[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < hidden - k
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_gate = dot(a, g, acc_gate, IEEE, ROWWISE)
        acc_up = dot(a, u, acc_up, IEEE, ROWWISE)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        gate = gate + tl.load(b_base + gate_n * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up = up + tl.load(b_base + up_n * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
    h = _activate(gate, up, alpha, limit, ACT, dtype)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, h, mask=row_ok[:, None] & col_ok[None, :])


@Kernel
@triton.jit
def _down_kernel(
    h_ptr, w_ptr, b_ptr, weights_ptr, out_ptr, meta_ptr, max_blocks,
    hidden, inter, n_blocks,
    stride_hm, stride_we, stride_wn, stride_wk, stride_be, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    block = pid // n_blocks
    expert = tl.load(meta_ptr + block)
    if expert < 0:
        return
    dtype = out_ptr.dtype.element_ty
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(meta_ptr + max_blocks + block)
    pair = tl.load(meta_ptr + 2 * max_blocks + rows, mask=row_ok, other=0).to(tl.int64)
    cols = (pid % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < inter - k
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot(a, w, acc, IEEE, ROWWISE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    y = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (y + bias[None, :]).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + pair[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, (y * weight[:, None]).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@Kernel
@triton.jit
def _sum_slots_kernel(buf_ptr, out_ptr, hidden, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = Σ_j buf[t·k + j], accumulated in float32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, K_PAD)
    ptrs = buf_ptr + (token * TOP_K + slots[:, None]) * hidden + cols[None, :]
    values = tl.load(ptrs, mask=(slots[:, None] < TOP_K) & (cols[None, :] < hidden), other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, tl.sum(values, axis=0).to(out_ptr.dtype.element_ty), mask=cols < hidden)


# ---- decode path -----------------------------------------------------------------------


@Kernel
@triton.jit
def _decode_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, ids_ptr, out_ptr,
    hidden, inter, gate_offset, up_offset, alpha, limit,
    stride_xm, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    TOP_K: tl.constexpr, N_STEP: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """h[pair, cols] = act(x·W_gate) * (x·W_up) for one (token, slot) pair and BLOCK_N features.
    One row needs no tensor cores: products are accumulated elementwise in float32 over the
    hidden size and summed across the K block once, at the end."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pair = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    col_ok = cols < inter
    gate_n = cols * N_STEP + gate_offset
    up_n = cols * N_STEP + up_offset
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xm + ks
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + gate_n[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk
    u_ptrs = w_base + up_n[:, None].to(tl.int64) * stride_wn + ks[None, :] * stride_wk
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # Triton pipelines loads that feed no tl.dot only in a loop given its own number of stages.
    for k in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(x_ptrs)
            g = tl.load(g_ptrs, mask=col_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = ks < hidden - k
            a = tl.load(x_ptrs, mask=k_ok, other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a = a.to(tl.float32)[None, :]
        acc_gate += g.to(tl.float32) * a
        acc_up += u.to(tl.float32) * a
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    if HAS_BIAS:
        b_base = b_ptr + expert * stride_be
        gate = (gate + tl.load(b_base + gate_n * stride_bn, mask=col_ok, other=0.0).to(tl.float32)).to(dtype)
        up = (up + tl.load(b_base + up_n * stride_bn, mask=col_ok, other=0.0).to(tl.float32)).to(dtype)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
    h = _activate(gate, up, alpha, limit, ACT, dtype)
    tl.store(out_ptr + pair.to(tl.int64) * inter + cols, h, mask=col_ok)


@Kernel
@triton.jit
def _decode_down_kernel(
    h_ptr, w_ptr, b_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter, stride_we, stride_wn, stride_wk, stride_be,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """out[token, cols] = Σ_j w_j · (h_j·W_down[e_j] + b) over the token's k slots, for BLOCK_N
    output features: all k slots in one [K_PAD, BLOCK_N, BLOCK_K] tile, each slot's projection
    rounded as the models round it, the k added in float32 in slot order (deterministic, and no
    combining kernel)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.program_id(1).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < TOP_K
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None] * inter + ks[None, :]
    w_ptrs = (
        w_ptr + experts[:, None, None] * stride_we + cols[None, :, None].to(tl.int64) * stride_wn
        + ks[None, None, :] * stride_wk
    )  # fmt: skip
    w_ok = slot_ok[:, None, None] & col_ok[None, :, None]
    acc = tl.zeros((K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(h_ptrs, mask=slot_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        else:
            k_ok = ks < inter - k
            a = tl.load(h_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=w_ok & k_ok[None, None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[:, None, :]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + experts[:, None] * stride_be + cols[None, :], mask=slot_ok[:, None] & col_ok[None, :],
                       other=0.0)  # fmt: skip
        y = (y + bias.to(tl.float32)).to(dtype).to(tl.float32)
    contribution = y * tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0).to(tl.float32)[:, None]
    if ROUND_PRODUCT:  # weights no wider than the tokens: the models' product is in the tokens' dtype
        contribution = contribution.to(dtype).to(tl.float32)
    out = tl.sum(tl.where(slot_ok[:, None], contribution, 0.0), axis=0)
    tl.store(out_ptr + token * hidden + cols, out.to(dtype), mask=col_ok)


# ---- host ------------------------------------------------------------------------------

# The shared-memory limit under the interpreter, where there is none.
_UNBOUNDED = 1 << 40
# Configurations that Triton still found too large for a device (dtype, top-k): the smaller one that ran.
_SHRUNK: dict[tuple, MoEConfig | DecodeConfig] = {}


def _w13_strides(w13: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output feature, input feature) strides of w13: [E, 2I, H], or [E, H, 2I] transposed."""
    if transposed:
        return w13.stride(0), w13.stride(2), w13.stride(1)
    return w13.stride(0), w13.stride(1), w13.stride(2)


def _w2_strides(w2: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output feature, input feature) strides of w2: [E, H, I], or [E, I, H] transposed."""
    if transposed:
        return w2.stride(0), w2.stride(2), w2.stride(1)
    return w2.stride(0), w2.stride(1), w2.stride(2)


def _gate_up_columns(interleaved: bool, gate_first: bool, inter: int) -> tuple[int, int, int]:
    """(step, gate offset, up offset): intermediate feature i's gate is w13 feature i·step + gate offset."""
    if interleaved:
        return 2, 0 if gate_first else 1, 1 if gate_first else 0
    return 1, 0 if gate_first else inter, inter if gate_first else 0


def _bias_strides(b: torch.Tensor | None) -> tuple[int, int]:
    return (b.stride(0), b.stride(1)) if b is not None else (0, 0)


def _shared_memory(x: torch.Tensor) -> int:
    """The shared memory a program may use on ``x``'s device."""
    if interpreting():
        return _UNBOUNDED
    return shared_memory_limit(x.device.index if x.device.index is not None else torch.cuda.current_device())


def moe_experts(
    x, weights, ids, w13, w2, b13, b2, activation, interleaved, gate_first, w13_transposed, w2_transposed,
    alpha, limit,
):  # fmt: skip
    """Triton provider of ``transfuse.ops.moe.moe_experts_native``: the decode path or the grouped
    path, as ``config_for`` says (in batch-invariant mode, ``INVARIANT_CONFIG`` for every token
    count), with tiles fitted to the device's shared memory. Should Triton still find them too
    large, a smaller configuration is tried (and remembered) instead."""
    tokens, top_k = ids.shape
    wanted = invariant_config() if batch_invariant_active() else config_for(tokens, top_k, w13.shape[0])
    chosen = fit(wanted, x.element_size(), top_k, _shared_memory(x))
    key = (chosen, x.dtype, x.device, top_k)
    config = _SHRUNK.get(key, chosen)
    # The kernels step through the input feature with stride 1, and through ids and weights as [T·k].
    x, b13, b2 = (t.contiguous() if t is not None and t.stride(-1) != 1 else t for t in (x, b13, b2))
    ids, weights = ids.contiguous(), weights.contiguous()
    args = (x, weights, ids, w13, w2, b13, b2, activation, interleaved, gate_first, w13_transposed, w2_transposed,
            float(alpha), float(limit))  # fmt: skip
    while True:
        try:
            with device_of(x):  # Triton launches on the current device
                return (_decode if isinstance(config, DecodeConfig) else _grouped)(*args, config)
        except OutOfResources:  # raised at a launch, before that kernel runs; every buffer is new per call
            smaller = config.smaller()
            if smaller == config:
                raise
            config = _SHRUNK[key] = smaller


def _decode(x, weights, ids, w13, w2, b13, b2, activation, interleaved, gate_first, w13_transposed, w2_transposed,
            alpha, limit, cfg: DecodeConfig):  # fmt: skip
    """Two kernels: gate/up per (pair, block of intermediate features), down per (token, block of
    output features) over the token's k pairs."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = (w13.shape[2] if w13_transposed else w13.shape[1]) // 2
    launch = {"num_warps": cfg.num_warps, "STAGES": cfg.num_stages}
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    n_step, gate_offset, up_offset = _gate_up_columns(interleaved, gate_first, inter)
    _decode_gate_up_kernel[(_cdiv(inter, cfg.gate_up_n), tokens * top_k)](
        x, w13, b13 if b13 is not None else w13, ids, h,
        hidden, inter, gate_offset, up_offset, alpha, limit,
        x.stride(0), *_w13_strides(w13, w13_transposed), *_bias_strides(b13),
        TOP_K=top_k, N_STEP=n_step, ACT=_ACTIVATION_CODES[activation], HAS_BIAS=b13 is not None,
        EVEN_K=hidden % cfg.gate_up_k == 0, BLOCK_N=cfg.gate_up_n, BLOCK_K=cfg.gate_up_k, **launch,
    )  # fmt: skip
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    down_k = cfg.down_block_k(top_k)
    _decode_down_kernel[(_cdiv(hidden, cfg.down_n), tokens)](
        h, w2, b2 if b2 is not None else w2, ids, weights, out,
        hidden, inter, *_w2_strides(w2, w2_transposed), _bias_strides(b2)[0],
        TOP_K=top_k, K_PAD=k_pad(top_k), HAS_BIAS=b2 is not None, EVEN_K=inter % down_k == 0,
        ROUND_PRODUCT=torch.promote_types(x.dtype, weights.dtype) == x.dtype,
        BLOCK_N=cfg.down_n, BLOCK_K=down_k, **launch,
    )  # fmt: skip
    return out


def _grouped(x, weights, ids, w13, w2, b13, b2, activation, interleaved, gate_first, w13_transposed, w2_transposed,
             alpha, limit, cfg: MoEConfig):  # fmt: skip
    """Pairs grouped by expert into blocks of rows, two grouped GEMMs, then each token's k rows added."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    experts = w13.shape[0]
    inter = (w13.shape[2] if w13_transposed else w13.shape[1]) // 2
    pairs = tokens * top_k
    max_blocks = pairs // cfg.block_m + min(pairs, experts) + 1
    meta = torch.empty(_workspace_size(pairs, experts, cfg.block_m, max_blocks), dtype=torch.int32, device=x.device)
    _align(ids, experts, cfg.block_m, max_blocks, meta)
    # float32 stays float32 (no TF32). Interpreted, the products are summed along k in order
    # (``invariant.dot``): numpy's matmul, the interpreter's ``tl.dot``, multiplies bfloat16 wrongly
    # and, on some CPUs, sums a row by its place in the tile.
    ieee = x.dtype == torch.float32
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

    h = torch.empty((max_blocks * cfg.block_m, inter), dtype=x.dtype, device=x.device)
    n_step, gate_offset, up_offset = _gate_up_columns(interleaved, gate_first, inter)
    n_blocks = _cdiv(inter, cfg.block_n)
    _gate_up_kernel[(max_blocks * n_blocks,)](
        x, w13, b13 if b13 is not None else w13, h, meta, max_blocks,
        hidden, inter, n_blocks, gate_offset, up_offset, alpha, limit,
        x.stride(0), *_w13_strides(w13, w13_transposed), *_bias_strides(b13), h.stride(0),
        TOP_K=top_k, N_STEP=n_step, ACT=_ACTIVATION_CODES[activation], HAS_BIAS=b13 is not None,
        EVEN_K=hidden % cfg.block_k == 0, IEEE=ieee, ROWWISE=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch,
    )  # fmt: skip

    per_pair = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    n_blocks = _cdiv(hidden, cfg.block_n)
    _down_kernel[(max_blocks * n_blocks,)](
        h, w2, b2 if b2 is not None else w2, weights, per_pair, meta, max_blocks,
        hidden, inter, n_blocks,
        h.stride(0), *_w2_strides(w2, w2_transposed), _bias_strides(b2)[0], per_pair.stride(0),
        HAS_BIAS=b2 is not None, EVEN_K=inter % cfg.block_k == 0, IEEE=ieee, ROWWISE=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch,
    )  # fmt: skip

    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    block_h = min(1024, _next_pow2(hidden))
    _sum_slots_kernel[(tokens, _cdiv(hidden, block_h))](
        per_pair, out, hidden, TOP_K=top_k, K_PAD=k_pad(top_k), BLOCK_H=block_h
    )
    return out
