"""bitsandbytes: LLM.int8 (``Linear8bitLt``, ``Int8Params`` with one scale per row) and 4-bit
NF4/FP4 (``Linear4bit``, ``Params4bit`` with blockwise absmax over the flattened weight).

LLM.int8: the int8 rows and their per-row scales concatenate exactly; the merged layer is a
``Linear8bitLt`` over them, so ``bnb.matmul`` (and its outlier threshold) is the one the parts ran.

4-bit: a ``[out, in]`` weight is quantized in blocks of ``blocksize`` consecutive elements of its
flattening, two codes a byte. The parts' flattenings laid end to end are the merged weight's, so
the packed bytes and the absmax concatenate exactly when each part's element count is a multiple
of the block size. The merged layer is a ``Linear4bit`` over that layout (``bnb.matmul_4bit``).
Refused: double quantisation (the absmax is itself quantized with a per-tensor offset: one offset
for the merged tensor would requantise). A merge of the original layout keeps it (the merged layer
and its parts are not repacked for the CPU kernel, which would rewrite the stored bytes).

On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight the first time its layer runs
(``packing_format_for_cpu``): the codes become ``[out, in / 2]`` in tiles of 32 output rows and
the absmax ``[in / blocksize, out]`` in bfloat16 (double quantisation dequantised into it). That
layout concatenates exactly along the outputs too (rows of the codes, columns of the absmax) when
each part's width is a multiple of 32; the merged layer then runs the same packed kernel, and the
parts save as the stock repacked layers save (bitsandbytes unpacks them on save).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from .base import Scheme, SchemeError, alone, cat_rows, merged_bias, point_bias, split_points

__all__ = ["BitsAndBytes4bit", "BitsAndBytes8bit"]

_TILE = 32  # output rows per tile of bitsandbytes' CPU packing (its ``block_n``)


def _packed(state) -> bool:
    return bool(getattr(state, "packing_format_for_cpu", False))


def _bnb_class(module: nn.Module, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("bitsandbytes.") for c in type(module).__mro__)


class BitsAndBytes8bit(Scheme):
    name = "bitsandbytes LLM.int8"

    def claims(self, module: nn.Module) -> bool:
        return _bnb_class(module, "Linear8bitLt")

    def describe(self, module: nn.Module) -> str:
        return f"bitsandbytes LLM.int8 {type(module.weight).__name__}"

    @staticmethod
    def _rows(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = module.state
        if state.CB is not None:
            return state.CB, state.SCB
        return module.weight.data, getattr(module.weight, "SCB", None)

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        for name, module in zip(names, modules):
            if type(module) is not type(modules[0]):
                raise SchemeError(f"{name} is a {type(module).__name__}, {names[0]} a {type(modules[0]).__name__}.")
            if module.state.has_fp16_weights or module.weight.dtype != torch.int8:
                raise SchemeError(f"{name} ({self.name}) keeps 16-bit weights (has_fp16_weights): not quantized yet.")
            data, scales = self._rows(module)
            if scales is None or scales.shape != (data.shape[0],):
                raise SchemeError(f"{name} ({self.name}) has no per-row scale (SCB) beside its int8 rows.")
            if module.state.threshold != modules[0].state.threshold:
                raise SchemeError(
                    f"{name} and {names[0]} ({self.name}) have different outlier thresholds "
                    f"({module.state.threshold} vs {modules[0].state.threshold})."
                )

    def merge(self, modules: Sequence[nn.Module]) -> nn.Module:
        from bitsandbytes.nn import Int8Params

        rows = [self._rows(m) for m in modules]
        data, scales = cat_rows([r[0] for r in rows]), cat_rows([r[1] for r in rows])
        first = modules[0]
        with torch.device("meta"):
            kernel = type(first)(
                first.in_features,
                data.shape[0],
                bias=first.bias is not None,
                has_fp16_weights=False,
                threshold=first.state.threshold,
            )
        weight = Int8Params(data, requires_grad=False, has_fp16_weights=False)
        weight.CB, weight.SCB = data, scales
        kernel.weight = weight
        bias = merged_bias(modules)
        kernel.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        kernel.train(first.training)
        return kernel

    def point_parts(self, kernel: nn.Module, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        data, scales = self._rows(kernel)
        for module, (start, end) in zip(modules, split_points(sizes)):
            rows, row_scales = alone(data[start:end]), alone(scales[start:end])
            module.weight.data = rows
            if module.state.CB is not None:
                module.state.CB, module.state.SCB = rows, row_scales
            else:
                module.weight.CB, module.weight.SCB = rows, row_scales
        point_bias(kernel.bias, modules, sizes)

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        data, scales = self._rows(module)
        return [data, scales] + ([module.bias] if module.bias is not None else [])

    def forward(self, kernel: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return kernel(x)


class BitsAndBytes4bit(Scheme):
    name = "bitsandbytes 4-bit"

    def claims(self, module: nn.Module) -> bool:
        return _bnb_class(module, "Linear4bit")

    def describe(self, module: nn.Module) -> str:
        state = getattr(module.weight, "quant_state", None)
        kind = state.quant_type.upper() if state is not None else "4-bit"
        return f"bitsandbytes {kind} {type(module.weight).__name__}"

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        first = modules[0].weight.quant_state if getattr(modules[0].weight, "quant_state", None) else None
        for name, module in zip(names, modules):
            if type(module) is not type(modules[0]):
                raise SchemeError(f"{name} is a {type(module).__name__}, {names[0]} a {type(modules[0]).__name__}.")
            state = getattr(module.weight, "quant_state", None)
            if state is None or first is None:
                raise SchemeError(f"{name} ({self.name}) is not quantized yet (no quant_state).")
            packed = _packed(state)
            if packed != _packed(first):
                raise SchemeError(f"{name} and {names[0]} ({self.name}): one is repacked for the CPU kernel, one is not.")
            if packed:
                if module.out_features % _TILE or module.weight.dim() != 2 or state.absmax.shape[1] != module.out_features:
                    raise SchemeError(
                        f"{name} ({self.describe(module)}, repacked for bitsandbytes' CPU kernel) has "
                        f"{module.out_features} outputs, not a multiple of its {_TILE}-row tiles."
                    )
            elif state.absmax.dim() != 1:
                raise SchemeError(
                    f"{name} ({self.describe(module)}) holds its absmax as {tuple(state.absmax.shape)}, the layout "
                    "bitsandbytes' CPU unpacking leaves after a state_dict() of a repacked layer: not one absmax per "
                    "block of the flattened weight."
                )
            elif state.nested:
                raise SchemeError(
                    f"{name} is {self.describe(module)} with double quantisation (its absmax quantized again, with a "
                    "per-tensor offset): merging would requantise the absmax under one offset."
                )
            if module.weight.dtype != torch.uint8 or module.weight.data.dim() != 2:
                raise SchemeError(f"{name} ({self.name}) stores its codes as {module.weight.dtype}, not packed uint8.")
            numel = state.shape[0] * state.shape[1]
            if not packed and numel % state.blocksize:
                raise SchemeError(
                    f"{name} ({self.describe(module)}) has {numel} elements, not a multiple of its block size "
                    f"{state.blocksize}: a block would straddle two parts."
                )
            same = (
                state.blocksize == first.blocksize
                and state.quant_type == first.quant_type
                and state.dtype == first.dtype
                and torch.equal(state.code, first.code)
                and module.compute_dtype == modules[0].compute_dtype
            )
            if not same:
                raise SchemeError(f"{name} and {names[0]} are {self.name} weights quantized differently.")

    def merge(self, modules: Sequence[nn.Module]) -> nn.Module:
        from bitsandbytes.functional import QuantState
        from bitsandbytes.nn import Params4bit

        first = modules[0]
        state0 = first.weight.quant_state
        rows = sum(m.weight.quant_state.shape[0] for m in modules)
        absmaxes = [m.weight.quant_state.absmax.detach() for m in modules]
        if _packed(state0):  # the repacked layout's own fields, with the merged absmax columns and shape
            state = copy.copy(state0)
            state.absmax = torch.cat(absmaxes, dim=1)
            state.shape = torch.Size([rows, first.in_features])
        else:
            state = QuantState(
                absmax=torch.cat(absmaxes),
                shape=torch.Size([rows, first.in_features]),
                code=state0.code,
                blocksize=state0.blocksize,
                quant_type=state0.quant_type,
                dtype=state0.dtype,
            )
        with torch.device("meta"):
            kernel = type(first)(
                first.in_features,
                rows,
                bias=first.bias is not None,
                compute_dtype=first.compute_dtype,
                quant_type=state0.quant_type,
                quant_storage=first.weight.quant_storage,
            )
        kernel.weight = Params4bit(
            cat_rows([m.weight.data for m in modules]),
            requires_grad=False,
            quant_state=state,
            blocksize=state0.blocksize,
            compress_statistics=False,
            quant_type=state0.quant_type,
            quant_storage=first.weight.quant_storage,
            module=kernel,
            bnb_quantized=True,
        )
        bias = merged_bias(modules)
        kernel.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        kernel.compute_type_is_set = first.compute_type_is_set
        kernel.quant_state = state
        kernel.train(first.training)
        for module in (kernel, *modules) if not _packed(state0) else ():
            # The original layout is kept: the repacking for the CPU kernel would rewrite the stored
            # bytes (and round the absmax to bfloat16) and end the parts' views.
            module.support_avx512bf16_for_cpu = False
        return kernel

    def point_parts(self, kernel: nn.Module, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        block = kernel.weight.quant_state.blocksize
        data, absmax = kernel.weight.data, kernel.weight.quant_state.absmax
        in_features = kernel.in_features
        if _packed(kernel.weight.quant_state):
            for module, (start, end) in zip(modules, split_points(sizes)):
                module.weight.data = alone(data[start:end])
                module.weight.quant_state.absmax = absmax[:, start:end]  # columns: a view
            point_bias(kernel.bias, modules, sizes)
            return
        for module, (start, end) in zip(modules, split_points(sizes)):
            first, last = start * in_features, end * in_features  # elements of the flattened weight
            module.weight.data = alone(data[first // 2 : last // 2])
            module.weight.quant_state.absmax = alone(absmax[first // block : last // block])
        point_bias(kernel.bias, modules, sizes)

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        found = [module.weight.data, module.weight.quant_state.absmax]
        return found + ([module.bias] if module.bias is not None else [])

    def forward(self, kernel: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return kernel(x)
