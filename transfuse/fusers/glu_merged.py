"""A GLU whose gate and up are already one linear: ``gate, up = self.gate_up_proj(x).chunk(2, dim=-1)``
then ``act(gate) * up`` → ``act_and_mul(gate_up_out, "silu")``.

The gate/up fuser's second form. The merge is the model's own, so no weight changes: only the
activation and the product become the fused op, over the linear's output ``[gate | up]``. Found
by dataflow: a product of an activation of one half and the other half of a ``chunk(2, dim=-1)``
(or a ``split`` into two equal halves on the last dimension) of a linear child's output, in either
operand order, with ``*`` or ``torch.mul``, the activation a child module or a function as the
gate/up fuser reads them. Where the product is the only argument of a linear child
(``self.down_proj(...)``), both become ``act_and_mul_linear``.

``act_and_mul`` takes ``[gate | up]``: a linear whose first half is the one multiplied and second
half the one activated (``up, gate = ...``) is refused (``gate_up.halves-order``): the fused op
would need the rows of the model's own weight reordered. What one trace cannot show is proved on
the source: the linear is called once and used nowhere else; the call's statement binds it (or its
halves) directly; the halves are bound once by that unpacking and neither they nor the merged
output are rebound or written in place before the product, which sits in a later statement of the
same block.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
import torch.fx as fx
from torch import nn

from ..ops import identify_activation

from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Refusal
from ..rewriter.graph import NoMatch, is_op, op_name, operand, operands, value
from ..rewriter.source import EditContext
from ..rewriter.syntax import (
    ParentMap,
    assigned_names,
    expression_code,
    in_place_writes,
    replace_nodes,
    statement_block,
)
from .projections import single_call

__all__ = ["MergedGLUMatch", "edit_merged", "match_merged", "validate_merged"]


@dataclass(frozen=True)
class MergedGLUMatch:
    """The linear giving ``[gate | up]``, the activation (its ACTIVATIONS name, and the child module
    that computes it, if one does), the linear child reading the product (if one is its only
    reader), and the attribute or literal giving a split's size (checked per instance)."""

    merged: str
    activation: str
    act_module: str | None
    down: str | None
    split_size: str | int | None  # None for chunk(2)


def match_merged(analysis: ClassAnalysis, linears: set[str], activation_of, class_activation) -> MergedGLUMatch | Refusal | None:
    """The first product of an activated half and the other half of one linear's output split in two.
    ``activation_of`` names a function call's activation; ``class_activation`` a child's class's."""
    for node in analysis.trace.graph.nodes:
        if not is_op(node, "mul") or len(operands(node)) < 2:
            continue
        for act_side, other in (operands(node)[:2], operands(node)[1::-1]):
            found = _product(analysis, linears, node, act_side, other, activation_of, class_activation)
            if found is not None:
                return found
    return None


def _half(node, linears: set[str]) -> tuple[fx.Node, fx.Node, int] | None:
    """(the linear call, the split node, which half) for ``getitem(chunk/split(linear(x)), i)``."""
    if not (isinstance(node, fx.Node) and is_op(node, "getitem")):
        return None
    split, index = node.args[0], node.args[1]
    if not (isinstance(split, fx.Node) and op_name(split) in ("chunk", "split") and isinstance(index, int)):
        return None
    source = operand(split, 0)
    if not (isinstance(source, fx.Node) and source.op == "call_module" and source.target in linears):
        return None
    return source, split, index


