"""The one path a trace took through a method, proved on its source: a branch decided per instance.

A trace shows one path. A fuser that replaces a whole module must know no other path exists: every
branch, loop, ``with``, ``try`` or early return in the forward and the helpers it calls is refused,
except a branch whose test reads only ``self``'s attributes and constants (``if self.with_scale``,
``if self.weight is not None``), which is decided as the traced instance decided it; the attributes
it read, with their values, are what the match assumes of every other instance. An ``if`` with no
``else`` whose arm only raises (a check of the input, ``if x.size(-1) != self.dim: raise ...``) is
passed: the inputs it accepts take the traced path, and the fused code computes that path (where the
original raises it computes it too, or its op raises). A global of the
model's module that is None (``if fused_kernel is not None and x.is_cuda``, the kernel's import having
failed) is decided as None too; the fused code checks it per call and runs the original otherwise.

``constant_tests`` reads the same tests more widely, for a fuser that edits the forward rather than
replacing the module: a test that reads only constants, ``self``'s plain attributes, values reached
through a plain object ``self`` holds (``self.config.pretraining_tp > 1``) and the module's constant
globals has one value for the traced instance. The edit is then proved on the arm taken, and the
edited forward re-tests the same expressions at run time, running the original where they differ.
"""

from __future__ import annotations

import inspect

import libcst as cst
import libcst.matchers as m
import torch
from torch import nn

from ..ops.layers import Assumption
from .analysis import ClassAnalysis
from .graph import NoMatch, value
from .source import MethodSource, helper_functions, method_source, self_method_calls
from .tracer import unwrapped_forward

__all__ = ["TracedPath", "constant_tests", "raises_only", "traced_path"]


def raises_only(node: cst.If) -> bool:
    """``if test: raise ...`` with no ``else``: a check whose failing arm only raises; the path the
    accepted inputs take is the one after it."""
    body = node.body.body
    simple = all(isinstance(s, cst.SimpleStatementLine) and all(isinstance(b, cst.Raise) for b in s.body) for s in body)
    return node.orelse is None and bool(body) and simple


def traced_path(analysis: ClassAnalysis, kind: str) -> TracedPath:
    """Prove on the source what one trace cannot: no branch or loop that another input could take,
    in the forward or in any helper it calls (a ``self.`` method or a function of the model's code).

    A branch whose test reads only attributes of ``self`` (``if self.with_scale``, ``if self.weight
    is not None``) is decided as the traced instance decided it, and only the path taken is checked;
    the attributes it read are the match's assumptions. A test of whether one of the forward's
    optional inputs is None is kept for the caller to explain (``TracedPath.optional``). Refusals are
    tagged ``<kind>.control-flow`` and ``<kind>.no-source``."""
    forward = unwrapped_forward(analysis.cls)
    source = method_source(forward)
    if source is None:
        raise NoMatch(f"{kind}.no-source", f"the source of {analysis.cls.__name__}.forward is not available.")
    path = TracedPath(analysis, kind)
    pending, seen = [source], {forward}
    while pending:
        current = pending.pop()
        path.walk(current, is_forward=current.function is inspect.unwrap(forward))
        helpers = [getattr(analysis.cls, name, None) for name in self_method_calls(current)]
        helpers += helper_functions(current)
        for helper in helpers:
            if not callable(helper) or not hasattr(inspect.unwrap(helper), "__code__") or helper in seen:
                continue
            seen.add(helper)
            helper_source = method_source(helper)
            if helper_source is None:
                raise NoMatch(
                    f"{kind}.no-source",
                    f"{current.node.name.value} calls {getattr(helper, '__qualname__', helper)}, whose source "
                    "is not available, so its control flow cannot be checked.",
                )
            pending.append(helper_source)
    return path


