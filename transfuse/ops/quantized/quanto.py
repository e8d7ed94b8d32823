"""optimum-quanto: ``QLinear`` frozen with int8 weights (``WeightQBytesTensor``: int8 rows, one scale
per row), computed by ``F.linear`` through the tensor's own dispatch (``quanto.qbytes_mm``).

The int8 rows and their scales concatenate exactly along the output dimension.

int4 with bfloat16 scales, groups of 128, on a CPU: quanto holds it for tinygemm
(``TinyGemmWeightQBitsTensor``: codes ``[out, in / 2]`` as ``_convert_weight_to_int4pack_for_cpu``
packs them, one row per output, and ``_scale_shift [in / group, out, 2]``), run by
``_weight_int4pack_mm_for_cpu``. The code rows concatenate exactly where this CPU's packing of each
part alone is its packing within the merged tensor (``base.cpu_int4_rows_concatenate``: with
AVX-512 it interleaves blocks of 64 rows, so a part but the last must be whole blocks), and are
refused otherwise; the scales concatenate along
their output axis, which is not their first, so a part's slice is not contiguous and the kernel
reads it as if it were: the merged layer holds the scales concatenated once more (not the codes),
and the parts keep their own.

Refused, naming why: a layer that quantizes its activations too (its input and output scales are
per tensor), weights not frozen (quantized again from float on every call), and quanto's other int4
and int2 (``WeightQBitsTensor`` over a ``PackedTensor``): the weight is grouped into rows of
``group_size`` (``[out · in / group, group]``) and the packing puts grouped row ``i`` and row
``i + n / 2`` of the whole tensor into one byte. The parts' bytes laid end to end would unpack to
``[a₀; b₀; a₁; b₁]`` (each part's first halves, then its second halves), a permutation of the
merged rows that the scales, one per grouped row and not packed, do not follow: a merge would
have to repack the codes.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Scheme, SchemeError, alone, check_cpu_int4_rows, merged_bias, point_bias, split_points

__all__ = ["Quanto"]


def _is_qlinear(module: nn.Module) -> bool:
    return any(c.__name__ == "QLinear" and c.__module__.startswith("optimum.quanto") for c in type(module).__mro__)


def _tinygemm(weight) -> bool:
    return type(weight).__name__ == "TinyGemmWeightQBitsTensor"


class Quanto(Scheme):
    name = "optimum-quanto"

    def claims(self, module: nn.Module) -> bool:
        return _is_qlinear(module)

    def describe(self, module: nn.Module) -> str:
        qtype = getattr(module, "weight_qtype", None)
        return f"optimum-quanto {getattr(qtype, 'name', qtype)} {type(module.weight).__name__}"

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        first = modules[0]
        self._check_parts(names, modules)
        if _tinygemm(first.weight) and first.weight._data._data.device.type == "cpu":
            sizes = [m.weight.shape[0] for m in modules]
            check_cpu_int4_rows(names, sizes, f"{self.describe(first)} weights")

    def _check_parts(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        first = modules[0]
        for name, module in zip(names, modules):
            weight = module.weight
            if type(module).forward is not type(first).forward or type(weight) is not type(first.weight):
                raise SchemeError(f"{name} ({self.describe(module)}) and {names[0]} ({self.describe(first)}) differ.")
            if getattr(module, "activation_qtype", None) is not None:
                raise SchemeError(
                    f"{name} ({self.describe(module)}) quantizes its activations too, with one input and output "
                    "scale per layer: merged layers would need one scale for all."
                )
            if type(weight).__name__ == "TinyGemmWeightQBitsTensor":
                other = first.weight
                if weight._group_size != other._group_size or weight._scale_shift.dtype != other._scale_shift.dtype:
                    raise SchemeError(f"{name} and {names[0]} are {self.name} weights quantized differently.")
                if weight._data._data.shape[0] != weight.shape[0] or weight._scale_shift.shape[1] != weight.shape[0]:
                    raise SchemeError(f"{name} ({self.describe(module)}) has no tinygemm rows per output.")
                continue
            if type(weight).__name__ != "WeightQBytesTensor":
                if type(weight).__name__ == "WeightQBitsTensor":
                    raise SchemeError(
                        f"{name} is {self.describe(module)}: its PackedTensor puts grouped rows i and i + n/2 of the "
                        "whole tensor in one byte, so the parts' bytes end to end unpack to a permutation of the merged "
                        "rows that their scales do not follow (merging would repack)."
                    )
                raise SchemeError(f"{name} ({self.describe(module)}) is not frozen: its weight is quantized on each call.")
            if weight._data.shape != weight.shape or weight._scale.shape != (weight.shape[0], 1):
                raise SchemeError(f"{name} ({self.describe(module)}) has no scale per output row.")
            if weight.qtype != first.weight.qtype or weight.axis != 0 or weight._scale.dtype != first.weight._scale.dtype:
                raise SchemeError(f"{name} and {names[0]} are {self.name} weights quantized differently.")

    def merge(self, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        first = modules[0].weight
        if _tinygemm(first):
            packed_type = type(first._data)
            codes = torch.cat([m.weight._data._data.detach() for m in modules])
            scale_shift = torch.cat([m.weight._scale_shift.detach() for m in modules], dim=1)
            size = torch.Size([sum(m.weight.shape[0] for m in modules), first.shape[1]])
            stride = (size[1], 1)
            packed = packed_type(codes, size, stride)
            weight = type(first)(first.qtype, 0, first._group_size, size, stride, packed, scale_shift)
            return weight, merged_bias(modules)
        data = torch.cat([m.weight._data.detach() for m in modules])
        scale = torch.cat([m.weight._scale.detach() for m in modules])
        weight = type(first)(first.qtype, 0, data.shape, data.stride(), data, scale, first.activation_qtype)
        return weight, merged_bias(modules)

    def point_parts(self, kernel, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        weight, bias = kernel
        for module, (start, end) in zip(modules, split_points(sizes)):
            if _tinygemm(weight):  # the scales stay the part's own (module doc)
                module.weight._data._data = alone(weight._data._data[start:end])
                continue
            module.weight._data = alone(weight._data[start:end])
            module.weight._scale = alone(weight._scale[start:end])
        point_bias(bias, modules, sizes)

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        if _tinygemm(module.weight):
            found = [module.weight._data._data, module.weight._scale_shift]
            return found + ([module.bias] if module.bias is not None else [])
        found = [module.weight._data, module.weight._scale]
        return found + ([module.bias] if module.bias is not None else [])

    def forward(self, kernel, x: torch.Tensor) -> torch.Tensor:
        weight, bias = kernel
        return F.linear(x, weight, bias)
