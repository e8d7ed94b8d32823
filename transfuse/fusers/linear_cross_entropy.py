"""Linear cross-entropy: ``logits = self.head(h)`` [``logits = t(logits)``] ``loss = self.loss_function(logits, ...)``
→ in training with labels, ``loss = causal_lm_loss(self.head, h, ..., transform=t)`` and no logits.

The output projection whose logits feed the causal-LM loss is found by dataflow in the model's
own graph (traced with labels): a ``cross_entropy`` whose input is, through casts and views, an
elementwise transform (scales, ``tanh`` soft-capping) of one linear child's output. The loss
function itself is transformers' ``ForCausalLMLoss`` (checked per instance: it decides the label
shift, ``ignore_index``, ``num_items_in_batch`` and ``shift_labels``), and
``transfuse.ops.causal_lm_loss`` computes exactly it, chunk by chunk, without the logits.

The edit is proved on the syntax tree: the head is called once, ``L = self.head(E)`` with ``E`` a
name, attribute or subscript (evaluated in either branch, so it must have no side effect); the
statements after it only rebind ``L`` from ``L`` (optionally under an ``if`` that does not read
``L``); then ``X = None`` (optional) and ``if <test>: X = self.loss_function(...)`` with ``L``
among its arguments; after that ``L`` appears only in ``return`` statements. The edit puts all of
it under ``else:`` of ``if self.training and <test>:``, whose branch computes the loss with the
rebinding statements as a local ``transform`` and sets ``L`` to None: in eval mode, without
labels, and in ``generate`` the model runs its own code.

Opt-in (``fusions=[..., "linear_cross_entropy"]``), because it changes what the model returns in
training with labels: ``.logits`` is None there.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
import torch.fx as fx
from torch import nn

from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Fused, Refusal, SourceFuser
from ..rewriter.graph import NoMatch, is_op, op_name, operand, operands, peel_casts, value
from ..rewriter.source import EditContext, self_calls
from ..rewriter.syntax import ParentMap, comment_line, expression_code, statement_block
from .projections import linear_children

__all__ = ["LinearCrossEntropyFuser", "LinearCrossEntropyMatch"]


@dataclass(frozen=True)
class LinearCrossEntropyMatch:
    """The output projection and the transforms of its logits the graph showed (for the report)."""

    head: str
    transforms: tuple[str, ...]


# Ops the logits may go through between the projection and the loss: elementwise with constants.
_ELEMENTWISE = {"mul", "div", "add", "sub", "tanh", "neg"}
_LAYOUT = {"view", "reshape", "contiguous", "flatten"}


class LinearCrossEntropyFuser(SourceFuser[LinearCrossEntropyMatch]):
    kind = "linear_cross_entropy"
    opt_in = True
    changes_training = True

    def wants(self, module: nn.Module) -> bool:
        forward = getattr(type(module), "forward", None)
        try:
            takes_labels = forward is not None and "labels" in inspect.signature(forward).parameters
        except (TypeError, ValueError):
            return False
        return takes_labels and any(isinstance(c, nn.Linear) for c in module.children())

    def match(self, analysis: ClassAnalysis) -> LinearCrossEntropyMatch | Refusal | None:
        losses = [n for n in analysis.trace.graph.nodes if is_op(n, "cross_entropy")]
        if not losses:
            return None
        try:
            return _match_loss(losses[0], linear_children(analysis))
        except NoMatch as refusal:
            return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node))

    def validate(self, module: nn.Module, found: LinearCrossEntropyMatch) -> Refusal | None:
        loss = getattr(module, "loss_function", None)
        if not _is_causal_lm_loss(loss):
            return Refusal(
                "linear_cross_entropy.loss-function",
                f"the model's loss_function is {getattr(loss, '__qualname__', loss)!r}, not transformers' "
                "ForCausalLMLoss, whose label shift and reduction the fused loss computes.",
            )
        return None

    def edit(self, tree: cst.FunctionDef, found: LinearCrossEntropyMatch, context: EditContext) -> cst.FunctionDef:
        return _edit(tree, found, context)

    def declaration(self, found: LinearCrossEntropyMatch) -> None:
        return None  # no child changes: loading needs nothing declared

    def fuse(self, module: nn.Module, found: LinearCrossEntropyMatch) -> Fused:
        return Fused(replaced=(found.head,), into="causal_lm_loss", undo=lambda: None)

    def suggestion(self, module: nn.Module, found: LinearCrossEntropyMatch) -> str:
        """What the report of a rewrite without this kind says it would save."""
        vocab = getattr(getattr(module, found.head), "out_features", None)
        if not isinstance(vocab, int):
            return ""
        per_token = 12 * vocab  # in bf16: the logits, their float32 copy and its gradient, the bf16 gradient
        return (
            f"{self.kind} is available for {type(module).__name__} (opt in with fusions=[..., '{self.kind}']): in "
            f"training with labels it never holds the [tokens, {vocab}] logits and their gradients, in bf16 about "
            f"{_size(per_token)} a token ({_size(per_token * 8192)} at 8192 tokens); .logits is None there."
        )


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _is_causal_lm_loss(loss) -> bool:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    return loss is ForCausalLMLoss


def _match_loss(loss: fx.Node, linears: set[str]) -> LinearCrossEntropyMatch:
    node = operand(loss, 0)
    while isinstance(node, fx.Node) and (op_name(node) in _LAYOUT or peel_casts(node)[1]):
        node = peel_casts(node)[0] if peel_casts(node)[1] else operand(node, 0)
    transforms = []
    while isinstance(node, fx.Node) and op_name(node) in _ELEMENTWISE:
        # Constants: numbers, and scalar attributes of self (Cohere's logit_scale), which are nodes.
        tensors = [a for a in operands(node) if isinstance(a, fx.Node) and not isinstance(value(a), (int, float))]
        if len(tensors) != 1 or node.kwargs:
            raise NoMatch(
                "linear_cross_entropy.transform",
                f"the logits go through {op_name(node)} with another tensor before the loss; only elementwise "
                "transforms by constants are computed chunk by chunk.",
                node,
            )
        transforms.append(op_name(node))
        node = tensors[0]
    if not (isinstance(node, fx.Node) and node.op == "call_module" and node.target in linears):
        what = op_name(node) or getattr(node, "op", type(node).__name__)
        raise NoMatch(
            "linear_cross_entropy.logits",
            f"the loss reads {what}, not an output projection's logits (elementwise transforms aside).",
            node if isinstance(node, fx.Node) else None,
        )
    return LinearCrossEntropyMatch(node.target, tuple(reversed(transforms)))


# ---- the source edit ----------------------------------------------------------------------------


def _assigned_name(statement: cst.CSTNode) -> str | None:
    """``name`` of a one-target assignment line ``name = ...``."""
    if m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
        return statement.body[0].targets[0].target.value
    return None


def _reads(node: cst.CSTNode, name: str) -> bool:
    return bool(m.findall(node, m.Name(name)))


def _rebinds_only(statement: cst.CSTNode, name: str) -> bool:
    """``name = <expression of name>``, or an ``if`` (no else) whose test does not read ``name`` and
    whose body is only such lines."""
    if _assigned_name(statement) == name:
        return _reads(statement.body[0].value, name)
    if isinstance(statement, cst.If) and statement.orelse is None and not _reads(statement.test, name):
        return all(_rebinds_only(s, name) for s in statement.body.body)
    return False


def _loss_call(statement: cst.CSTNode, logits: str) -> tuple[cst.If, cst.Call, str] | None:
    """``if <test>: X = self.loss_function(...)`` reading ``logits``: (the if, the call, X)."""
    if not (isinstance(statement, cst.If) and statement.orelse is None and len(statement.body.body) == 1):
        return None
    line = statement.body.body[0]
    target = _assigned_name(line)
    if target is None:
        return None
    call = line.body[0].value
    if not m.matches(call, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("loss_function")))):
        return None
    return statement, call, target


def _edit(tree: cst.FunctionDef, found: LinearCrossEntropyMatch, context: EditContext) -> cst.FunctionDef:
    calls = self_calls(tree, found.head)
    if len(calls) != 1 or len(calls[0].args) != 1 or calls[0].args[0].keyword is not None:
        raise NoMatch("linear_cross_entropy.placement", f"self.{found.head} is not called exactly once, on one argument.")
    head_call = calls[0]
    hidden = head_call.args[0].value
    if m.findall(hidden, m.Call()) or not isinstance(hidden, (cst.Name, cst.Attribute, cst.Subscript)):
        raise NoMatch(
            "linear_cross_entropy.placement",
            f"the head reads {expression_code(hidden)}, which would be evaluated in two branches.",
        )
    parents = ParentMap(tree)
    statement = parents.statement(head_call)
    logits = _assigned_name(statement)
    if logits is None or statement.body[0].value is not head_call:
        raise NoMatch("linear_cross_entropy.placement", f"self.{found.head}(...) is not assigned alone to a name.")
    block, first = statement_block(parents, statement)
    body = list(block.body)
    index = first + 1
    while index < len(body) and _rebinds_only(body[index], logits):
        index += 1
    transforms = body[first + 1 : index]
    if index < len(body) and _assigned_name(body[index]) is not None and m.matches(
        body[index].body[0].value, m.Name("None")
    ):
        index += 1
    loss = _loss_call(body[index], logits) if index < len(body) else None
    if loss is None:
        raise NoMatch(
            "linear_cross_entropy.placement",
            f"the statements after {logits} = self.{found.head}(...) are not its transforms, then "
            "`if ...: loss = self.loss_function(...)`.",
        )
    condition, call, loss_name = loss
    passed = [i for i, arg in enumerate(call.args) if m.matches(arg.value, m.Name(logits))]
    if len(passed) != 1 or _reads(condition.test, logits):
        raise NoMatch("linear_cross_entropy.loss-call", f"the loss call does not take {logits} exactly once.")
    position = passed[0]
    if call.args[position].keyword is not None and call.args[position].keyword.value != "logits":
        raise NoMatch("linear_cross_entropy.loss-call", f"{logits} is passed to the loss as another argument.")
    if call.args[position].keyword is None and position != 0:
        raise NoMatch("linear_cross_entropy.loss-call", f"{logits} is not the loss call's first argument.")
    for later in body[index + 1 :]:
        for use in m.findall(later, m.Name(logits)):
            if not any(isinstance(a, cst.Return) for a in parents.ancestors(use)):
                raise NoMatch(
                    "linear_cross_entropy.logits-used",
                    f"{logits} is used after the loss other than in the returned value.",
                )
    return _build(tree, block, first, index, found, context, hidden, logits, transforms, condition, call, loss_name, position)


def _build(tree, block, first, last, found, context, hidden, logits, transforms, condition, call, loss_name, position):
    loss_op = context.require("transfuse.ops", "causal_lm_loss")
    args = [arg for i, arg in enumerate(call.args) if i != position]
    fused_args = [cst.Arg(cst.parse_expression(f"self.{found.head}")), cst.Arg(hidden), *args]
    branch: list[cst.BaseStatement] = []
    if transforms:
        name = context.fresh_name("logits_transform")
        function = cst.FunctionDef(
            name=cst.Name(name),
            params=cst.Parameters(params=[cst.Param(cst.Name(logits))]),
            body=cst.IndentedBlock(body=[*transforms, cst.parse_statement(f"return {logits}")]),
        )
        branch.append(function)
        tight = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
        fused_args.append(cst.Arg(cst.Name(name), keyword=cst.Name("transform"), equal=tight))
    fused_args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in fused_args]
    fused_call = cst.Call(func=cst.Name(loss_op), args=fused_args)
    branch.append(cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(loss_name))], fused_call)]))
    branch.append(cst.parse_statement(f"{logits} = None"))
    original = list(block.body[first : last + 1])
    original[0] = original[0].with_changes(leading_lines=[])
    test = cst.BooleanOperation(
        left=cst.parse_expression("self.training"),
        operator=cst.And(),
        right=condition.test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        if isinstance(condition.test, cst.BooleanOperation)
        else condition.test,
    )
    fused = cst.If(
        test=test,
        body=cst.IndentedBlock(body=branch),
        orelse=cst.Else(body=cst.IndentedBlock(body=original)),
        leading_lines=[
            *block.body[first].leading_lines,
            comment_line(f"transfuse: in training with labels, the loss from {expression_code(hidden)} without the logits"),
        ],
    )
    new_body = [*block.body[:first], fused, *block.body[last + 1 :]]
    return tree.deep_replace(block, block.with_changes(body=new_body))
