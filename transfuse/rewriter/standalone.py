"""The forms an emitted directory's runtime (``transfuse_runtime.py``) gives the few ops functions
that need transfuse itself: its dispatch, its ``torch.library`` ops, its plugins, CUDA graphs, or
an integration only transfuse installs.

The runtime is extracted from the ops modules (``transfuse.rewriter.emit_runtime``); where it
reaches a function declared here with ``replaces``, it takes this form instead. A form has its
original's name and parameters and computes what the original computes, in plain PyTorch.

``use_installed`` is the runtime's last step: with a transfuse of the emitting version's major and
minor numbers installed, the names the modeling files import become transfuse's own (its
dispatched kernels, its layers); else the runtime's definitions stay. One log line says which.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from typing import Callable

import torch.nn.functional as F

from ..ops.act_and_mul import act_and_mul
from ..ops.layers import MergedProjection
from ..ops.moe import _looped_matmul
from ..ops.rotary import rotary_native, rotary_one_native

__all__ = ["FORMS", "RUNTIME_MODULE", "replaces", "use_installed"]

# The runtime's module name, beside the modeling files in an emitted directory.
RUNTIME_MODULE = "transfuse_runtime"
# (module, name) of an original -> its form.
FORMS: dict[tuple[str, str], Callable] = {}


def _parameters(fn: Callable) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def replaces(original: str) -> Callable[[Callable], Callable]:
    """Declare the decorated function the runtime's form of ``original`` (``module.name``)."""
    module, _, name = original.rpartition(".")
    found = getattr(importlib.import_module(module), name)

    def record(form: Callable) -> Callable:
        if form.__name__ != name or _parameters(form) != _parameters(found):
            raise TypeError(f"{form.__name__} cannot stand for {original}: a form has its original's name and parameters.")
        FORMS[(module, name)] = form
        return form

    return record


@replaces("transfuse.ops.rotary.rotary")
def rotary(
    q, k, cos, sin, unsqueeze_dim=1, original=None, position_ids=None, indexed=False, *, interleaved=False,
    expand="none", first_half=False, partial=False, upcast=False, cast=False, original_keywords=(),
):  # fmt: skip
    """The model's own function where the call names it (the fuser proved that the op computes
    it), with the call's own arguments; else the native definition."""
    if original is not None:
        tensors = (q, k, cos, sin) if position_ids is None else (q, k, cos, sin, position_ids)
        return original(*tensors, **dict(original_keywords))
    if indexed:
        cos, sin = (t.reshape(t.shape[-2:])[position_ids] for t in (cos, sin))
    return rotary_native(q, k, cos, sin, unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)


@replaces("transfuse.ops.rotary.rotary_one")
def rotary_one(
    x, cos, sin, unsqueeze_dim=1, original=None, sin_first=False, *, interleaved=False, expand="none",
    first_half=False, partial=False, upcast=False, cast=False, original_keywords=(),
):  # fmt: skip
    """The model's own function where the call names it, with the call's own arguments (``(x, sin,
    cos)`` with ``sin_first``); else the native definition."""
    if original is not None:
        return original(*((x, sin, cos) if sin_first else (x, cos, sin)), **dict(original_keywords))
    return rotary_one_native(x, cos, sin, unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)


@replaces("transfuse.ops.act_and_mul.act_and_mul_linear")
def act_and_mul_linear(linear, x, activation):
    """``linear(act_and_mul(x, activation))``, the same numbers; a training step keeps the product
    for the linear layer's gradient, as the unfused model does."""
    return linear(act_and_mul(x, activation))


@replaces("transfuse.ops.moe_layer._decode_graphs")
def _decode_graphs(layer, hidden_states, plan, routing, numbers):
    """No CUDA graphs: every call computes."""
    return None


@replaces("transfuse.ops.moe._opaque_grouped_matmul")
def _opaque_grouped_matmul(rows, matrix, offsets):
    """One matmul per expert; compiled code breaks its graph here (the group sizes are data)."""
    return _looped_matmul(rows, matrix, offsets)


@replaces("transfuse.ops.low_rank.linear_with_adapters")
def linear_with_adapters(x, weight, bias, adapters):
    """The merged projection alone: adapters on its parts come from transfuse's PEFT integration."""
    if adapters:
        raise NotImplementedError("Adapters on a merged projection need transfuse installed (its PEFT integration).")
    return F.linear(x, weight, bias)


@replaces("transfuse.ops.layers.layer")
def layer(name):
    """The merged projection's class as defined here (a plugin's replacement needs transfuse)."""
    if name != "MergedProjection":
        raise KeyError(f"The emitted runtime has no layer {name!r}; it builds merged projections only.")
    return MergedProjection


@replaces("transfuse.ops.linear_cross_entropy.causal_lm_loss")
def causal_lm_loss(
    head, hidden_states, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, *,
    transform=None, **kwargs,
):  # fmt: skip
    """transformers' ``ForCausalLMLoss`` of the head's logits (transformed), as the unfused model
    computes it: with the whole logits tensor."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = head(hidden_states)
    if transform is not None:
        logits = transform(logits)
    return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)


_log = logging.getLogger(__name__)


def _major_minor(version: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def use_installed(namespace: dict, names: dict[str, str], emitted_by: str) -> bool:
    """Where transfuse is installed with ``emitted_by``'s major and minor numbers, put its own objects
    in ``namespace`` (the runtime's globals) under ``names`` (name -> the transfuse module holding
    it) and return True; else leave the runtime's definitions there. One log line says which."""
    try:  # by name: the emitted runtime carries this function, and transfuse may be absent
        installed = str(getattr(importlib.import_module("transfuse"), "__version__", "unknown"))
    except ImportError:
        _log.info(f"transfuse is not installed: {RUNTIME_MODULE}.py runs its native PyTorch definitions (no fused kernels).")
        return False
    if _major_minor(installed) is None or _major_minor(installed) != _major_minor(emitted_by):
        _log.warning(
            f"transfuse {installed} is installed, but this model was emitted by transfuse {emitted_by}: it runs the "
            f"native PyTorch definitions of {RUNTIME_MODULE}.py, not transfuse's kernels. Install transfuse "
            f"{'.'.join(emitted_by.split('.')[:2])}.x, or emit the model again with transfuse {installed}, to use them."
        )
        return False
    try:
        found = {name: getattr(importlib.import_module(module), name) for name, module in names.items()}
    except (ImportError, AttributeError) as exc:
        _log.warning(f"transfuse {installed} lacks what this model uses ({exc}): it runs {RUNTIME_MODULE}.py's definitions.")
        return False
    namespace.update(found)
    _log.info(f"transfuse {installed} is installed: this model calls its dispatched kernels.")
    return True
