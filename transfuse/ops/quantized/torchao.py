"""torchao weight tensor subclasses (``Int8Tensor``, ``Int4Tensor``, ``Float8Tensor``, ...) on
``nn.Linear``: ``F.linear`` dispatches to the subclass's own matmul.

A subclass's inner tensors (``__tensor_flatten__``) that have one row per output (int data,
per-channel and per-group scales and zero points) concatenate exactly along the output dimension,
and the merged weight is rebuilt with the subclass's own ``__tensor_unflatten__``. An inner tensor
without one row per output (a per-tensor scale) cannot: the merge is refused, naming it.

Most inner tensors have the outputs as their first dimension; those that do not (``_OUTPUT_AXES``:
the CPU int4 ``Int4OpaqueTensor``'s ``scale_and_zero``, ``[in / group, out, 2]`` for
``_weight_int4pack_mm_for_cpu``) concatenate along their output axis too, but a part's slice of
that axis is not contiguous and the kernel reads it as if it were: the merged layer holds such a
tensor concatenated once more (the scales, not the codes), and the parts keep their own. Its codes
(``qdata``, packed by ``_convert_weight_to_int4pack_for_cpu``) concatenate exactly only where this
CPU packs each part alone as within the merged tensor (``base.cpu_int4_rows_concatenate``); the
merge is refused otherwise.

Some inner tensors hold a tile of several outputs per entry of their output axis (``_TILES``: the
CUDA int4 ``Int4TilePackedTo4dTensor``'s ``qdata``, ``[out / 8, in / 128, 32, 4]`` for tinygemm's
``_weight_int4pack_mm``, and its ``scale_and_zero``, ``[in / group, out, 2]``). Such parts
concatenate exactly when each part's outputs are whole tiles; a part whose last tile is padded
(outputs not a multiple of the tile) is refused, naming the tile.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Scheme, SchemeError, alone, check_cpu_int4_rows, merged_bias, point_bias, split_points

__all__ = ["TorchAO"]


def _is_torchao(tensor) -> bool:
    return type(tensor).__module__.startswith("torchao.") and hasattr(type(tensor), "__tensor_flatten__")


# (subclass name, inner tensor name) -> the inner tensor's output axis, where it is not the first.
_OUTPUT_AXES = {("Int4OpaqueTensor", "scale_and_zero"): 1, ("Int4TilePackedTo4dTensor", "scale_and_zero"): 1}
# (subclass name, inner tensor name) -> outputs per entry of the output axis, where more than one.
_TILES = {("Int4TilePackedTo4dTensor", "qdata"): 8}
# (subclass name, inner tensor name) of codes packed by ``_convert_weight_to_int4pack_for_cpu``,
# whose layout groups blocks of output rows on some CPUs (``base.cpu_int4_rows_concatenate``).
_CPU_INT4_PACKED = {("Int4OpaqueTensor", "qdata")}


def _axis(weight, key: str) -> int:
    return _OUTPUT_AXES.get((type(weight).__name__, key), 0)


def _tile(weight, key: str) -> int:
    return _TILES.get((type(weight).__name__, key), 1)


def _context(weight, context):
    """The subclass's attributes without the one that is its own shape (``Int4OpaqueTensor.shape``): the
    parts differ there, and the merged weight's is the merged shape."""
    if isinstance(context, dict):
        return {k: v for k, v in context.items() if not (k == "shape" and tuple(v) == tuple(weight.shape))}
    return context


def _inner(weight) -> tuple[dict[str, torch.Tensor | None], object]:
    names, context = weight.__tensor_flatten__()
    optional = getattr(type(weight), "optional_tensor_data_names", ()) or ()
    inner = {name: getattr(weight, name) for name in names}
    for name in optional:
        inner.setdefault(name, getattr(weight, name, None))
    return inner, context


