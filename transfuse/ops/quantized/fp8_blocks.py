"""Block-scaled FP8 (the DeepSeek/Qwen FP8 layout): transformers' ``FP8Linear``, an e4m3 weight with
one float32 ``weight_scale_inv`` per ``block_size`` block (128 x 128 in released checkpoints).

The e4m3 rows and the scale rows concatenate exactly along the output dimension when every part's
output width is a multiple of the block's height (a block never straddles two parts). The merged
layer runs transformers' own ``fp8_linear`` (DeepGEMM or its Triton block-FP8 kernel) on CUDA; on
other devices, where transformers has no FP8 kernel, the reference: the weight dequantised block by
block into the input's dtype, then ``F.linear``. Refused: per-tensor scales (no ``block_size``), and
static activation scales (one per layer: the merged layer would need one for all parts).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import Scheme, SchemeError, alone, cat_rows, merged_bias, point_bias, split_points

__all__ = ["FP8Blocks", "dequantize_blocks", "new_fp8_linear", "quantize_blocks"]


def new_fp8_linear(cls: type, in_features: int, out_features: int, block_size, bias: bool, activation_scheme="dynamic"):
    """An empty ``FP8Linear`` (transformers' releases name its bias argument ``has_bias`` or ``bias``)."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {"block_size": block_size, "activation_scheme": activation_scheme}
    kwargs["has_bias" if "has_bias" in accepted else "bias"] = bias
    return cls(in_features, out_features, **{k: v for k, v in kwargs.items() if k in accepted})


def _is_fp8_linear(module: nn.Module) -> bool:
    return any(c.__name__ == "FP8Linear" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


def quantize_blocks(weight: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` as e4m3 with one float32 scale per block (``[..., ⌈N/bn⌉, ⌈K/bk⌉]``): the
    layout of a fine-grained FP8 checkpoint, for building one from dense weights (tests, benchmarks)."""
    *lead, n, k = weight.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    tiles = F.pad(weight.float(), (0, pk, 0, pn)).reshape(*lead, (n + pn) // bn, bn, (k + pk) // bk, bk)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-8) / 448.0
    q = (tiles / scale[..., :, None, :, None]).reshape(*lead, n + pn, k + pk)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (``[out, in]`` e4m3) times its block's scale, in ``dtype``."""
    rows, cols = weight.shape
    scale = scale_inv.to(dtype).repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.to(dtype) * scale


class FP8Blocks(Scheme):
    name = "block FP8"

    def claims(self, module: nn.Module) -> bool:
        return _is_fp8_linear(module) and module.weight.element_size() == 1

    def describe(self, module: nn.Module) -> str:
        block = getattr(module, "block_size", None)
        shape = "x".join(str(b) for b in block) if block else "per-tensor"
        return f"block FP8 {module.weight.dtype} ({shape} scales)"

    def check(self, names: Sequence[str], modules: Sequence[nn.Module]) -> None:
        first = modules[0]
        for name, module in zip(names, modules):
            block = module.block_size
            if block is None:
                raise SchemeError(f"{name} ({self.describe(module)}) has one scale for the whole tensor.")
            if getattr(module, "activation_scale", None) is not None or module.activation_scheme != "dynamic":
                raise SchemeError(
                    f"{name} ({self.describe(module)}) quantizes its input with a static per-layer activation scale: "
                    "the merged layer would need one for all parts."
                )
            if tuple(block) != tuple(first.block_size) or module.weight.dtype != first.weight.dtype:
                raise SchemeError(f"{name} and {names[0]} ({self.name}) have different blocks or FP8 dtypes.")
            if module.weight_scale_inv.dtype != first.weight_scale_inv.dtype:
                raise SchemeError(f"{name} and {names[0]} ({self.name}) store their scales in different dtypes.")
            if module.out_features % block[0]:
                raise SchemeError(
                    f"{name} ({self.describe(module)}) has {module.out_features} outputs, not a multiple of the "
                    f"block's {block[0]} rows: a block of scales would straddle two parts."
                )

    def merge(self, modules: Sequence[nn.Module]) -> nn.Module:
        first = modules[0]
        weight = cat_rows([m.weight for m in modules])
        with torch.device("meta"):
            kernel = new_fp8_linear(
                type(first), first.in_features, weight.shape[0], first.block_size, first.bias is not None,
                first.activation_scheme,
            )
        kernel.weight = nn.Parameter(weight, requires_grad=False)
        kernel.weight_scale_inv = nn.Parameter(cat_rows([m.weight_scale_inv for m in modules]), requires_grad=False)
        bias = merged_bias(modules)
        kernel.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        return kernel

    def point_parts(self, kernel: nn.Module, modules: Sequence[nn.Module], sizes: Sequence[int]) -> None:
        block = kernel.block_size[0]
        for module, (start, end) in zip(modules, split_points(sizes)):
            module.weight.data = alone(kernel.weight.data[start:end])
            module.weight_scale_inv.data = alone(kernel.weight_scale_inv.data[start // block : end // block])
        point_bias(kernel.bias, modules, sizes)

    def tensors(self, module: nn.Module) -> list[torch.Tensor]:
        found = [module.weight, module.weight_scale_inv]
        return found + ([module.bias] if module.bias is not None else [])

    def forward(self, kernel: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            return kernel(x)  # transformers' own FP8 kernels
        weight = dequantize_blocks(kernel.weight, kernel.weight_scale_inv, kernel.block_size, x.dtype)
        return F.linear(x, weight, kernel.bias)
