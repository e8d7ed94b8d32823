"""Drop-in loading: transformers' ``from_pretrained``, returning a rewritten model.

The checkpoint loads exactly as transformers loads it (``device_map``, ``dtype``,
``trust_remote_code`` and every other argument behave as there); the rewrite then fuses
in place. Merging a group of projections allocates the merged tensor before the
originals are freed, so the peak memory exceeds transformers' own by the largest merged
group (less than one layer's weights).
"""

from __future__ import annotations

from typing import Any

from .api import rewrite

__all__ = ["AutoModelForCausalLM", "from_pretrained"]


class AutoModelForCausalLM:
    """Like ``transformers.AutoModelForCausalLM``, with the models it returns rewritten.

    Extra keyword arguments: ``fusions`` and ``verify``, as for ``transfuse.rewrite``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("Use transfuse.AutoModelForCausalLM.from_pretrained(...) or .from_config(...).")

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *model_args, fusions: list[str] | None = None, verify: bool = True, **kwargs
    ):
        from transformers import AutoModelForCausalLM as TransformersAuto

        model = TransformersAuto.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return rewrite(model, fusions=fusions, verify=verify)

    @classmethod
    def from_config(cls, config, *, fusions: list[str] | None = None, verify: bool = True, **kwargs):
        from transformers import AutoModelForCausalLM as TransformersAuto

        model = TransformersAuto.from_config(config, **kwargs)
        return rewrite(model, fusions=fusions, verify=verify)


def from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs):
    """``transfuse.AutoModelForCausalLM.from_pretrained``."""
    return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