class TorchAO(Scheme):
    name = "torchao"

    def claims(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.Linear)
            and type(module).forward is nn.Linear.forward
            and _is_torchao(getattr(module, "weight", None))
        )

    def describe(self, module: nn.Module) -> str:
        return f"torchao {type(module.weight).__name__}"

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        first, (inner0, context0) = modules[0].weight, _inner(modules[0].weight)
        for name, module in zip(names, modules):
            weight = module.weight
            if type(weight) is not type(first):
                raise SchemeError(f"{name}.weight is a {type(weight).__name__}, {names[0]}.weight a {type(first).__name__}.")
            if weight.dim() != 2:
                raise SchemeError(f"{name}.weight of {self.describe(module)} is not a 2-d weight.")
            inner, context = _inner(weight)
            if _context(weight, context) != _context(first, context0) or inner.keys() != inner0.keys():
                raise SchemeError(
                    f"{name}.weight and {names[0]}.weight are {self.describe(module)}s quantized differently "
                    f"({context} vs {context0})."
                )
            for key, tensor in inner.items():
                if (tensor is None) != (inner0[key] is None):
                    raise SchemeError(f"{name}.weight has {key} and {names[0]}.weight has not, or the reverse.")
                axis, tile = _axis(weight, key), _tile(weight, key)
                if tensor is not None and tile > 1 and weight.shape[0] % tile:
                    raise SchemeError(
                        f"{name}.weight is a {self.describe(module)} whose {key} packs {tile} outputs a tile: its "
                        f"{weight.shape[0]} outputs end in a padded tile, which cannot be concatenated."
                    )
                if tensor is not None and (tensor.dim() <= axis or tensor.shape[axis] * tile != weight.shape[0]):
                    raise SchemeError(
                        f"{name}.weight is a {self.describe(module)} whose {key} {tuple(tensor.shape)} is not one row "
                        f"per output ({weight.shape[0]}): one {key} for the whole tensor cannot be concatenated."
                    )
                others = lambda t: t.shape[:axis] + t.shape[axis + 1 :]  # noqa: E731
                if tensor is not None and others(tensor) != others(inner0[key]):
                    raise SchemeError(f"{name}.weight's {key} is {tuple(tensor.shape)}, {names[0]}'s {tuple(inner0[key].shape)}.")

        for key, tensor in inner0.items():
            if (type(first).__name__, key) in _CPU_INT4_PACKED and tensor is not None and tensor.device.type == "cpu":
                check_cpu_int4_rows(names, [m.weight.shape[0] for m in modules], f"{self.describe(modules[0])}s")

    def merge(self, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = [m.weight for m in modules]
        inner0, context = _inner(weights[0])
        parts = [_inner(w)[0] for w in weights]
        merged = {
            key: (torch.cat([p[key] for p in parts], dim=_axis(weights[0], key)) if inner0[key] is not None else None)
            for key in inner0
        }
        rows = sum(w.shape[0] for w in weights)
        size = torch.Size([rows, weights[0].shape[1]])
        flat = {k: v for k, v in merged.items() if v is not None}
        if isinstance(context, dict) and "shape" in context and tuple(context["shape"]) == tuple(weights[0].shape):
            context = {**context, "shape": size}
        weight = type(weights[0]).__tensor_unflatten__(flat, context, size, (size[1], 1))
        for key, value in merged.items():
            if value is None and getattr(weight, key, None) is not None:
                setattr(weight, key, None)
        return weight, merged_bias(modules)

    def point_parts(self, kernel, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        weight, bias = kernel
        merged, _ = _inner(weight)
        for module, (start, end) in zip(modules, split_points(sizes)):
            for key, tensor in merged.items():
                if tensor is not None and _axis(weight, key) == 0:  # others stay the part's own (module doc)
                    tile = _tile(weight, key)
                    setattr(module.weight, key, alone(tensor[start // tile : end // tile]))
        point_bias(bias, modules, sizes)

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        inner, _ = _inner(module.weight)
        found = [t for t in inner.values() if t is not None]
        return found + ([module.bias] if module.bias is not None else [])

    def forward(self, kernel, x: torch.Tensor) -> torch.Tensor:
        weight, bias = kernel
        return F.linear(x, weight, bias)