def constant_tests(analysis: ClassAnalysis) -> tuple[tuple[str, bool], ...]:
    """Every ``if`` and conditional expression test in the class's forward whose value the traced
    instance decides (configuration values, plain attributes, constant globals; none assigned in the
    forward), as (the test's code, its value), in source order; a test of literals alone is left out."""
    forward = unwrapped_forward(analysis.cls)
    source = method_source(forward)
    if source is None:
        return ()
    path = TracedPath(analysis, "constant", constants=True)
    path._source = source
    found = []
    for node in m.findall(source.node.body, m.If() | m.IfExp()):
        path.read = False
        try:
            decided = path._truth(path._evaluate(node.test))
        except Exception:  # noqa: BLE001 - undecidable, or a comparison of odd objects: decides nothing
            continue
        code = cst.Module(body=[]).code_for_node(node.test.with_changes(lpar=[], rpar=[]))
        if path.read and all(code != c for c, _ in found):
            found.append((code, decided))
    return tuple(found)


_TENSOR = object()  # what a test of a parameter or buffer reads: a tensor (only ``is None`` is decidable)
_COMPARE = {
    cst.Is: lambda a, b: a is b, cst.IsNot: lambda a, b: a is not b,
    cst.Equal: lambda a, b: a == b, cst.NotEqual: lambda a, b: a != b,
    cst.LessThan: lambda a, b: a < b, cst.LessThanEqual: lambda a, b: a <= b,
    cst.GreaterThan: lambda a, b: a > b, cst.GreaterThanEqual: lambda a, b: a >= b,
}  # fmt: skip


