"""optimum-quanto: ``QLinear`` frozen with int8 weights (``WeightQBytesTensor``: int8 rows, one scale
per row), computed by ``F.linear`` through the tensor's own dispatch (``quanto.qbytes_mm``).

The int8 rows and their scales concatenate exactly along the output dimension. Refused, naming why:
a layer that quantizes its activations too (its input and output scales are per tensor), weights not
frozen (quantized again from float on every call), and quanto's int4 and int2
(``WeightQBitsTensor``), whose ``PackedTensor`` puts rows half the tensor apart in one byte: a
part's packed bytes are not rows of the merged packing, so merging would have to repack.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Scheme, SchemeError, alone, merged_bias, point_bias, split_points

__all__ = ["Quanto"]


def _is_qlinear(module: nn.Module) -> bool:
    return any(c.__name__ == "QLinear" and c.__module__.startswith("optimum.quanto") for c in type(module).__mro__)


class Quanto(Scheme):
    name = "optimum-quanto"

    def claims(self, module: nn.Module) -> bool:
        return _is_qlinear(module)

    def describe(self, module: nn.Module) -> str:
        qtype = getattr(module, "weight_qtype", None)
        return f"optimum-quanto {getattr(qtype, 'name', qtype)} {type(module.weight).__name__}"

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
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
            if type(weight).__name__ != "WeightQBytesTensor":
                if type(weight).__name__ == "WeightQBitsTensor":
                    raise SchemeError(
                        f"{name} is {self.describe(module)}: its PackedTensor packs rows half the tensor apart into one "
                        "byte, so the parts' packed bytes are not rows of a merged packing (merging would repack)."
                    )
                raise SchemeError(f"{name} ({self.describe(module)}) is not frozen: its weight is quantized on each call.")
            if weight._data.shape != weight.shape or weight._scale.shape != (weight.shape[0], 1):
                raise SchemeError(f"{name} ({self.describe(module)}) has no scale per output row.")
            if weight.qtype != first.weight.qtype or weight.axis != 0 or weight._scale.dtype != first.weight._scale.dtype:
                raise SchemeError(f"{name} and {names[0]} are {self.name} weights quantized differently.")

    def merge(self, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        first = modules[0].weight
        data = torch.cat([m.weight._data.detach() for m in modules])
        scale = torch.cat([m.weight._scale.detach() for m in modules])
        weight = type(first)(first.qtype, 0, data.shape, data.stride(), data, scale, first.activation_qtype)
        return weight, merged_bias(modules)

    def point_parts(self, kernel, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        weight, bias = kernel
        for module, (start, end) in zip(modules, split_points(sizes)):
            module.weight._data = alone(weight._data[start:end])
            module.weight._scale = alone(weight._scale[start:end])
        point_bias(bias, modules, sizes)

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        found = [module.weight._data, module.weight._scale]
        return found + ([module.bias] if module.bias is not None else [])

    def forward(self, kernel, x: torch.Tensor) -> torch.Tensor:
        weight, bias = kernel
        return F.linear(x, weight, bias)