def _product(analysis, linears, product, act_side, other, activation_of, class_activation):
    if not isinstance(act_side, fx.Node) or not act_side.args:
        return None
    gate, up = _half(operand(act_side, 0), linears), _half(other, linears)
    if gate is None or up is None or gate[1] is not up[1] or gate[2] == up[2]:
        return None
    linear, split, _ = gate
    pieces, width = value(split), getattr(value(linear), "shape", (None,))[-1]
    dim = operand(split, 2, "dim", 0)  # chunk(x, chunks, dim) and split(x, size, dim) alike
    halves = isinstance(pieces, (tuple, list)) and len(pieces) == 2 and all(p.shape[-1] * 2 == width for p in pieces)
    if not halves or dim not in (-1, len(pieces[0].shape) - 1):
        return Refusal(
            "gate_up.merged-form",
            f"{linear.target}'s output is split into {len(pieces) if isinstance(pieces, (tuple, list)) else '?'} "
            "pieces, not two equal halves of the last dimension; act_and_mul takes [gate | up].",
            analysis.where(split),
        )
    if gate[2] != 0:
        return Refusal(
            "gate_up.halves-order",
            f"{linear.target} gives [up | gate] (the second half is activated); act_and_mul takes [gate | up], "
            "which would need the rows of the model's own weight reordered.",
            analysis.where(product),
        )
    size = None
    if op_name(split) == "split":
        size = operand(split, 1, "split_size_or_sections")
        if isinstance(size, fx.Node) and size.op == "get_attr":
            size = size.target
        elif not isinstance(size, int):
            return Refusal(
                "gate_up.merged-form",
                f"the split size of {linear.target}'s output is computed in the forward; only a constant or an "
                "attribute is checked per instance.",
                analysis.where(split),
            )
    try:
        if act_side.op == "call_module" and act_side.target not in linears:
            child = analysis.child(act_side.target)
            if child is None:
                raise NoMatch("gate_up.activation", f"the activation module {act_side.target} cannot be analysed.")
            activation, act_module = class_activation(child), act_side.target
            # The activation is written into the forward: the traced instance's own (an activation
            # class may be configured per instance, nn.GELU(approximate=...)); others must match it.
            traced = _traced_instance(analysis)
            if traced is not None:
                activation = identify_activation(traced.get_submodule(act_module))
                if activation is None:
                    raise NoMatch(
                        "gate_up.activation",
                        f"{act_module} is not exactly one of the fused activations on the traced instance.",
                        act_side,
                    )
        else:
            activation, act_module = activation_of(act_side), None
            if activation is None:
                raise NoMatch(
                    "gate_up.activation",
                    f"the gate half of {linear.target} goes through {op_name(act_side) or act_side.op}, "
                    "which the fused op does not have.",
                    act_side,
                )
    except NoMatch as refusal:
        return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node or product))
    users = list(product.users)
    down = None
    if len(users) == 1 and users[0].op == "call_module" and users[0].target in linears and users[0].args == (product,):
        down = users[0].target if users[0].target != linear.target else None
    return MergedGLUMatch(linear.target, activation, act_module, down, size)


def validate_merged(module: nn.Module, found: MergedGLUMatch) -> Refusal | None:
    """This instance's linear splits into two equal halves as its class's did, and its activation
    module computes exactly the class's activation."""
    width = module.get_submodule(found.merged).out_features
    size = found.split_size
    half = width // 2 if size is None else (size if isinstance(size, int) else getattr(module, size, None))
    if width % 2 or half * 2 != width:
        return Refusal("gate_up.instance", f"{found.merged} gives {width} features, not two halves of {half}.")
    if found.act_module is not None:
        act = module.get_submodule(found.act_module)
        if identify_activation(act) != found.activation:
            return Refusal(
                "gate_up.activation-instance",
                f"{found.act_module} ({act!r}) does not compute exactly {found.activation}, as its class does.",
            )
    return None


def _traced_instance(analysis: ClassAnalysis) -> nn.Module | None:
    found = analysis.trace.graph.find_nodes(op="placeholder", target="self")
    try:
        instance = found[0].meta.get("val") if found else None
        return instance if isinstance(instance, nn.Module) else None
    except ReferenceError:
        return None


# ---- the source edit ----------------------------------------------------------------------------