class TracedPath(cst.CSTVisitor):
    """Walks the path the trace took through a method: a branch on ``self``'s attributes is decided
    as the traced instance decided it and only the branch taken is walked; any other branch, loop,
    ``with``, ``try`` or early return is refused. ``assumes`` are the attributes the decisions read,
    with their values; ``optional`` the tests of an optional input being None (parameter, If)."""

    def __init__(self, analysis: ClassAnalysis, kind: str, constants: bool = False):
        super().__init__()
        self.analysis = analysis
        self.kind = kind
        # Also read values through plain objects ``self`` holds and the module's constant globals
        # (``constant_tests``); ``read`` says whether a test read any of them.
        self.constants = constants
        self.read = False
        self.assumes: dict[str, Assumption] = {}
        # Globals of the model's module a test read, None when traced: (module name, global name).
        self.globals_none: dict[str, tuple[str, str]] = {}
        self.optional: list[tuple[str, cst.If, MethodSource]] = []
        self._source: MethodSource | None = None
        self._params: dict[str, cst.Param] = {}

    def walk(self, source: MethodSource, is_forward: bool) -> None:
        self._source = source
        params = source.node.params
        self._params = {p.name.value: p for p in [*params.params, *params.kwonly_params]} if is_forward else {}
        source.node.body.visit(self)

    def _refuse(self, node: cst.CSTNode, kind: str) -> None:
        article = "an" if kind[0] in "aeiou" else "a"
        raise NoMatch(
            f"{self.kind}.control-flow",
            f"{self._source.node.name.value} has {article} {kind} at line {self._source.line(node)}; the trace "
            "shows one path only.",
        )

    def visit_If(self, node: cst.If) -> bool:
        if raises_only(node):
            return False  # a check of the input: every input it accepts goes on past it, as the trace did
        branch = node.body if self._decide(node.test, node) else node.orelse
        if branch is not None:
            branch.visit(self)
        return False

    def visit_IfExp(self, node: cst.IfExp) -> bool:
        (node.body if self._decide(node.test, node) else node.orelse).visit(self)
        return False

    def visit_For(self, node) -> None:
        self._refuse(node, "for")

    def visit_While(self, node) -> None:
        self._refuse(node, "while")

    def visit_Try(self, node) -> None:
        self._refuse(node, "try")

    def visit_With(self, node) -> None:
        self._refuse(node, "with")

    def visit_Match(self, node) -> None:
        self._refuse(node, "match")

    def visit_Return(self, node: cst.Return) -> None:
        last = self._source.node.body.body[-1] if self._source.node.body.body else None
        if not (isinstance(last, cst.SimpleStatementLine) and node in last.body):
            self._refuse(node, "return")

    def _decide(self, test: cst.BaseExpression, branch: cst.CSTNode) -> bool:
        """The traced instance's value of ``test``; a test reading anything but ``self``'s attributes
        and constants (or an optional input against None) is refused."""
        optional = self._optional_input(test)
        if optional is not None:
            param, given_is_true = optional
            if isinstance(branch, cst.If):
                self.optional.append((param, branch, self._source))
            else:
                self._refuse(branch, "conditional expression on an optional input")
            return given_is_true
        try:
            return bool(self._evaluate(test))
        except _Undecidable:
            kind = "if" if isinstance(branch, cst.If) else "ifexp"
            self._refuse(branch, kind)

    def _optional_input(self, test) -> tuple[str, bool] | None:
        """``p is not None`` / ``p is None`` of a forward parameter ``p`` that defaults to None, given a
        tensor in the traced call, never rebound: (p, the test's value on the traced call)."""
        if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
            return None
        target = test.comparisons[0]
        if not (isinstance(test.left, cst.Name) and m.matches(target.comparator, m.Name("None"))):
            return None
        if not isinstance(target.operator, (cst.Is, cst.IsNot)):
            return None
        param = self._params.get(test.left.value)
        if param is None or param.default is None or not m.matches(param.default, m.Name("None")):
            return None
        if m.findall(self._source.node.body, m.AssignTarget(target=m.Name(param.name.value))):
            return None
        placeholder = next((p for p in self.analysis.trace.placeholders() if p.target == param.name.value), None)
        if placeholder is None or not isinstance(value(placeholder), torch.Tensor):
            return None  # traced without it: the None path, which no matcher explains
        return param.name.value, isinstance(target.operator, cst.IsNot)

    def _evaluate(self, node: cst.BaseExpression):
        if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.value]
        if isinstance(node, (cst.Integer, cst.Float, cst.SimpleString)):
            return node.evaluated_value
        if m.matches(node, m.Attribute(value=m.Name("self"))):
            self.read = True
            return self._attribute(node.attr.value)
        if self.constants and isinstance(node, (cst.Attribute, cst.Name)):
            self.read = True
            return self._constant(node)
        if isinstance(node, cst.Name):
            return self._global_none(node.value)
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
            return not self._truth(self._evaluate(node.expression))
        if isinstance(node, cst.BooleanOperation):
            left = self._evaluate(node.left)
            if self._truth(left) == isinstance(node.operator, cst.Or):
                return left  # short-circuit: the right operand never runs
            return self._evaluate(node.right)
        if isinstance(node, cst.Comparison):
            left = self._evaluate(node.left)
            for target in node.comparisons:
                right = self._evaluate(target.comparator)
                identity = isinstance(target.operator, (cst.Is, cst.IsNot))
                compare = _COMPARE.get(type(target.operator))
                if compare is None or ((left is _TENSOR or right is _TENSOR) and not identity):
                    raise _Undecidable
                if not compare(left, right):
                    return False
                left = right
            return True
        raise _Undecidable

    def _constant(self, node: cst.Attribute | cst.Name):
        """A value reached through plain objects held by ``self`` (``self.config.pretraining_tp``), or a
        global of the forward's module, on the traced instance: a constant (None, bool, int, float,
        str) that the forward does not assign; anything else is undecidable."""
        chain = []
        while isinstance(node, cst.Attribute):
            chain.append(node.attr.value)
            node = node.value
        if not isinstance(node, cst.Name):
            raise _Undecidable
        chain.reverse()
        function = self._source.node
        if node.value == "self":
            if _assigns_under_self(function, chain[0]):
                raise _Undecidable
            instance = self.analysis.trace.graph.find_nodes(op="placeholder", target="self")[0].meta.get("val")
            found = instance
        else:
            if node.value in _local_names(function):
                raise _Undecidable
            scope = self._source.function.__globals__
            if node.value not in scope:
                raise _Undecidable
            found = scope[node.value]
            if chain:
                raise _Undecidable  # an attribute of a global (a module, a class): not a constant we read
        try:
            for i, name in enumerate(chain):
                if i and isinstance(found, (nn.Module, torch.Tensor)):
                    raise _Undecidable  # a child module's state, or a tensor's: not configuration
                found = getattr(found, name)
        except (ReferenceError, AttributeError):
            raise _Undecidable from None
        if found is not None and type(found) not in (bool, int, float, str):
            raise _Undecidable
        return found

    @staticmethod
    def _truth(v) -> bool:
        if v is _TENSOR:
            raise _Undecidable  # a tensor's truth is its data
        return bool(v)

    def _attribute(self, name: str):
        """``self.<name>`` on the traced instance: a scalar the trace read, a parameter or buffer it
        held (a tensor), or None or a string read off the instance itself; its value is assumed."""
        if m.findall(self._source.node, m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(name)))):
            raise _Undecidable  # the method rebinds it: its value at the test is not the instance's
        trace = self.analysis.trace
        scalar = trace.self_attrs.get(name)
        if scalar is not None:
            found, assumption = scalar.meta["val"], Assumption(name, scalar.meta["val"])
        elif any(n.op == "get_attr" and n.target == name and "self_attr" not in n.meta for n in trace.graph.nodes):
            found, assumption = _TENSOR, Assumption(name, tensor=True)
        else:
            instance = trace.graph.find_nodes(op="placeholder", target="self")[0].meta.get("val")
            try:
                found = getattr(instance, name)
            except (ReferenceError, AttributeError):
                raise _Undecidable from None  # the traced instance is gone, or has no such attribute
            if found is not None and type(found) is not str:
                raise _Undecidable
            assumption = Assumption(name, found)
        self.assumes[name] = assumption
        return found

    def _global_none(self, name: str) -> None:
        """A global of the method's module that is None now (an optional kernel whose import failed),
        never rebound in the method nor a parameter of it: decided as None, and kept in
        ``globals_none`` for the fused code to check per call."""
        function = self._source.function
        namespace = getattr(function, "__globals__", {})
        local = _local_names(self._source.node)
        if m.findall(self._source.node, m.Global()) or m.findall(self._source.node, m.Nonlocal()):
            local.add("*")
        if name not in namespace or namespace[name] is not None or name in local or "*" in local:
            raise _Undecidable
        self.globals_none[name] = (namespace.get("__name__", ""), name)
        return None


