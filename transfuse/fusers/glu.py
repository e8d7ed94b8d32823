"""Gate/up GLU: ``act(self.gate(x)) * self.up(x)`` → ``act_and_mul(self.gate_up_proj(x), activation)``.

The gate and up projections read the same value, so they are one matrix multiply with
their weights concatenated, and the activation and product become one fused
``act_and_mul`` op over the merged output ``[gate | up]``. Found by dataflow in either
operand order, with ``*`` or ``torch.mul``, and the activation as a child module (the
classes of transformers' ``ACT2FN``, ``nn.SiLU``, ``nn.GELU(approximate=...)``) or a
function (``F.silu``, ``F.gelu(..., approximate=...)``).

The activation must be one the fused op has (silu, gelu with erf, gelu with tanh): an
activation module's class is identified from its own traced graph, and each instance is
then checked numerically against the fused op, so an instance configured differently
(``nn.GELU(approximate="tanh")`` next to ``nn.GELU()``) is identified on its own; an
instance whose activation is not exactly the class's is refused with the reason. Any other
activation leaves the product as written (below).

When the product's only reader is a linear child, written as its call's one argument
(``self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))``), both calls become
``act_and_mul_linear(self.down_proj, self.gate_up_proj(x), activation)``: the same numbers, and
in training the product is computed again in the backward instead of kept for the down
projection's weight gradient.

A GLU whose product is not one ``act_and_mul`` (an activation the op does not have, casts to
float32 around the activation, a scale on the gate, or the activated gate kept in a variable
before the product) still has two projections of one value: they merge alone, proved and
edited as the qkv fuser merges projections (``gate_out, up_out = self.gate_up_proj(x).split(...)``),
and the arithmetic between them and the product stays as written.

A GLU whose gate and up are already one linear (``gate, up = self.gate_up_proj(x).chunk(2,
dim=-1)``) gets its activation and product fused the same way, the model's linear kept as it is
(``fusers/glu_merged.py``). A forward whose GLU sits under a branch on configuration values (a
``pretraining_tp > 1`` arm that slices the weights) is fused on the arm the traced instance takes,
under a guard; one that writes the GLU alike in both arms of an if/else is fused in each arm
(``fusers/projections.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import libcst as cst
import libcst.matchers as m
import torch.fx as fx
from torch import nn

from ..ops import ACTIVATIONS
from ..rewriter.analysis import ClassAnalysis
from ..rewriter.branches import constant_tests
from ..rewriter.fusion import Fused, Refusal, SourceFuser
from ..rewriter.graph import NoMatch, is_op, op_name, operand, operands
from ..rewriter.source import EditContext
from ..rewriter.syntax import expression_code, replace_nodes
from ..rewriter.weights import ActivationError, Merge, MergeError
from .glu_merged import MergedGLUMatch, edit_merged, match_merged, validate_merged
from .projections import (
    adapter_refusal,
    free_child_name,
    in_each_arm,
    linear_children,
    merge_calls,
    on_decided_path,
    single_call,
    wrapped_children,
)

__all__ = ["GLUFuser", "GLUMatch"]

# Refusals of the source proof that may not hold on one arm of a branch: the other arm uses the
# projections otherwise (slices their weights) or calls them again.
_PATH_DEPENDENT = ("gate_up.other-use", "gate_up.called-twice")


@dataclass(frozen=True)
class GLUMatch:
    """The gate and up projections, the merged child's name, and where the activation comes from."""

    gate: str
    up: str
    into: str
    act_module: str | None  # a child module applies the activation ...
    act_function: str | None  # ... or a function call in the forward does (its ACTIVATIONS name)
    # The linear child that is the product's only reader (a down projection), if there is one:
    # the two calls then become ``act_and_mul_linear``, which recomputes the product in training.
    down: str | None = None
    # False: the product is not one act_and_mul (other arithmetic around the activation, or an
    # activation the op does not have), so only the projections merge.
    product: bool = True
    linears: frozenset[str] = frozenset()  # every linear child (named if one reads x between the calls)
    # The forward's branch tests the traced instance decides (``rewriter.branches.constant_tests``).
    decided: tuple[tuple[str, bool], ...] = ()

    @property
    def merge(self) -> Merge:
        if not self.product:
            return Merge(self.into, (self.gate, self.up))
        return Merge(self.into, (self.gate, self.up), self.act_function, self.act_module)