def edit_merged(tree: cst.FunctionDef, found: MergedGLUMatch, context: EditContext) -> cst.FunctionDef:
    """The product becomes ``act_and_mul(<merged output>, activation)`` (or ``act_and_mul_linear``
    with the down projection), the merged output kept in a fresh variable; proved first."""
    kind = "gate_up"
    call = single_call(tree, found.merged, context, kind)
    parents = ParentMap(tree)
    first = parents.statement(call)
    if parents.in_nested_scope(call) or not _assigns(first):
        raise NoMatch(f"{kind}.placement", f"self.{found.merged}(...) is not the value of a plain assignment.")
    block, start = statement_block(parents, first)
    value_, target = first.body[0].value, first.body[0].targets[0].target
    if value_ is call:  # ``merged = self.gate_up_proj(x)``, split by a later statement
        if not isinstance(target, cst.Name):
            raise NoMatch(f"{kind}.placement", f"self.{found.merged}(...) is assigned to {expression_code(target)}.")
        halves, at = _later_split(block, start, target.value, found, kind)
    elif _splits(value_, call, found):
        halves, at = _names(target, kind), start
    else:
        raise NoMatch(f"{kind}.merged-form", f"self.{found.merged}(...) is split as {expression_code(value_)}.")
    product, index = _find_product(tree, parents, block, at, halves, found, kind)
    merged = context.fresh_name(f"{found.merged}_out")
    down_call = _down_call(tree, product, found.down)
    if down_call is not None:
        fused_op = context.require("transfuse.ops", "act_and_mul_linear")
        replaced = down_call
        fused = cst.parse_expression(f"{fused_op}(self.{found.down}, {merged}, {found.activation!r})")
    else:
        fused_op = context.require("transfuse.ops", "act_and_mul")
        replaced = product
        fused = cst.parse_expression(f"{fused_op}({merged}, {found.activation!r})")
    hoisted = cst.SimpleStatementLine(
        body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(merged))], value=call)],
        leading_lines=first.leading_lines,
    )
    return replace_nodes(
        tree,
        [(call, cst.Name(merged)), (first, lambda updated: updated.with_changes(leading_lines=[])), (replaced, fused)],
        insert=(block, start, [hoisted]),
    )


def _assigns(statement) -> bool:
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Assign)
        and len(statement.body[0].targets) == 1
    )


def _splits(expression: cst.BaseExpression, source: cst.BaseExpression, found: MergedGLUMatch) -> bool:
    """``source.chunk(2, dim=-1)``, ``torch.chunk(source, 2, dim=-1)``, ``source.split(size, dim=-1)``
    (size the attribute or literal the trace saw), with ``-1`` positional or by keyword."""
    if not isinstance(expression, cst.Call):
        return False
    func, args = expression.func, list(expression.args)
    method = "split" if found.split_size is not None else "chunk"
    if m.matches(func, m.Attribute(value=m.Name("torch"), attr=m.Name(method))) and args:
        subject, args = args[0].value, args[1:]
    elif isinstance(func, cst.Attribute) and func.attr.value == method:
        subject = func.value
    else:
        return False
    if subject is not source and not (isinstance(source, cst.Name) and subject.deep_equals(source)):
        return False
    if len(args) != 2 or args[0].keyword is not None or (args[1].keyword is not None and args[1].keyword.value != "dim"):
        return False
    size, dim = args[0].value, args[1].value
    if not m.matches(dim, m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))):
        return False
    if found.split_size is None:
        return m.matches(size, m.Integer("2"))
    if isinstance(found.split_size, int):
        return isinstance(size, cst.Integer) and int(size.value) == found.split_size
    return m.matches(size, m.Attribute(value=m.Name("self"), attr=m.Name(found.split_size)))


def _names(target, kind: str) -> tuple[str, str]:
    if isinstance(target, cst.Tuple) and len(target.elements) == 2 and all(
        isinstance(e.value, cst.Name) and not isinstance(e, cst.StarredElement) for e in target.elements
    ):
        gate, up = (e.value.value for e in target.elements)
        if gate != up:
            return gate, up
    raise NoMatch(f"{kind}.merged-form", f"the halves are unpacked into {expression_code(target)}, not two names.")


