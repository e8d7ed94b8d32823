"""CUDA C++ providers (kernels in ``transfuse/csrc/``), built on demand where a CUDA toolchain exists.

Registered here for rms_norm, fused_add_rms_norm and silu_and_mul. ``supported`` only asks
whether the platform is an NVIDIA GPU; ``supports_args`` takes the cases the kernels were
written for (CUDA tensors; rms_norm normalising in float32 with the weight and output in the
input dtype; rows that fit in registers) and, for the first such call, builds the extension
(``build.py``; cached afterwards). Everything else, and everything when the build fails,
goes to the next provider.
"""

from __future__ import annotations

import torch

from ..act_and_mul import SILU_AND_MUL
from ..checks import rows_fit, same_rows, weight_fits
from ..dispatch import Provider
from ..fused_add_rms_norm import FUSED_ADD_RMS_NORM
from ..platform import current_platform
from ..rms_norm import RMS_NORM, rms_norm_out_dtype
from ..triton import available as triton_available
from . import launch
from .build import extension

__all__ = ["on_cuda_platform"]

# Widths the rms_norm kernel holds in registers (transfuse/csrc/rms_norm.cu: 4096 vectors a row):
# any row up to _SCALAR_WIDTH, and up to 4096 16-byte vectors when rows are contiguous and aligned.
_SCALAR_WIDTH = 4096
_VECTORS = 4096
# silu_and_mul covers a row with at most 65535 blocks of 256 threads.
_MAX_ACT_WIDTH = 2**24
# Which of this extension and the Triton kernels runs, where both can. Measured on an H200
# (benchmarks/results/h200_ops_2026-11-30.md and h200_sweep_triton_ops_2026-11-29.md; bf16, hidden 4096):
# * issued eagerly from Python, a call of up to a few thousand rows is bound by its host cost,
#   which is 2-3x lower here (about 15-45 us against 40-90 us for a Triton launch, depending on
#   the machine), so this extension runs;
# * in a CUDA-graph capture the host cost is paid once, and from _DEVICE_BOUND_ROWS rows the
#   device time dominates anyway: there the provider with less device time runs. That is Triton
#   for rms_norm and silu_and_mul at every size (rms_norm 1.55 against 2.51 us at one row, 16.9
#   against ~21 us at 4096 rows), and for fused_add_rms_norm below _DEVICE_BOUND_ROWS only (at
#   4096 and 32768 rows this kernel is 2-5% faster).
_DEVICE_BOUND_ROWS = 2048


def on_cuda_platform() -> bool:
    """The platform is an NVIDIA GPU (ROCm builds of torch report "rocm")."""
    return current_platform().name == "cuda"


def _built() -> bool:
    """The extension is built or loaded; the first call builds it (a one-line warning if it cannot)."""
    return extension() is not None


def _rows_aligned(t: torch.Tensor | None, vec: int) -> bool:
    """Every row of ``t``'s rows view starts on 16 bytes, as transfuse/csrc/rms_norm.cu's vector path checks."""
    if t is None:
        return True
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:
        return True  # leading dimensions that do not collapse: the launcher copies into fresh rows
    return rows.stride(0) % vec == 0 and rows.data_ptr() % 16 == 0


def _vectorizable(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None) -> bool:
    vec = 16 // x.element_size()
    weight_aligned = weight is None or weight.data_ptr() % 16 == 0
    return x.shape[-1] % vec == 0 and weight_aligned and _rows_aligned(x, vec) and _rows_aligned(residual, vec)


def _rms_norm_args(x, weight, eps, upcast, cast_before_weight, offset, weight_fp32, cast_output, residual=None):
    if not (upcast and x.is_cuda and rows_fit(x, _VECTORS * 8) and weight_fits(weight, x)):
        return False
    if weight is not None and weight.dtype != x.dtype:
        return False
    flags = (upcast, cast_before_weight, offset, weight_fp32, cast_output)
    if rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, *flags) != x.dtype:
        return False
    width = x.shape[-1]
    fits = width <= _SCALAR_WIDTH or (
        width // (16 // x.element_size()) <= _VECTORS and _vectorizable(x, weight, residual)
    )
    return fits and _built()


def _fused_add_rms_norm_args(x, residual, weight, eps, *flags) -> bool:
    return same_rows(x, residual) and _rms_norm_args(x, weight, eps, *flags, residual=residual)


def _silu_and_mul_args(x) -> bool:
    return x.is_cuda and rows_fit(x, _MAX_ACT_WIDTH) and x.shape[-1] % 2 == 0 and _built()


def _leave_to_triton(x: torch.Tensor, always_slower: bool) -> bool:
    """Whether Triton should run this call instead (see _DEVICE_BOUND_ROWS): ``always_slower`` when
    this extension's kernel takes more device time at every size, else only below _DEVICE_BOUND_ROWS."""
    if not triton_available():
        return False
    if x.numel() >= _DEVICE_BOUND_ROWS * x.shape[-1]:
        return always_slower
    return torch.cuda.is_current_stream_capturing()


def _rms_norm_defers(x, *args) -> bool:
    return _leave_to_triton(x, always_slower=True)


def _fused_add_rms_norm_defers(x, *args) -> bool:
    return _leave_to_triton(x, always_slower=False)


def _silu_and_mul_defers(x) -> bool:
    return _leave_to_triton(x, always_slower=True)


# Where the choice between this extension and Triton changes: conformance checks both sides.
_ROWS = {"rows": (_DEVICE_BOUND_ROWS,)}
RMS_NORM.register(
    Provider("cuda", launch.rms_norm, on_cuda_platform, _rms_norm_args, defers=_rms_norm_defers, thresholds=_ROWS)
)
FUSED_ADD_RMS_NORM.register(
    Provider(
        "cuda", launch.fused_add_rms_norm, on_cuda_platform, _fused_add_rms_norm_args,
        defers=_fused_add_rms_norm_defers, thresholds=_ROWS,
    )
)  # fmt: skip
SILU_AND_MUL.register(
    Provider(
        "cuda", launch.silu_and_mul, on_cuda_platform, _silu_and_mul_args, defers=_silu_and_mul_defers, thresholds=_ROWS
    )
)
