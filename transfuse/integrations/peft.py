"""PEFT: LoRA adapters on projections that transfuse merged.

A rewrite keeps each merged projection under its name as a ``LinearPart`` (an ``nn.Linear``
view of its rows), so ``get_peft_model(model, LoraConfig(target_modules=[...]))`` finds
``q_proj`` and ``gate_proj`` as on the stock model (``all-linear`` too, and the model type's
default targets) and wraps them. The merged projection still runs one matmul for all its parts
and adds each wrapped part's adapter output to that part's columns (``lora_part_delta``), so
training updates the adapters, ``save_pretrained`` writes PEFT's own keys
(``...q_proj.lora_A.weight``), which stock PEFT loads onto the stock model, and
``merge_and_unload`` merges each adapter into its part's rows of the merged weight.

Plain LoRA only: DoRA and PEFT's other variants, and mixed-adapter batches, raise a clear error.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["lora_part_delta"]


def _lora_linear_class() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def lora_part_delta(wrapper: Any, x: torch.Tensor) -> torch.Tensor | None | Any:
    """What a PEFT LoRA layer wrapping a merged part adds to the part's output for input ``x``
    (None when it adds nothing: adapters disabled or merged); NotImplemented for anything else."""
    if not type(wrapper).__module__.startswith("peft."):
        return NotImplemented
    lora_linear = _lora_linear_class()
    if lora_linear is None or not isinstance(wrapper, lora_linear):
        return NotImplemented
    if wrapper.disable_adapters or wrapper.merged:
        return None
    delta = None
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
        inputs = wrapper._cast_input_dtype(x, lora_a.weight.dtype)
        out = lora_b(lora_a(wrapper.lora_dropout[name](inputs))) * wrapper.scaling[name]
        delta = out if delta is None else delta + out
    return delta