def _assigns_under_self(function: cst.FunctionDef, attribute: str) -> bool:
    """Whether ``function`` assigns ``self.<attribute>`` or anything under it, or calls setattr."""
    for target in m.findall(function, m.AssignTarget() | m.AugAssign() | m.AnnAssign()):
        written = target.target
        while isinstance(written, (cst.Attribute, cst.Subscript)):
            if m.matches(written, m.Attribute(value=m.Name("self"), attr=m.Name(attribute))):
                return True
            written = written.value
    return bool(m.findall(function, m.Call(func=m.Name("setattr"))))


def _local_names(function: cst.FunctionDef) -> set[str]:
    """Names the function binds (parameters, assignments, loop targets, imports): not globals there."""
    params = function.params
    names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    names |= {p.name.value for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)}
    for target in m.findall(function.body, m.AssignTarget() | m.For() | m.AugAssign() | m.AnnAssign() | m.NamedExpr()):
        names |= {n.value for n in m.findall(target.target, m.Name())}
    for alias in m.findall(function.body, m.ImportAlias()):
        bound = alias.asname.name if alias.asname is not None else alias.name
        if isinstance(bound, cst.Name):
            names.add(bound.value)
    return names


class _Undecidable(Exception):
    """A branch test that does not read only ``self``'s attributes and constants."""
