"""What the projection-merging fusers (qkv, gate_up) share: linear children, a free name for
the merged child, and the proof that a projection is called exactly once and nowhere else."""

from __future__ import annotations

import libcst as cst
from torch import nn

from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Refusal
from ..rewriter.graph import NoMatch
from ..rewriter.source import EditContext, self_calls, self_references

__all__ = ["adapter_refusal", "free_child_name", "linear_children", "single_call", "wrapped_children"]


def linear_children(analysis: ClassAnalysis) -> set[str]:
    """Names of the class's children that are ``nn.Linear`` (or a subclass)."""
    return {name for name, cls in analysis.children.items() if issubclass(cls, nn.Linear)}


def wrapped_children(analysis: ClassAnalysis) -> set[str]:
    """Children that wrap a layer with an adapter (PEFT's tuner layers, which have ``get_base_layer``)."""
    return {name for name, cls in analysis.children.items() if hasattr(cls, "get_base_layer")}


def adapter_refusal(analysis: ClassAnalysis, kind: str, projections: list[str]) -> Refusal | None:
    """Projections to merge of which some already carry adapters: the merge would drop them, so it
    is refused, with the way round."""
    wrapped = sorted(set(projections) & wrapped_children(analysis))
    if not wrapped:
        return None
    return Refusal(
        f"{kind}.adapter",
        f"{', '.join(wrapped)} already carr{'ies' if len(wrapped) == 1 else 'y'} adapters "
        f"({analysis.children[wrapped[0]].__name__}); merging would drop them. Rewrite the model first and add "
        "the adapters after: merged projections carry them.",
        analysis.where(),
    )


def free_child_name(analysis: ClassAnalysis, base: str) -> str:
    """``base``, or ``base_2``, ... : a name no child of the class has."""
    name, i = base, 1
    while name in analysis.children:
        i += 1
        name = f"{base}_{i}"
    return name


def single_call(tree: cst.FunctionDef, name: str, context: EditContext, kind: str) -> cst.Call:
    """The one call ``self.<name>(arg)``; refused if the projection is called or used otherwise."""
    calls = self_calls(tree, name)
    if len(calls) != 1:
        tag = f"{kind}.called-twice" if calls else f"{kind}.not-called"
        raise NoMatch(tag, f"self.{name}(...) is written {len(calls)} times in {tree.name.value}, not once.")
    if len(self_references(tree, name)) != 1:
        raise NoMatch(f"{kind}.other-use", f"self.{name} is used other than in its one call.")
    line = context.uses_elsewhere(name)
    if line is not None:
        raise NoMatch(f"{kind}.other-use", f"self.{name} is also used by another method (line {line}).")
    call = calls[0]
    if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
        raise NoMatch(f"{kind}.input-expression", f"self.{name} is not called with one positional argument.")
    return call
