"""Triton experts over block-FP8 weights (``transfuse.ops.moe.moe_experts_fp8``), forward only.

Two kernels, both reading the e4m3 weights in place and each weight's block scale beside it:

1. ``_fp8_gate_up_kernel``: programs (block of intermediate features, (token, slot) pair), each
   reading its pair's expert's gate and up rows once over the whole hidden size. Each weight is
   dequantised in the tile as the native definition dequantises it: the e4m3 value times its
   block's scale cast to the tokens' dtype, rounded to that dtype (computed in float32, where the
   product of two such values is exact, then rounded once: the same bits as a product in the
   tokens' dtype, and Triton's interpreter multiplies bfloat16 wrongly). The products with the
   tokens are accumulated in float32, rounded to the tokens' dtype, then the activation as the
   models round it.
2. ``_fp8_down_kernel``: programs (block of output features, token), each reading the down
   weights of the token's k experts: each slot's projection rounded to the tokens' dtype, times
   its routing weight cast to that dtype (rounded again), the k added in float32 in slot order.

This is the decode path's form (weight-bandwidth bound: a pair's weights are read once per
pair), for any number of tokens; the weights are half the bytes of bfloat16 ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import device_of
from .launch import Kernel
from .moe import _ACTIVATION_CODES, _activate, _cdiv, _gate_up_columns

__all__ = ["moe_experts_fp8"]

_BLOCK_N = 32
_BLOCK_K = 64


@Kernel
@triton.jit
def _fp8_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, out_ptr,
    hidden, inter, gate_offset, up_offset, alpha, limit,
    stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, N_STEP: tl.constexpr, ACT: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pair = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    col_ok = cols < inter
    gate_n = cols * N_STEP + gate_offset
    up_n = cols * N_STEP + up_offset
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        kk = k + ks
        k_ok = kk < hidden
        ok = col_ok[:, None] & k_ok[None, :]
        a = tl.load(x_ptr + token * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(w_base + gate_n[:, None].to(tl.int64) * stride_wn + kk[None, :] * stride_wk, mask=ok, other=0.0)
        u = tl.load(w_base + up_n[:, None].to(tl.int64) * stride_wn + kk[None, :] * stride_wk, mask=ok, other=0.0)
        s_k = (kk // SCALE_K)[None, :] * stride_sk
        gs = tl.load(s_base + (gate_n // SCALE_N)[:, None] * stride_sn + s_k, mask=ok, other=0.0)
        us = tl.load(s_base + (up_n // SCALE_N)[:, None] * stride_sn + s_k, mask=ok, other=0.0)
        g = (g.to(tl.float32) * gs.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        u = (u.to(tl.float32) * us.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        acc_gate += g * a
        acc_up += u * a
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    h = _activate(gate, up, alpha, limit, ACT, dtype)
    tl.store(out_ptr + pair.to(tl.int64) * inter + cols, h, mask=col_ok)


@Kernel
@triton.jit
def _fp8_down_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, inter, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.program_id(1).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < TOP_K
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        kk = k + ks
        k_ok = kk < inter
        ok = slot_ok[:, None, None] & col_ok[None, :, None] & k_ok[None, None, :]
        a = tl.load(h_ptr + pairs[:, None] * inter + kk[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            w_ptr + experts[:, None, None] * stride_we + cols[None, :, None].to(tl.int64) * stride_wn
            + kk[None, None, :] * stride_wk, mask=ok, other=0.0,
        )  # fmt: skip
        s = tl.load(
            s_ptr + experts[:, None, None] * stride_se + (cols // SCALE_N)[None, :, None] * stride_sn
            + (kk // SCALE_K)[None, None, :] * stride_sk, mask=ok, other=0.0,
        )  # fmt: skip
        acc += (w.to(tl.float32) * s.to(dtype).to(tl.float32)).to(dtype).to(tl.float32) * a.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0).to(dtype).to(tl.float32)
    contribution = (y * weight[:, None]).to(dtype).to(tl.float32)
    out = tl.sum(tl.where(slot_ok[:, None], contribution, 0.0), axis=0)
    tl.store(out_ptr + token * hidden + cols, out.to(dtype), mask=col_ok)


def moe_experts_fp8(
    x, weights, ids, w13, w13_scale_inv, w2, w2_scale_inv, block_n, block_k, activation, interleaved, gate_first,
    alpha, limit,
):  # fmt: skip
    """Triton provider of ``transfuse.ops.moe.moe_experts_fp8_native``."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w13.shape[1] // 2
    x = x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    n_step, gate_offset, up_offset = _gate_up_columns(interleaved, gate_first, inter)
    k_pad = triton.next_power_of_2(top_k)
    with device_of(x):
        _fp8_gate_up_kernel[(_cdiv(inter, _BLOCK_N), tokens * top_k)](
            x, w13, w13_scale_inv, ids, h,
            hidden, inter, gate_offset, up_offset, float(alpha), float(limit),
            x.stride(0), *w13.stride(), *w13_scale_inv.stride(),
            TOP_K=top_k, N_STEP=n_step, ACT=_ACTIVATION_CODES[activation], SCALE_N=block_n, SCALE_K=block_k,
            BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        )  # fmt: skip
        _fp8_down_kernel[(_cdiv(hidden, _BLOCK_N), tokens)](
            h, w2, w2_scale_inv, ids, weights, out,
            hidden, inter, *w2.stride(), *w2_scale_inv.stride(),
            TOP_K=top_k, K_PAD=k_pad, SCALE_N=block_n, SCALE_K=block_k, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        )  # fmt: skip
    return out