def _activation_of_function(node: fx.Node) -> str | None:
    """ACTIVATIONS name of an ``F.silu`` / ``F.gelu(approximate=...)`` call node, else None."""
    name = op_name(node)
    if name == "silu":
        return "silu"
    if name == "gelu":
        approximate = operand(node, 1, "approximate", "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _class_activation(analysis: ClassAnalysis) -> str:
    """The activation an activation module's class computes, from its graph: one silu/gelu call."""
    trace = analysis.trace
    calls = [
        n
        for n in trace.graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and not is_op(n, "getattr")
    ]
    inputs = trace.placeholders()
    if trace.shape_guards:
        raise NoMatch(
            "gate_up.activation",
            f"the activation {analysis.cls.__name__} branches on its input's shape ({trace.shape_guards[0].describe()}).",
        )
    if not trace.partial and len(calls) == 1 and inputs and operand(calls[0], 0) is inputs[0]:
        activation = _activation_of_function(calls[0])
        if activation is not None:
            return activation
    ops = ", ".join(op_name(n) or n.op for n in calls[:6]) or "nothing"
    raise NoMatch(
        "gate_up.activation",
        f"the activation {analysis.cls.__name__} computes {ops}; the fused op has only {', '.join(ACTIVATIONS)}.",
        calls[0] if calls else None,
    )


class GLUFuser(SourceFuser[GLUMatch]):
    kind = "gate_up"

    def wants(self, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) or hasattr(c, "get_base_layer") for c in module.children()) >= 2

    def match(self, analysis: ClassAnalysis) -> GLUMatch | Refusal | None:
        linears = linear_children(analysis) | wrapped_children(analysis)
        plain = frozenset(linear_children(analysis))
        refusal = projections_only = None
        for node in analysis.trace.graph.nodes:
            if not is_op(node, "mul"):
                continue
            for act_side, up_side in (operands(node)[:2], operands(node)[1::-1]):
                found = self._match_product(analysis, linears, act_side, up_side)
                if isinstance(found, GLUMatch):
                    found = replace(found, linears=plain, decided=constant_tests(analysis))
                    if found.product:
                        return replace(found, down=_only_reader(node, plain, found))
                    projections_only = projections_only or found
                refusal = refusal or found
        merged = match_merged(analysis, linears, _activation_of_function, _class_activation)
        if isinstance(merged, MergedGLUMatch):
            return merged
        return projections_only or refusal or merged

    def _match_product(self, analysis, linears, act_side, up_side) -> GLUMatch | Refusal | None:
        if not (_is_linear_call(up_side, linears) and isinstance(act_side, fx.Node)):
            return _projections_only(analysis, linears, act_side, up_side)
        gate = operand(act_side, 0)
        if not _is_linear_call(gate, linears) or gate.target == up_side.target:
            return _projections_only(analysis, linears, act_side, up_side)
        adapters = adapter_refusal(analysis, self.kind, [gate.target, up_side.target])
        if adapters is not None:
            return adapters
        if gate.args[0] is not up_side.args[0]:
            return Refusal(
                "gate_up.inputs-differ",
                f"{gate.target} and {up_side.target} read different values ({gate.args[0]} and {up_side.args[0]}); "
                "only projections of one value merge.",
                analysis.where(up_side),
            )
        into = free_child_name(analysis, "gate_up_proj")
        try:
            if act_side.op == "call_module" and act_side.target not in linears:
                child = analysis.child(act_side.target)
                if child is None:
                    raise NoMatch("gate_up.activation", f"the activation module {act_side.target} cannot be analysed.")
                _class_activation(child)
                return GLUMatch(gate.target, up_side.target, into, act_side.target, None)
            activation = _activation_of_function(act_side)
            if activation is None:
                raise NoMatch(
                    "gate_up.activation",
                    f"the gate goes through {op_name(act_side) or act_side.op}; the fused op has only "
                    f"{', '.join(ACTIVATIONS)}.",
                    act_side,
                )
        except NoMatch as refusal:
            if refusal.tag == "gate_up.activation" and _is_activation(act_side, linears):
                # An activation the fused op does not have: the projections still merge.
                return GLUMatch(gate.target, up_side.target, into, None, None, product=False)
            return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node))
        return GLUMatch(gate.target, up_side.target, into, None, activation)

    def edit(self, tree: cst.FunctionDef, found: GLUMatch | MergedGLUMatch, context: EditContext) -> cst.FunctionDef:
        if isinstance(found, MergedGLUMatch):
            return edit_merged(tree, found, context)
        try:
            return self._edit(tree, found, context)
        except NoMatch as refusal:
            if refusal.tag not in _PATH_DEPENDENT:
                raise
            # Branches on configuration values (a weight-slicing arm for ``pretraining_tp > 1``), or
            # the GLU written alike in both arms of one if/else (a test on the input's dtype).
            edit = functools.partial(self._edit, found=found, context=context)
            for attempt in (
                lambda: on_decided_path(tree, found.decided, edit, context, self.kind, f"{found.gate}, {found.up} fused"),
                lambda: in_each_arm(tree, (found.gate, found.up), edit, self.kind),
            ):
                try:
                    return attempt()
                except NoMatch:
                    continue
            raise

    def _edit(self, tree: cst.FunctionDef, found: GLUMatch, context: EditContext) -> cst.FunctionDef:
        if not found.product:
            return merge_calls(tree, (found.gate, found.up), found.into, found.linears, context, self.kind)
        gate_call = single_call(tree, found.gate, context, "gate_up")
        up_call = single_call(tree, found.up, context, "gate_up")
        try:
            product = _product(tree, gate_call, up_call, found)
        except NoMatch as refusal:
            if refusal.tag != "gate_up.placement":
                raise
            # The activated gate is kept in a variable before the product: the projections alone merge.
            return merge_calls(tree, (found.gate, found.up), found.into, found.linears, context, self.kind)
        x = gate_call.args[0].value
        if not (isinstance(x, cst.Name) and up_call.args[0].value.deep_equals(x)):
            raise NoMatch(
                "gate_up.inputs-differ",
                f"gate and up read {expression_code(gate_call.args[0].value)} and "
                f"{expression_code(up_call.args[0].value)}, not one variable.",
            )
        down_call = _down_call(tree, product, found.down)
        if down_call is not None:
            fused_op = context.require("transfuse.ops", "act_and_mul_linear")
            merged = cst.parse_expression(
                f"{fused_op}(self.{found.down}, self.{found.into}({x.value}), self.{found.into}.activation)"
            )
            return replace_nodes(tree, [(down_call, merged)])
        fused_op = context.require("transfuse.ops", "act_and_mul")
        merged = cst.parse_expression(f"{fused_op}(self.{found.into}({x.value}), self.{found.into}.activation)")
        return replace_nodes(tree, [(product, merged)])

    def rebuilt_children(self, found: GLUMatch | MergedGLUMatch) -> tuple[str, ...]:
        return () if isinstance(found, MergedGLUMatch) else (found.gate, found.up)

    def declaration(self, found: GLUMatch | MergedGLUMatch) -> Merge | None:
        return None if isinstance(found, MergedGLUMatch) else found.merge

    def validate(self, module: nn.Module, found: GLUMatch | MergedGLUMatch) -> Refusal | None:
        if isinstance(found, MergedGLUMatch):
            return validate_merged(module, found)
        try:
            found.merge.check(module)
        except ActivationError as exc:
            return Refusal("gate_up.activation-instance", str(exc))
        except MergeError as exc:
            return Refusal("gate_up.instance", str(exc))
        return None

    def fuse(self, module: nn.Module, found: GLUMatch | MergedGLUMatch) -> Fused:
        if isinstance(found, MergedGLUMatch):
            return Fused(replaced=(), into="act_and_mul")  # the model's own merged linear, as it is
        merged = found.merge.apply(module)
        return Fused(replaced=(found.gate, found.up), into=type(merged).__name__, undo=lambda: found.merge.undo(module))


