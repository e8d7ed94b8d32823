"""Triton kernels, imported lazily: importing transfuse never imports Triton.

Providers backed by these kernels are registered eagerly with a ``supported`` check that
only looks for the package; the kernel module is imported on first call. Under
``TRITON_INTERPRET=1`` (set before Triton is imported) the kernels run on CPU tensors,
which is how CI tests their logic without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..platform import current_platform

__all__ = ["available", "interpreting", "on_device"]


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def available() -> bool:
    """Triton is installed and has somewhere to run: a CUDA or ROCm GPU, or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or current_platform().name in ("cuda", "rocm")


def on_device(*tensors: torch.Tensor) -> bool:
    """All tensors are where Triton kernels can read them: on the GPU, or on CPU when interpreting."""
    device = "cpu" if interpreting() else "cuda"
    return all(t.device.type == device for t in tensors)