def _quiet(statements, names: set[str], kind: str) -> None:
    """None of ``statements`` rebinds ``names`` or writes a tensor in place."""
    for statement in statements:
        rebound = assigned_names(statement) & names
        if rebound:
            raise NoMatch(f"{kind}.input-mutated", f"{sorted(rebound)[0]} is rebound before the product.")
        writes = in_place_writes(statement)
        if writes:
            raise NoMatch(f"{kind}.input-mutated", f"{writes[0]} may change a tensor in place before the product.")


def _later_split(block, start: int, merged: str, found: MergedGLUMatch, kind: str) -> tuple[tuple[str, str], int]:
    """The halves and index of the first later sibling statement that unpacks ``merged`` split in two,
    with nothing between them rebinding it or writing in place."""
    for index in range(start + 1, len(block.body)):
        statement = block.body[index]
        if _assigns(statement) and _splits(statement.body[0].value, cst.Name(merged), found):
            return _names(statement.body[0].targets[0].target, kind), index
        _quiet([statement], {merged}, kind)
    raise NoMatch(f"{kind}.merged-form", f"{merged} is not split into two halves in the same block.")


def _find_product(tree, parents, block, at: int, halves: tuple[str, str], found, kind: str):
    """The product ``act(gate) * up`` in a later sibling statement of the unpacking, and its index."""
    gate, up = halves
    for index in range(at + 1, len(block.body)):
        statement = block.body[index]
        for node in m.findall(statement, m.BinaryOperation(operator=m.Multiply()) | m.Call()):
            pair = _operands(node)
            if pair is None or parents.in_nested_scope(node):
                continue
            for act, other in (pair, pair[::-1]):
                if m.matches(other, m.Name(up)) and _activates(act, gate, found):
                    _quiet([statement], set(), kind)
                    return node, index
                if m.matches(other, m.Name(gate)) and _activates(act, up, found):
                    raise NoMatch(
                        "gate_up.halves-order",
                        f"{up} (the second half) is activated; act_and_mul takes [gate | up].",
                    )
        _quiet([statement], {gate, up}, kind)
    raise NoMatch(f"{kind}.placement", f"the activation of {gate} and {up} are not multiplied in one expression.")


def _operands(node):
    if isinstance(node, cst.BinaryOperation):
        return node.left, node.right
    if m.matches(node.func, m.Attribute(value=m.Name("torch"), attr=m.Name("mul"))) and len(node.args) == 2:
        if all(a.keyword is None and not a.star for a in node.args):
            return node.args[0].value, node.args[1].value
    return None


def _activates(node, name: str, found: MergedGLUMatch) -> bool:
    """``node`` is the activation applied to the variable ``name``, spelled as the trace saw it."""
    if not (isinstance(node, cst.Call) and node.args and m.matches(node.args[0].value, m.Name(name))):
        return False
    if node.args[0].keyword is not None or node.args[0].star:
        return False
    if found.act_module is not None:
        return len(node.args) == 1 and m.matches(node.func, m.Attribute(value=m.Name("self"), attr=m.Name(found.act_module)))
    function = node.func.attr.value if isinstance(node.func, cst.Attribute) else getattr(node.func, "value", None)
    if function != ("silu" if found.activation == "silu" else "gelu"):
        return False
    for arg in node.args[1:]:
        keyword = arg.keyword.value if arg.keyword is not None else None
        if keyword == "approximate":
            if not isinstance(arg.value, cst.SimpleString):
                raise NoMatch("gate_up.activation", "gelu's approximate= is not a string literal, so it may differ per call.")
        elif keyword != "inplace" or not m.matches(arg.value, m.Name("False")):
            return False
    return True


def _down_call(tree, product, down: str | None) -> cst.Call | None:
    """``self.<down>(<product>)``, the product written as the call's one argument, if so."""
    if down is None:
        return None
    for call in m.findall(tree, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(down)))):
        if len(call.args) == 1 and call.args[0].keyword is None and not call.args[0].star and call.args[0].value is product:
            return call
    return None
