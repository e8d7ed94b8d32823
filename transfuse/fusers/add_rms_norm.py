"""Residual add and RMSNorm: ``h = r + h; r = h; h = self.norm(h)`` → ``h, r = add_rms_norm(self.norm, r, h)``.

A pre-norm decoder layer adds each block's output to the residual stream, keeps the sum as the
new residual and normalises it for the next block. ``fused_add_rms_norm`` does both in one kernel,
reading the two summands once and writing the sum and the normalised value once, where the model's
code writes the sum and then reads it again (on a GPU: one kernel and one torch op fewer per site,
forward and backward).

The graph says which children are norms: a child called on the output of an addition whose own
class the RMSNorm fuser matches (by dataflow, as it matches any norm). The source proves the rest:
three sibling statements, ``T = A + B`` (two names), ``R = T`` and ``T = self.<norm>(T)``, with
nothing between them. Together they leave the sum in ``R`` and its norm in ``T``, and that is what
the one statement put in their place assigns.

At run time ``ops.add_rms_norm`` takes the fused op only where it computes exactly those
statements: the norm is transfuse's plain ``RMSNorm`` layer (the RMSNorm fusion made it so) with no
hooks to run, and the summands are plain tensors of one shape and dtype. Anything else runs the
three statements as written (a norm left unfused, a hooked norm, a residual kept in float32).
Only the adds beside a norm fuse: the add that ends a layer is followed by the next layer's norm
in another module's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
import torch.fx as fx
from torch import nn

from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Fused, Refusal, SourceFuser
from ..rewriter.graph import NoMatch, is_op, operands
from ..rewriter.source import EditContext
from ..rewriter.syntax import comment_line
from .rms_norm import RMSNormFuser, RMSNormMatch

__all__ = ["AddRMSNormFuser", "AddRMSNormMatch"]

_RMS_NORM = RMSNormFuser()


@dataclass(frozen=True)
class AddRMSNormMatch:
    """The children (direct, by attribute name) that normalise a sum, in graph order, with what the
    RMSNorm fuser found in each one's class."""

    found: tuple[tuple[str, RMSNormMatch], ...]

    @property
    def norms(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.found)


class AddRMSNormFuser(SourceFuser[AddRMSNormMatch]):
    kind = "add_rms_norm"
    requires = ("rms_norm",)  # the fused op runs where the RMSNorm fusion made the norm its layer

    def wants(self, module: nn.Module) -> bool:
        return any(_RMS_NORM.wants(child) for child in module.children())

    def match(self, analysis: ClassAnalysis) -> AddRMSNormMatch | None:
        found: dict[str, RMSNormMatch] = {}
        for node in analysis.trace.graph.nodes:
            if node.op != "call_module" or "." in str(node.target) or str(node.target) in found:
                continue
            if len(node.args) != 1 or node.kwargs or not _is_sum(node.args[0]):
                continue
            child = analysis.child(str(node.target))
            verdict = child.verdict(_RMS_NORM) if child is not None else None
            # A plain norm: a gated one becomes another layer, which the fused op does not stand for.
            if isinstance(verdict, RMSNormMatch) and verdict.gate is None and not verdict.gate_first:
                found[str(node.target)] = verdict
        return AddRMSNormMatch(tuple(found.items())) if found else None

    def validate(self, module: nn.Module, found: AddRMSNormMatch) -> Refusal | None:
        # Each norm must become the RMSNorm layer, or the call site would run the statements as
        # written and the report would count a fusion that is not made.
        for name, norm_found in found.found:
            refusal = _RMS_NORM.validate(getattr(module, name), norm_found)
            if refusal is not None:
                return Refusal(
                    "add_rms_norm.norm", f"{name} is not fused by the RMSNorm fusion here ({refusal.reason})", refusal.where
                )
        return None

    def edit(self, tree: cst.FunctionDef, found: AddRMSNormMatch, context: EditContext) -> cst.FunctionDef:
        fused = _Fuse(set(found.norms), lambda: context.require("transfuse.ops", "add_rms_norm"))
        edited = tree.visit(fused)
        if not fused.sites:
            raise NoMatch(
                "add_rms_norm.placement",
                f"no sum is kept as the residual and normalised by {', '.join(found.norms)} in three sibling "
                "statements (T = A + B; R = T; T = self.norm(T)).",
            )
        return edited

    def declaration(self, found: AddRMSNormMatch) -> None:
        return None  # no module changes: the edited forward is the whole fusion

    def fuse(self, module: nn.Module, found: AddRMSNormMatch) -> Fused:
        return Fused(replaced=found.norms, into="fused_add_rms_norm")


def _is_sum(node) -> bool:
    """An addition of two traced tensors (no constant, no ``alpha``)."""
    if not (isinstance(node, fx.Node) and is_op(node, "add") and not node.kwargs):
        return False
    args = operands(node)
    return len(args) == 2 and all(isinstance(a, fx.Node) for a in args)


_NAME = m.Name()


def _assigned_name(statement: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    """``(name, value)`` of a statement line that is one plain ``name = value``."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return None
    assign = statement.body[0]
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)):
        return None
    return assign.targets[0].target.value, assign.value


class _Fuse(cst.CSTTransformer):
    """Replaces each ``T = A + B; R = T; T = self.<norm>(T)`` run of sibling statements."""

    def __init__(self, norms: set[str], op_name):
        self.norms = norms
        self.op_name = op_name
        self.sites = 0

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        return updated.with_changes(body=self._fused(list(updated.body)))

    def _fused(self, body: list) -> list:
        out, i = [], 0
        while i < len(body):
            replacement = self._site(body[i : i + 3]) if i + 3 <= len(body) else None
            if replacement is None:
                out.append(body[i])
                i += 1
                continue
            out.append(replacement)
            self.sites += 1
            i += 3
        return out

    def _site(self, statements: list) -> cst.SimpleStatementLine | None:
        first, second, third = (_assigned_name(s) for s in statements)
        if first is None or second is None or third is None:
            return None
        (total, summed), (residual, alias), (normed, call) = first, second, third
        if not (m.matches(summed, m.BinaryOperation(left=_NAME, operator=m.Add(), right=_NAME))):
            return None
        if not (m.matches(alias, m.Name(total)) and residual != total and normed == total):
            return None
        if not m.matches(call, m.Call(func=m.Attribute(value=m.Name("self"), attr=_NAME), args=[m.Arg(value=m.Name(total))])):
            return None
        arg = call.args[0]
        norm = call.func.attr.value
        if norm not in self.norms or arg.keyword is not None or arg.star:
            return None
        left, right = summed.left.value, summed.right.value
        code = f"{normed}, {residual} = {self.op_name()}(self.{norm}, {left}, {right})"
        line = cst.parse_statement(code)
        # The three statements' comments stay, above the one that replaces them.
        kept = [*statements[0].leading_lines, *statements[1].leading_lines, *statements[2].leading_lines]
        note = comment_line(f"transfuse: the residual add and {norm} run as one fused_add_rms_norm")
        return line.with_changes(leading_lines=[*kept, note])
