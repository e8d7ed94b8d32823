"""The interface a quantization scheme's adapter gives merged projections, and what they share.

A merged projection over quantized parts holds one copy of the parts' quantized storage, their
tensors concatenated along the output dimension in the scheme's own types and bytes (``merge``),
and runs the scheme's own kernel on it (``forward``). The parts stay under their names as the
original modules, their quantized tensors now views of the merged storage (``point_parts``): their
``state_dict`` is the original checkpoint's, keys and bytes, and they compute what they computed.

An adapter refuses (``SchemeError``, naming the scheme) what it cannot merge exactly: scales shared
by a whole tensor, blocks that would straddle two parts, layouts repacked for one kernel. It never
dequantises and requantises.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

__all__ = ["Scheme", "SchemeError", "alone", "check_cpu_int4_rows", "storage_bytes"]


class SchemeError(ValueError):
    """The quantized parts cannot be merged exactly in their scheme's storage (the message names it)."""


class Scheme:
    """One quantization scheme's adapter. ``name`` is what refusals and reports call it."""

    name = "?"

    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` is a linear layer quantized with this scheme."""
        raise NotImplementedError

    def describe(self, module: nn.Module) -> str:
        """The scheme and storage type of ``module``'s weight, as refusals and reports name it."""
        return self.name

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        """Raise ``SchemeError`` unless the parts merge exactly along the output dimension."""
        raise NotImplementedError

    def merge(self, modules: Sequence[nn.Module]) -> object:
        """The merged layer's kernel state, built from the parts' quantized tensors concatenated."""
        raise NotImplementedError

    def point_parts(self, kernel: object, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        """Make each part's quantized tensors (and bias) views of its rows of ``kernel``'s storage."""
        raise NotImplementedError

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        """The tensors that hold ``module``'s quantized weight (and its bias), as stored."""
        raise NotImplementedError

    def forward(self, kernel: object, x: torch.Tensor) -> torch.Tensor:
        """The merged projection of ``x`` through the scheme's own kernel."""
        raise NotImplementedError


def alone(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (contiguous elements of a merged tensor) over the same memory but a storage object
    of its own: tie detection groups tensors by storage, and the parts of a merge are not tied
    weights. Meta and non-contiguous tensors stay views."""
    if piece.device.type == "meta" or not piece.is_contiguous():
        return piece
    start = piece.storage_offset() * piece.element_size()
    storage = piece.untyped_storage()[start : start + piece.nbytes]
    return piece.new_empty(0).set_(storage, 0, piece.shape, piece.stride())


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cat_rows(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach() for p in pieces])


def split_points(sizes: Sequence[int], scale: int = 1) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each part along the merged dimension, each size times ``scale``."""
    points, start = [], 0
    for size in sizes:
        points.append((start, start + size * scale))
        start += size * scale
    return points


def merged_bias(modules: Sequence[nn.Module]) -> torch.Tensor | None:
    if modules[0].bias is None:
        return None
    return cat_rows([m.bias for m in modules])


def point_bias(bias: torch.Tensor | None, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
    if bias is None:
        return
    for module, (start, end) in zip(modules, split_points(sizes)):
        module.bias.data = alone(bias[start:end])


@functools.lru_cache(maxsize=None)
def cpu_int4_rows_concatenate(sizes: tuple[int, ...]) -> bool:
    """Whether ``torch._convert_weight_to_int4pack_for_cpu`` packs parts of ``sizes`` output rows,
    each packed alone and laid end to end, as it packs them together. Its layout is the CPU's: with
    AVX-512 it interleaves the codes of blocks of 64 rows, so a part whose rows end inside a block is
    packed otherwise alone than within the merged tensor. Probed on random codes (the layout does
    not depend on the input width)."""
    pack = torch._convert_weight_to_int4pack_for_cpu
    generator = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=generator) for n in sizes]
    return torch.equal(torch.cat([pack(c, 1) for c in codes]), pack(torch.cat(codes), 1))


def check_cpu_int4_rows(names: Sequence[str], sizes: Sequence[int], what: str) -> None:
    """Raise ``SchemeError`` where parts of ``sizes`` rows, whose codes ``what`` are packed for
    ``_weight_int4pack_mm_for_cpu``, do not concatenate into the merged tensor's packing on this CPU."""
    if not cpu_int4_rows_concatenate(tuple(sizes)):
        raise SchemeError(
            f"{', '.join(names)} are {what} packed for this CPU's int4 kernel, which lays out blocks of output rows "
            f"together: parts of {', '.join(map(str, sizes))} rows packed one by one are not the merged layer's packing."
        )
