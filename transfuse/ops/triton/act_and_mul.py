"""Triton kernels for silu_and_mul and gelu_and_mul: ``act(x[..., :d]) * x[..., d:]``.

Each program reads one block of the gate half and the matching block of the up half of one
row and writes one block of the output. Like ``F.silu(gate) * up`` in a half dtype, the
activation is computed in float32 and rounded to the input dtype before the multiply.

The half width ``D`` is a compile-time constant, and so is the row stride when rows are
contiguous (``2 * D``): at a few rows a call is bound by latency, and with the index arithmetic
folded into the code the first load issues a few dependent instructions sooner. On an H200
(``benchmarks/results/h200_act_variants.md``, alternating replays against ``torch.compile``) that
took one row from 1.022x compile's time to 0.982x, and 16 rows from 1.012x to 0.983x. A model has
one or two widths, each compiled once.
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

# Launch shapes, measured on an H200 (bf16, 4096 wide; ``benchmarks/results/h200_sweep_act_paired.md``
# and, for the many-row blocks, ``h200_sweep_triton_ops.md``):
# - up to _TINY_ROWS rows: blocks of 256 elements, 4 warps (two elements a thread; fastest at one
#   row, 1.19 us against 1.20 for blocks of 512);
# - up to _LATENCY_BOUND_ROWS rows: blocks of 1024, 8 bytes a thread (8 warps in bf16; 1.29 against
#   1.31 us for 4 warps at 16 rows, 3.14 against 3.21 at 256);
# - beyond, where bandwidth rules: blocks of 4096, one 16-byte vector a thread (16 warps), which
#   move 2-4% more bytes per second (185.4 against 192.4 us at 32768 rows).
_TINY_ROWS, _TINY_BLOCK, _TINY_WARPS = 4, 256, 4
_LATENCY_BOUND_ROWS, _BLOCK, _BLOCK_THREAD_BYTES = 1024, 1024, 8
_LARGE_BLOCK, _LARGE_THREAD_BYTES = 4096, 16
# Benchmarks and tests override the launch here: block, num_warps, masked (predicate even exact
# tiles), index_64 (64-bit offsets at any size); ``benchmarks/sweep_triton_ops.py``.
TUNING: dict = {}


@Kernel
@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, x_row_stride,
    D: tl.constexpr, CONTIGUOUS: tl.constexpr,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr, INDEX_64: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if INDEX_64:  # offsets past 2**31 elements; below that, 32-bit address arithmetic is shorter
        row = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else cols < D  # blocks that tile the row exactly need no predicate
    dtype = x_ptr.dtype.element_ty
    if CONTIGUOUS:  # the stride is 2 * D: a constant, like the rest of the index arithmetic
        start = x_ptr + row * (2 * D)
    else:
        start = x_ptr + row * x_row_stride
    gate = tl.load(start + cols, mask=mask).to(tl.float32)
    up = tl.load(start + D + cols, mask=mask).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        # 0.5 * g * (1 + tanh(y)) == g * sigmoid(2y): exact algebra, and no tanh is needed.
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * y))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (act * up).to(dtype), mask=mask)


def _launch_shape(n_rows: int, d: int, element_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the block clipped to the row, and warps for the clipped block (never
    more threads than elements)."""
    if n_rows <= _TINY_ROWS:
        block = min(TUNING.get("block", _TINY_BLOCK), triton.next_power_of_2(d))
        warps = min(_TINY_WARPS, max(1, block // 32))
    else:
        large = n_rows > _LATENCY_BOUND_ROWS
        block = min(TUNING.get("block", _LARGE_BLOCK if large else _BLOCK), triton.next_power_of_2(d))
        thread_bytes = _LARGE_THREAD_BYTES if large else _BLOCK_THREAD_BYTES
        warps = max(1, min(16, block * element_size // thread_bytes // 32))
    return block, TUNING.get("num_warps", warps)


def _act_and_mul(x: Tensor, activation: int) -> Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # a view whenever the leading dimensions collapse
    out = x.new_empty((*x.shape[:-1], d))
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out
    block, num_warps = _launch_shape(n_rows, d, x.element_size())
    even = d % block == 0 and not TUNING.get("masked", False)
    last = (n_rows - 1) * max(x2.stride(0), 2 * d) + 2 * d  # one past the largest offset either side
    index_64 = TUNING.get("index_64", last >= 2**31)
    with device_of(x):
        _act_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0),
            D=d, CONTIGUOUS=n_rows == 1 or x2.stride(0) == 2 * d,
            ACTIVATION=activation, BLOCK=block, EVEN=even, INDEX_64=index_64, num_warps=num_warps,
        )  # fmt: skip
    return out


def silu_and_mul(x: Tensor) -> Tensor:
    """The triton provider of ``silu_and_mul``."""
    return _act_and_mul(x, SILU)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """The triton provider of ``gelu_and_mul`` (``approximate`` as ``F.gelu``'s)."""
    return _act_and_mul(x, _GELU_APPROXIMATIONS[approximate])
