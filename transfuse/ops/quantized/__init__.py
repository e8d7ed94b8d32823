"""Merged projections over quantized weights: one adapter per quantization scheme.

A fuser never names a scheme: ``scheme_of`` finds the adapter that claims a linear layer, and
``QuantizedProjection`` merges the parts through it. A quantized layer no adapter claims is refused
by the merge with its type named.
"""

from __future__ import annotations

from torch import nn

from .base import Scheme, SchemeError
from .bitsandbytes import BitsAndBytes4bit, BitsAndBytes8bit
from .fp8_blocks import FP8Blocks
from .layer import QuantizedProjection
from .quanto import Quanto
from .torchao import TorchAO

__all__ = ["QuantizedProjection", "Scheme", "SchemeError", "register_scheme", "scheme_of", "schemes"]

_SCHEMES: list[Scheme] = [TorchAO(), BitsAndBytes8bit(), BitsAndBytes4bit(), Quanto(), FP8Blocks()]


def schemes() -> tuple[Scheme, ...]:
    return tuple(_SCHEMES)


def register_scheme(scheme: Scheme) -> None:
    """Add an adapter (an out-of-tree scheme's); it is asked before the built-in ones."""
    _SCHEMES.insert(0, scheme)


def scheme_of(module: nn.Module) -> Scheme | None:
    """The adapter that claims ``module`` as a quantized linear layer, if one does."""
    for scheme in _SCHEMES:
        if scheme.claims(module):
            return scheme
    return None
