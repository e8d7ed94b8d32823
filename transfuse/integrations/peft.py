"""PEFT: LoRA adapters on projections that transfuse merged.

A rewrite keeps each merged projection under its name as a ``LinearPart`` (an ``nn.Linear``
view of its rows), so ``get_peft_model(model, LoraConfig(target_modules=[...]))`` finds
``q_proj`` and ``gate_proj`` as on the stock model (``all-linear`` too, and the model type's
default targets) and wraps them. The merged projection still runs one matmul for all its parts;
``lora_adapters`` hands it each wrapped part's adapters, which ``ops.low_rank`` adds to that
part's columns (the adapters sharing one cast of the input and one matmul), so training
updates the adapters, ``save_pretrained`` writes PEFT's own keys
(``...q_proj.lora_A.weight``), which stock PEFT loads onto the stock model, and
``merge_and_unload`` merges each adapter into its part's rows of the merged weight.

Plain LoRA only: DoRA and PEFT's other variants raise a clear error. A wrapped part with hooks
(PEFT's mixed-adapter batches, ``adapter_names=...``, pass their arguments through such hooks) is
called as a module, as every hooked part is (``MergedProjection``), and never reaches this code.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.low_rank import Adapter

__all__ = ["lora_adapters"]


def _lora_linear_class() -> tuple[type, ...] | None:
    """PEFT's LoRA layers whose forward adds ``lora_B(lora_A(dropout(x))) * scaling`` to the base
    layer's output: on linear layers, and on bitsandbytes' quantized ones (QLoRA)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    classes = [Linear]
    try:
        from peft.tuners.lora import bnb
    except ImportError:
        return tuple(classes)
    classes += [getattr(bnb, name) for name in ("Linear8bitLt", "Linear4bit") if hasattr(bnb, name)]
    return tuple(classes)


def _passes_through(dropout) -> bool:
    return isinstance(dropout, torch.nn.Identity) or (
        isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)
    )


def lora_adapters(wrapper: Any, x: torch.Tensor, start: int) -> list[Adapter] | Any:
    """The active adapters of a PEFT LoRA layer wrapping the merged part whose columns start at
    ``start``, for input ``x`` (none when adapters are disabled or merged); NotImplemented for
    anything that is not a PEFT LoRA layer."""
    if not type(wrapper).__module__.startswith("peft."):
        return NotImplemented
    lora_linear = _lora_linear_class()
    if lora_linear is None or not isinstance(wrapper, lora_linear):
        return NotImplemented
    if wrapper.disable_adapters or wrapper.merged:
        return []
    adapters = []
    for name in wrapper.active_adapters:
        if name not in wrapper.lora_A.keys():
            continue
        if name in getattr(wrapper, "lora_variant", {}):
            raise NotImplementedError(
                f"The adapter {name!r} is a {type(wrapper.lora_variant[name]).__name__} (DoRA or another LoRA "
                "variant), which transfuse's merged projections do not support; use plain LoRA, or rewrite the "
                "model without the qkv and gate_up fusions."
            )
        lora_a, lora_b = wrapper.lora_A[name], wrapper.lora_B[name]
        if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear or lora_a.bias is not None:
            raise NotImplementedError(
                f"The adapter {name!r} is not a pair of plain linear layers ({type(lora_a).__name__}, "
                f"{type(lora_b).__name__}); transfuse's merged projections support plain LoRA only."
            )
        dropout = wrapper.lora_dropout[name]
        dtype = lora_a.weight.dtype
        uncast = not getattr(wrapper, "cast_input_dtype_enabled", True) and x.dtype != dtype
        inputs = None  # x cast to the adapter's dtype: the op casts it once for all such adapters
        if uncast or not _passes_through(dropout):
            # The adapter's own input (a dropout mask of its own, or PEFT's casting turned off), as PEFT computes it.
            inputs = dropout(wrapper._cast_input_dtype(x, dtype))
        adapters.append(Adapter(start, lora_a.weight, lora_b.weight, wrapper.scaling[name], lora_b.bias, inputs))
    return adapters
