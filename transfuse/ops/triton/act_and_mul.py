"""Triton kernels for silu_and_mul and gelu_and_mul: ``act(x[..., :d]) * x[..., d:]``.

Each program reads one block of the gate half and the matching block of the up half of one
row and writes one block of the output. Like ``F.silu(gate) * up`` in a half dtype, the
activation is computed in float32 and rounded to the input dtype before the multiply.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from . import device_of
from .launch import Kernel

__all__ = ["gelu_and_mul", "silu_and_mul"]

SILU, GELU, GELU_TANH = 0, 1, 2
_GELU_APPROXIMATIONS = {"none": GELU, "tanh": GELU_TANH}

# Elements per program along the row, and per thread one 16-byte vector (8 half-type elements).
# Measured on an H200 (``benchmarks/results/h200_sweep_triton_ops.md``, bf16, 4096 wide): blocks
# of 1024 are fastest up to a few waves of programs, blocks of 4096 (16 warps) beyond, where
# they move 2-4% more bytes per second (185.4 against 192.4 us at 32768 rows).
_BLOCK = 1024
_LARGE_BLOCK = 4096
_LATENCY_BOUND_ROWS = 1024
# A few rows: blocks of 512 (twice the programs in flight), 4 warps; fastest at one row in three
# sweeps (1.20-1.23 us against 1.22-1.23 for blocks of 1024; torch.compile 1.18-1.19).
_TINY_ROWS = 4
_TINY_BLOCK = 512
_TINY_WARPS = 4
# Benchmarks and tests override the launch here: block, num_warps, masked (predicate even exact
# tiles), index_64 (64-bit offsets at any size); ``benchmarks/sweep_triton_ops.py``.
TUNING: dict = {}


@Kernel
@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, d, x_row_stride,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, INDEX_64: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if INDEX_64:  # offsets past 2**31 elements; below that, 32-bit address arithmetic is shorter
        row = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else cols < d  # blocks that tile the row exactly need no predicate
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + d + cols, mask=mask).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        # 0.5 * g * (1 + tanh(y)) == g * sigmoid(2y): exact algebra, and no tanh is needed.
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * y))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (act * up).to(dtype), mask=mask)


def _act_and_mul(x: Tensor, activation: int) -> Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # a view whenever the leading dimensions collapse
    out = x.new_empty((*x.shape[:-1], d))
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out
    tiny = n_rows <= _TINY_ROWS
    block = _TINY_BLOCK if tiny else _BLOCK if n_rows <= _LATENCY_BOUND_ROWS else _LARGE_BLOCK
    block = min(TUNING.get("block", block), triton.next_power_of_2(d))
    # One 16-byte vector a thread; a few rows take _TINY_WARPS (no more warps than 32-element slices).
    num_warps = min(_TINY_WARPS, max(1, block // 32)) if tiny else max(1, min(16, block * x.element_size() // 16 // 32))
    num_warps = TUNING.get("num_warps", num_warps)
    even = d % block == 0 and not TUNING.get("masked", False)
    last = (n_rows - 1) * max(x2.stride(0), 2 * d) + 2 * d  # one past the largest offset either side
    index_64 = TUNING.get("index_64", last >= 2**31)
    with device_of(x):
        _act_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
            x2, out, d, x2.stride(0),
            ACTIVATION=activation, BLOCK=block, EVEN=even, INDEX_64=index_64, num_warps=num_warps,
        )  # fmt: skip
    return out


def silu_and_mul(x: Tensor) -> Tensor:
    """The triton provider of ``silu_and_mul``."""
    return _act_and_mul(x, SILU)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """The triton provider of ``gelu_and_mul`` (``approximate`` as ``F.gelu``'s)."""
    return _act_and_mul(x, _GELU_APPROXIMATIONS[approximate])