def _only_reader(product: fx.Node, linears: set[str], found: GLUMatch) -> str | None:
    """The linear child that reads the product and is its only reader, if there is one."""
    users = list(product.users)
    if len(users) != 1 or not _is_linear_call(users[0], linears) or users[0].args[0] is not product:
        return None
    return None if users[0].target in (found.gate, found.up) else users[0].target


def _down_call(tree: cst.FunctionDef, product: cst.CSTNode, down: str | None) -> cst.Call | None:
    """``self.<down>(<product>)``, the product written as the call's one argument; None when the
    source spells it another way (the product then fuses alone)."""
    if down is None:
        return None
    for call in m.findall(tree, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(down)))):
        if len(call.args) == 1 and call.args[0].keyword is None and call.args[0].value is product:
            return call
    return None


def _is_linear_call(node, linears: set[str]) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and node.target in linears
        and len(node.args) == 1
        and not node.kwargs
    )


_FUNCTIONS = {"silu", "gelu"}
# Functions that are activations, for naming a GLU the fused op does not take.
_ACTIVATION_NAMES = {"silu", "gelu", "relu", "sigmoid", "tanh", "mish", "softplus", "elu", "leaky_relu", "relu6"}


def _back_to_linear(node, linears: set[str]) -> tuple[fx.Node | None, list[fx.Node]]:
    """The linear call ``node`` is computed from through one-input steps (casts, a factor
    that is the module's attribute, an activation), and those steps, nearest the product
    first; (None, steps) when the chain meets a node of two inputs or an input of the forward
    first."""
    steps = []
    while isinstance(node, fx.Node) and not _is_linear_call(node, linears):
        # The module's own attributes (a multiplier read as ``self.gate_multiplier``) are factors
        # here, not a second input.
        inputs = [n for n in node.all_input_nodes if n.op != "get_attr"]
        if node.op == "placeholder" or len(inputs) != 1 or len(steps) > 6:
            return None, steps
        steps.append(node)
        node = inputs[0]
    return (node if isinstance(node, fx.Node) else None), steps


