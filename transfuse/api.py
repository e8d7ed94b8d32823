"""The public entry points: ``rewrite`` a model in place and read its ``report``."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from . import settings
from .fusers import FUSERS, fusers_for
from .rewriter.apply import REPORT_ATTR, ExampleInputsError, RewriteError, rewrite_model, rewrites_of
from .rewriter.report import RewriteReport

__all__ = ["ExampleInputsError", "RewriteError", "diff", "report", "rewrite"]

M = TypeVar("M", bound=nn.Module)


def rewrite(
    model: M,
    *,
    fusions: list[str] | None = None,
    verify: bool = True,
    example_inputs: Any = None,
) -> M:
    """Rewrite ``model`` in place to call fused kernels, and return the same object.

    fusions: kinds to apply (``transfuse.fusers.kinds()``); by default all but the opt-in ones
        (``linear_cross_entropy``, which the report then says where it would apply).
    verify: compare each fused module, and the whole model, with the original on a short
        random probe input, and undo any fusion whose output differs (see ``report``).
    example_inputs: the probe input, as a tuple of positional arguments or a dict of
        keyword arguments; by default random token ids, for models with a vocabulary.

    A TRANSFUSE_* environment variable with a bad value is an error here, before any work
    (``transfuse.settings``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"rewrite() takes a torch.nn.Module, not {type(model).__name__}.")
    settings.validate()
    chosen = fusers_for(fusions)
    suggest = [f for f in FUSERS if f.opt_in and f not in chosen]
    rewrite_model(model, chosen, verify=verify, example_inputs=example_inputs, suggest=suggest)
    # ``generate`` on the rewritten model may replay its decode steps as CUDA graphs (on a GPU,
    # unless TRANSFUSE_STEP_GRAPHS=0: ``transfuse/compile/eager_steps.py``).
    from .compile import eager_steps

    eager_steps.install()
    return model


def report(model: nn.Module) -> RewriteReport:
    """What ``rewrite`` did to ``model``: fusions made, fusions refused with reasons, verification."""
    found = getattr(model, REPORT_ATTR, None)
    if found is None:
        raise ValueError(f"This {type(model).__name__} has not been rewritten; call transfuse.rewrite(model) first.")
    return found


def diff(model: nn.Module, context: int = 3) -> str:
    """What ``rewrite`` changed in the source: a unified diff per rewritten class, with real
    file names and line numbers. Empty when only modules were swapped (e.g. norms)."""
    report(model)  # raises for a model that was never rewritten
    return "".join(rewrite.diff(context) for rewrite in rewrites_of(model))
