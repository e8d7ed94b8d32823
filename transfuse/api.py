"""The public entry points: ``rewrite`` a model in place and read its ``report``.

A rewrite changes the model and nothing else in the process: what runs around it (decode steps,
compilation, CUDA graphs) is the caller's choice, through ``transfuse.decode_steps`` and
``transfuse.compile``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from . import census, settings
from .ops import batch_invariant as invariance
from .fusers import FUSERS, fusers_for
from .rewriter.apply import REPORT_ATTR, ExampleInputsError, RewriteError, rewrite_model, rewrites_of
from .rewriter.report import RewriteReport

__all__ = ["DECODE_STEPS_NOTE", "ExampleInputsError", "RewriteError", "diff", "is_rewritten", "report", "rewrite"]

M = TypeVar("M", bound=nn.Module)

# Called with each rewritten model, after the rewrite: an integration's bookkeeping of what the rewrite
# made (``transfuse.integrations.tensor_parallel`` names the merged projections in the model's plan).
# Set by ``transfuse.integrations``; each returns nothing and changes only the model.
AFTER_REWRITE: list = []

# The report's note on a model that generates: how to get the decode steps, which a rewrite leaves off.
DECODE_STEPS_NOTE = (
    "decode steps: transfuse.decode_steps(model) runs generate's decode steps as CUDA graphs on a GPU; "
    "transfuse.AutoModelForCausalLM does so for the models it loads, a plain rewrite does not"
)


def rewrite(
    model: M,
    *,
    fusions: list[str] | None = None,
    verify: bool = True,
    example_inputs: Any = None,
    batch_invariant: bool | None = None,
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
    found = census.count(model)
    made = rewrite_model(model, chosen, verify=verify, example_inputs=example_inputs, suggest=suggest)
    if made.not_rewritten is None:  # no silent skip: what no fuser recognised is refused out loud
        census.account(found, made, kinds=[f.kind for f in chosen])
    for hook in AFTER_REWRITE:
        hook(model)
    if callable(getattr(type(model), "generate", None)):
        made.notes.append(DECODE_STEPS_NOTE)
    if batch_invariant is None:
        batch_invariant = settings.value("TRANSFUSE_BATCH_INVARIANT")
    if batch_invariant:
        made.batch_invariant = invariance.enable(model).found
        _probe_invariance(model, example_inputs)
    elif invariance.is_enabled(model):
        invariance.disable(model)
    return model


def _probe_invariance(model: nn.Module, example_inputs: Any) -> None:
    """One forward in the mode on the probe input, so the report lists from the start what the
    model calls that the mode does not make invariant (later forwards add what they meet)."""
    import torch

    from .rewriter.capture import ProbeUnavailable, make_probe

    try:
        probe = make_probe(model, example_inputs)
    except ProbeUnavailable:
        return
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(*probe.args, **probe.kwargs)
    except Exception:  # the rewrite's own probe said what it could; this one only looks  # noqa: BLE001
        pass
    finally:
        model.train(was_training)


def is_rewritten(model: nn.Module) -> bool:
    """Whether ``transfuse.rewrite`` ran on ``model`` (then ``report`` says what it did, which may be nothing)."""
    return getattr(model, REPORT_ATTR, None) is not None


def report(model: nn.Module) -> RewriteReport:
    """What ``rewrite`` did to ``model``: fusions made, fusions refused with reasons, verification."""
    if not is_rewritten(model):
        raise ValueError(f"This {type(model).__name__} has not been rewritten; call transfuse.rewrite(model) first.")
    return getattr(model, REPORT_ATTR)


def diff(model: nn.Module, context: int = 3) -> str:
    """What ``rewrite`` changed in the source: a unified diff per rewritten class, with real
    file names and line numbers. Empty when only modules were swapped (e.g. norms)."""
    report(model)  # raises for a model that was never rewritten
    return "".join(rewrite.diff(context) for rewrite in rewrites_of(model))
