"""Triton kernel for cross_entropy_grad: each row's loss, and its logits overwritten by their gradient.

One program per row, two passes over it. The first keeps a running maximum and sum of
exponentials in float32 (the log-sum-exp); the second writes ``scale * (softmax - onehot)`` over
the logits, rounded to their dtype once, which is what the unfused model's gradient of
``scale * CE(logits.float(), targets, reduction="sum")`` is before autograd casts it back to the
logits' dtype. A row whose target is ``ignore_index`` gets a zero loss and zero gradient. The
logits are read twice and written once in their own dtype; the unfused model also writes a
float32 copy, its log-softmax and a float32 gradient, each as large as the logits.

And ``scale_``: the backward's multiplication of those saved gradients by the loss's gradient, in
place, at copy bandwidth (``mul_`` by a one-element GPU tensor is not vectorised), and with no
memory traffic at all where that gradient is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_of
from .launch import Kernel

__all__ = ["cross_entropy_grad", "scale_"]

# Elements per block and warps (a vocabulary row is read in blocks of this many); benchmarks
# override them here as block and num_warps (``benchmarks/train_kernels.py``).
TUNING: dict = {}
# 8192 and 16: 2.7% faster than 4096 and 8 (401 against 412 us) over 2048 rows of Llama 3's
# vocabulary on an H200, and the best of 48 launches (``benchmarks/results/h200_train_kernels_sweep_2026-12-02.md``).
_BLOCK, _WARPS = 8192, 16
# scale_: elements per program and step of its loop, and programs per SM (None: one program a
# block). 32 an SM, looping: Llama 3's 1 GiB head gradient by one in 3.4 us (one program a block:
# 39.6), by 0.5 in 545 us (524); a plain ``loss.backward()`` scales by one
# (``benchmarks/results/h200_train_kernels_2026-12-02.md``).
_SCALE_BLOCK, _SCALE_PROGRAMS_PER_SM = 8192, 32


@Kernel
@triton.jit
def _cross_entropy_grad_kernel(
    logits_ptr, targets_ptr, scale_ptr, losses_ptr, row_stride, V, ignore_index, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    start = logits_ptr + row * row_stride
    dtype = logits_ptr.dtype.element_ty
    target = tl.load(targets_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    for offset in range(0, V, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        x = tl.load(start + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        block_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - block_max) + tl.sum(tl.exp(x - block_max), 0)
        running_max = block_max
    lse = running_max + tl.log(running_sum)
    safe_target = tl.where(ignored, 0, target)
    target_logit = tl.load(start + safe_target).to(tl.float32)
    tl.store(losses_ptr + row, tl.where(ignored, 0.0, lse - target_logit))
    scale = tl.where(ignored, 0.0, tl.load(scale_ptr).to(tl.float32))
    for offset in range(0, V, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) * scale
        grad = tl.where(cols == safe_target, grad - scale, grad)
        tl.store(start + cols, grad.to(dtype), mask=mask)


def cross_entropy_grad(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int) -> Tensor:
    """The triton provider of ``cross_entropy_grad``."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return losses
    block = min(TUNING.get("block", _BLOCK), triton.next_power_of_2(vocab))
    with device_of(logits):
        _cross_entropy_grad_kernel[(rows,)](
            logits, targets, scale, losses, logits.stride(0), vocab, ignore_index,
            BLOCK=block, num_warps=TUNING.get("num_warps", _WARPS),
        )  # fmt: skip
    return losses


@Kernel
@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    # The scale rounded to x's dtype first, then the product in float32 rounded once: what ``mul_``
    # by a tensor of another dtype computes.
    scale = tl.load(scale_ptr).to(dtype).to(tl.float32)
    # A scale of one (a plain ``loss.backward()``) leaves x as it is: no element is read or written,
    # decided on the device, so the host never waits for the scale's value.
    if scale != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < n
            x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
            tl.store(x_ptr + offsets, (x * scale).to(dtype), mask=mask)


def scale_(x: Tensor, scale: Tensor) -> Tensor:
    """The triton provider of ``scale_``: ``x`` (contiguous) times a one-element ``scale``, in place."""
    n = x.numel()
    if n:
        block = TUNING.get("scale_block", _SCALE_BLOCK)
        programs, per_sm = triton.cdiv(n, block), TUNING.get("scale_programs_per_sm", _SCALE_PROGRAMS_PER_SM)
        if per_sm:  # programs that loop over blocks: a scale of one costs one wave
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
            programs = min(programs, per_sm * sms)
        with device_of(x):
            _scale_kernel[(programs,)](x, scale, n, BLOCK=block, num_warps=8)
    return x