def _is_activation(node, linears: set[str]) -> bool:
    """A call of a child module other than a linear, or of a function named like an activation."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_module":
        return node.target not in linears
    return op_name(node) in _ACTIVATION_NAMES


def _projections_only(analysis: ClassAnalysis, linears: set[str], act_side, up_side) -> GLUMatch | Refusal | None:
    """A product of two projections of one value, one through an activation, with more than the
    activation between them and the product (casts to float32 around it, a scalar factor on the
    gate): a GLU the fused op does not compute, whose projections merge alone."""
    gate, gate_steps = _back_to_linear(act_side, linears)
    up, up_steps = _back_to_linear(up_side, linears)
    if gate is None or up is None or gate.target == up.target or gate.args[0] is not up.args[0]:
        return None
    if not any(_is_activation(n, linears) for n in gate_steps):
        return None
    adapters = adapter_refusal(analysis, "gate_up", [gate.target, up.target])
    if adapters is not None:
        return adapters
    return GLUMatch(gate.target, up.target, free_child_name(analysis, "gate_up_proj"), None, None, product=False)


def _product(tree: cst.FunctionDef, gate_call: cst.Call, up_call: cst.Call, found: GLUMatch) -> cst.CSTNode:
    """The ``act(gate(x)) * up(x)`` (or ``torch.mul``) expression holding both calls."""
    for node in m.findall(tree, m.BinaryOperation(operator=m.Multiply()) | m.Call()):
        if isinstance(node, cst.BinaryOperation):
            pair = (node.left, node.right)
        elif _is_torch_mul(node) and len(node.args) == 2:
            pair = (node.args[0].value, node.args[1].value)
        else:
            continue
        for act, up in (pair, pair[::-1]):
            if up is up_call and _applies_activation(act, gate_call, found):
                return node
    raise NoMatch("gate_up.placement", "the gate's activation and the up projection are not multiplied in one expression.")


def _applies_activation(node: cst.CSTNode, gate_call: cst.Call, found: GLUMatch) -> bool:
    if not (isinstance(node, cst.Call) and node.args and node.args[0].value is gate_call):
        return False
    if found.act_module is not None:
        return m.matches(node.func, m.Attribute(value=m.Name("self"), attr=m.Name(found.act_module)))
    name = node.func.attr.value if isinstance(node.func, cst.Attribute) else getattr(node.func, "value", None)
    if name not in _FUNCTIONS:
        return False
    for arg in node.args[1:]:
        if arg.keyword is not None and arg.keyword.value == "approximate" and not isinstance(arg.value, cst.SimpleString):
            raise NoMatch("gate_up.activation", "gelu's approximate= is not a string literal, so it may differ per call.")
    return True


def _is_torch_mul(call: cst.Call) -> bool:
    return m.matches(call.func, m.Attribute(value=m.Name("torch"), attr=m.Name("mul")))
