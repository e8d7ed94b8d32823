"""Integrations with other libraries, one file per library; none is imported until it is needed.

The core never imports these libraries: an integration registers a hook the core calls, and
imports its library only when an object of that library reaches it (``peft``: a LoRA adapter
wrapping a projection that transfuse merged).
"""

from __future__ import annotations

from .. import api
from ..ops.layers import MergedProjection
from .peft import lora_adapters
from .tensor_parallel import plan_merged_projections

__all__ = ["install"]


def install() -> None:
    """Register every integration's hooks (cheap: nothing is imported)."""
    MergedProjection.part_hook = staticmethod(lora_adapters)
    if plan_merged_projections not in api.AFTER_REWRITE:
        api.AFTER_REWRITE.append(plan_merged_projections)


install()
