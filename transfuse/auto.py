"""Drop-in loading: transformers' ``from_pretrained``, returning a rewritten model with its decode steps on.

The checkpoint loads exactly as transformers loads it (``device_map``, ``dtype``,
``trust_remote_code`` and every other argument behave as there); the rewrite then fuses
in place, and ``transfuse.decode_steps`` turns on the model's decode steps. Merging a group of projections allocates the merged tensor before the
originals are freed, so the peak memory exceeds transformers' own by the largest merged
group (less than one layer's weights).
"""

from __future__ import annotations

import warnings
from typing import Any

from . import settings
from .api import rewrite
from .compile.eager_steps import decode_steps

__all__ = ["AutoModelForCausalLM", "from_pretrained"]


class AutoModelForCausalLM:
    """Like ``transformers.AutoModelForCausalLM``, with the models it returns rewritten.

    Extra keyword arguments: ``fusions``, ``verify`` and ``batch_invariant``, as for ``transfuse.rewrite``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("Use transfuse.AutoModelForCausalLM.from_pretrained(...) or .from_config(...).")

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *model_args, fusions: list[str] | None = None, verify: bool = True,
        batch_invariant: bool | None = None, **kwargs,
    ):  # fmt: skip
        """Load as ``transformers.AutoModelForCausalLM.from_pretrained`` does (every argument means what
        it means there: ``dtype``, ``device_map``, ``trust_remote_code``, ``gguf_file``, ...), then
        ``transfuse.rewrite`` the model in place with ``fusions`` (the default kinds when None),
        ``verify`` and ``batch_invariant``, and turn on its decode steps (``transfuse.decode_steps``). Where the rewrite cannot be made (no probe runs, an error part-way), a warning
        says why and the stock model is returned: loading never fails because of transfuse. Progress
        follows transformers' logging (``transformers.logging.disable_progress_bar()`` hides the bars).
        Bad arguments (an unknown fusion kind, a bad TRANSFUSE_* variable) are errors before loading."""
        from transformers import AutoModelForCausalLM as TransformersAuto

        _check_arguments(fusions)
        loaded = TransformersAuto.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if kwargs.get("output_loading_info"):  # (model, loading info), as transformers returns it
            model, info = loaded
            return _rewritten_or_stock(model, fusions, verify, batch_invariant), info
        return _rewritten_or_stock(loaded, fusions, verify, batch_invariant)

    @classmethod
    def from_config(
        cls, config, *, fusions: list[str] | None = None, verify: bool = True, batch_invariant: bool | None = None,
        **kwargs,
    ):  # fmt: skip
        """Build as ``transformers.AutoModelForCausalLM.from_config(config, **kwargs)`` does (random
        weights), then rewrite it as ``from_pretrained`` does."""
        from transformers import AutoModelForCausalLM as TransformersAuto

        _check_arguments(fusions)
        model = TransformersAuto.from_config(config, **kwargs)
        return _rewritten_or_stock(model, fusions, verify, batch_invariant)


def _check_arguments(fusions) -> None:
    """Raise for unknown fusion kinds and bad TRANSFUSE_* variables."""
    from .fusers import fusers_for

    fusers_for(fusions)
    settings.validate()


def _rewritten_or_stock(model, fusions, verify, batch_invariant=None):
    """The rewritten model, its decode steps on; where the rewrite cannot be made (no probe runs, an error part-way,
    after which the model is as it was), a warning and the stock model: loading never fails
    because of transfuse."""
    try:
        rewrite(model, fusions=fusions, verify=verify, batch_invariant=batch_invariant)
    except Exception as exc:
        warnings.warn(
            f"transfuse: {type(model).__name__} was loaded unchanged, because the rewrite failed: "
            f"{type(exc).__name__}: {exc}",
            stacklevel=3,
        )
        return model
    return decode_steps(model)


def from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs):
    """``transfuse.AutoModelForCausalLM.from_pretrained``."""
    return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
