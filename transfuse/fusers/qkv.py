"""QKV: ``self.q(x)``, ``self.k(x)``, ``self.v(x)`` → ``q, k, v = self.qkv_proj(x).split(sizes)``.

Two or more linear projections that read the same value are one matrix multiply with their
weights concatenated. The graph finds them by dataflow (any names: ``wq/wk/wv``,
``query/key/value``); of three, q is the projection whose width differs (GQA), else they keep
their call order; more than three (gated attention: q, k, v and a gate) merge in call order.
Two merge when three do not read one value (MLA's ``q_a_proj`` and ``kv_a_proj_with_mqa``, k
and v of cross-attention, the input projections of linear attention), into ``pair_proj``,
unless they are a GLU (their outputs multiplied, each through ops of that value alone), which
is the gate/up fuser's. Where another call (a child module, a function) takes the same value
between the projections, the two or more called before it merge and the rest stay as written
(linear attention's q, k and v before ``self.forget_gate(x)``, then ``b_proj``). The split sizes
are read from the merged module at run time, never written into the source.

What one trace cannot show is proved on the source before the edit: each projection is
called exactly once as ``self.<name>(<name>)`` and used nowhere else in the forward; the
calls read the same variable; the calls sit in sibling statements, and between the first and
the last nothing rebinds that variable, writes a tensor in place, or hands the variable to
another call; no other linear reads it there. The merged call goes right before the first of
the statements, so it dominates every use. Projections called in a method of the class that the
forward calls (``q, k, v = self._project(x)``) are refused (``qkv.in-method``): an edit rewrites
the forward's source only. A module the probe never reached is traced with the call of a reached
one of its class; with none, it is traced without input values, stops where the forward needs
one, and is refused as not reached (``qkv.not-reached``).

A forward with two paths is proved on one (``rewriter/specialise.py``): where the proof fails
on the whole body, it is tried again on the body specialised to an optional argument being
None (bart's ``key_value_states``: q, k and v then read ``hidden_states``) or to an attribute
compared with None being None or not (MLA's ``self.q_lora_rank``; a projection that some
instances lack, whose None test is then no other use of it), or an attribute tested for truth
being false or true (a flag that takes k and v from another layer), or two of these at once
(gemma4: ``self.v_proj is not None and not self.is_kv_shared_layer``), and the forward runs that
body under that test and the original otherwise. Failing those, the proof is tried on the arm the
traced instance takes of the branches whose tests read only configuration values, plain
attributes and constant globals (a ``pretraining_tp > 1`` arm that slices the weights, which is
then no other use of them), guarded the same way, and in each arm of an if/else that calls every
projection once in each (``fusers/projections.py``), on the whole body or on a specialised one;
a projection called right above that if/else moves into both arms first (bart's q above ``if
past_key_value is not None:``, on the path where ``key_value_states`` is None). Another method
that only reads a projection (a base class's forward a subclass falls back to) is no obstacle: the
merge leaves a part under its name that computes what it did; one that rebinds it is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
import torch.fx as fx
from torch import nn

from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Fused, Refusal, SourceFuser
from ..rewriter.graph import NoMatch, ancestors, is_op, operands, peel_casts, value
from ..rewriter.source import EditContext
from ..rewriter.specialise import cases, guarded_by, specialise
from ..rewriter.weights import Merge, MergeError
from ..rewriter.branches import constant_tests
from .projections import (
    adapter_refusal,
    free_child_name,
    in_each_arm,
    linear_children,
    merge_calls,
    on_decided_path,
    wrapped_children,
)

__all__ = ["QKVFuser", "QKVMatch", "linear_calls_by_input"]

# Refusals of the proof that may not hold on one path of a forward that branches on an optional
# argument (``key_value_states`` of a shared self/cross-attention class) or on an attribute (a
# projection's own None test is another use of it).
_PATH_DEPENDENT = ("qkv.inputs-differ", "qkv.placement", "qkv.called-twice", "qkv.other-use")


@dataclass(frozen=True)
class QKVMatch:
    """The projections in merged order (q, k, v[, ...]), the merged child's name, every linear child."""

    parts: tuple[str, ...]
    into: str
    linears: frozenset[str]
    # The forward's branch tests the traced instance decides (``rewriter.branches.constant_tests``).
    decided: tuple[tuple[str, bool], ...] = ()

    @property
    def merge(self) -> Merge:
        return Merge(self.into, self.parts)


def linear_calls_by_input(analysis: ClassAnalysis, with_adapters: bool = False) -> dict[fx.Node, list[fx.Node]]:
    """Calls of linear children (and of adapter-wrapped ones, if asked) with one positional input,
    grouped by that input."""
    linears = linear_children(analysis) | (wrapped_children(analysis) if with_adapters else set())
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in analysis.trace.graph.nodes:
        if node.op == "call_module" and node.target in linears and len(node.args) == 1 and not node.kwargs:
            groups[node.args[0]].append(node)
    return groups


def _width(node: fx.Node) -> int | None:
    out = value(node)
    return out.shape[-1] if hasattr(out, "shape") else None


def _roles(calls: list[fx.Node], analysis: ClassAnalysis) -> tuple[str, str, str]:
    """(q, k, v): q is the one whose width differs; in call order when all are equal, or all differ
    (MLA's q_a, kv_a and a gate: the merge does not depend on the roles)."""
    widths = [_width(c) for c in calls]
    names = [c.target for c in calls]
    if None in widths or len(set(widths)) in (1, 3):
        return tuple(names)
    for i in range(3):
        others = [w for j, w in enumerate(widths) if j != i]
        if others[0] == others[1]:
            return (names[i], *[n for j, n in enumerate(names) if j != i])
    return tuple(names)


class QKVFuser(SourceFuser[QKVMatch]):
    kind = "qkv"

    def wants(self, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) or hasattr(c, "get_base_layer") for c in module.children()) >= 2

    def match(self, analysis: ClassAnalysis) -> QKVMatch | Refusal | None:
        wrapped = linear_children(analysis) | wrapped_children(analysis)
        for calls in _groups(analysis, linear_calls_by_input(analysis, with_adapters=True), wrapped):
            refusal = adapter_refusal(analysis, self.kind, [c.target for c in calls])
            if refusal is not None:
                return refusal
        by_input = linear_calls_by_input(analysis)
        groups = _groups(analysis, by_input, linear_children(analysis))
        if not groups:
            return _split_inputs(analysis, by_input) or _cast_inputs(analysis, by_input) or _unreached(analysis)
        calls = _before_other_readers(groups[0])
        try:
            names = [c.target for c in calls]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise NoMatch("qkv.called-twice", f"{twice[0]} is called more than once on the same input.", calls[0])
            parts = _roles(calls, analysis) if len(calls) == 3 else tuple(names)
        except NoMatch as refusal:
            return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node))
        into = free_child_name(analysis, "qkv_proj" if len(parts) >= 3 else "pair_proj")
        return QKVMatch(parts, into, frozenset(linear_children(analysis)), constant_tests(analysis))

    def edit(self, tree: cst.FunctionDef, found: QKVMatch, context: EditContext) -> cst.FunctionDef:
        def merged(body: cst.FunctionDef) -> cst.FunctionDef:
            return merge_calls(body, found.parts, found.into, found.linears, context, self.kind)

        try:
            return merged(tree)
        except NoMatch as refusal:
            if refusal.tag not in _PATH_DEPENDENT:
                raise
            # A forward with two paths (an attention class shared by self- and cross-attention, MLA
            # with or without a low-rank query, a projection that may be None): on one, the
            # projections may provably read one value.
            # On that path, the projections may also be called alike in both arms of an if/else
            # (bart's k and v with a cache and without, q above the if).
            for specialised, tests in _paths(tree):
                for attempt in (merged, lambda body: in_each_arm(body, found.parts, merged, self.kind)):
                    try:
                        edited = attempt(specialised)
                    except NoMatch:
                        continue
                    return guarded_by(tree, edited, tests, f"{', '.join(found.parts)} read one value")
            # Branches on configuration values (a weight-slicing arm for ``pretraining_tp > 1``), or
            # the projections written alike in both arms of one if/else.
            why = f"{', '.join(found.parts)} read one value"
            for attempt in (
                lambda: on_decided_path(tree, found.decided, merged, context, self.kind, why),
                lambda: in_each_arm(tree, found.parts, merged, self.kind),
            ):
                try:
                    return attempt()
                except NoMatch:
                    continue
            raise

    def rebuilt_children(self, found: QKVMatch) -> tuple[str, ...]:
        return found.parts

    def declaration(self, found: QKVMatch) -> Merge:
        return found.merge

    def validate(self, module: nn.Module, found: QKVMatch) -> Refusal | None:
        try:
            found.merge.check(module)
        except MergeError as exc:
            return Refusal("qkv.instance", str(exc))
        return None

    def fuse(self, module: nn.Module, found: QKVMatch) -> Fused:
        merged = found.merge.apply(module)
        return Fused(replaced=found.parts, into=type(merged).__name__, undo=lambda: found.merge.undo(module))


def _groups(analysis: ClassAnalysis, by_input: dict[fx.Node, list[fx.Node]], linears: set[str]) -> list[list[fx.Node]]:
    """The groups to merge: three or more calls on one input; else two (MLA's low-rank pair, k and
    v of cross-attention), unless their outputs are multiplied together: a GLU, the gate/up fuser's."""
    groups = [calls for calls in by_input.values() if len(calls) >= 3]
    if groups:
        return groups
    return [
        calls
        for calls in by_input.values()
        if len(calls) == 2 and calls[0].target != calls[1].target and not _multiplied(analysis, calls, linears)
    ]


def _before_other_readers(calls: list[fx.Node]) -> list[fx.Node]:
    """The calls before the first other call that takes their input (a child module, a function),
    where two or more come before it: those merge, and the ones after it stay as written. What such
    a call does to the value is not this class's to see (kimi_linear's ``self.forget_gate(x)``
    between q, k, v and ``b_proj``); the source proof then covers only the calls before it."""
    source, ours = calls[0].args[0], set(calls)
    order = {node: i for i, node in enumerate(calls[0].graph.nodes)}
    span = [n for n in order if order[calls[0]] < order[n] < order[calls[-1]]]
    for node in span:
        if node not in ours and node.op in ("call_module", "call_function") and source in node.all_input_nodes:
            before = [c for c in calls if order[c] < order[node]]
            return before if len(before) >= 2 else calls
    return calls


def _multiplied(analysis: ClassAnalysis, calls: list[fx.Node], linears: set[str]) -> bool:
    """Whether two equally wide projections are a GLU: their outputs meet in a product, each through
    ops of that one value only (an activation, casts, a scale by a constant, views)."""

    def reaches(node, target: fx.Node) -> bool:
        while isinstance(node, fx.Node):
            if node is target:
                return True
            # The module's own attributes (``self.gate_multiplier``) are constants here, not inputs.
            inputs = [n for n in node.all_input_nodes if n.op != "get_attr"]
            if len(inputs) != 1 or (node.op == "call_module" and node.target in linears):
                return False
            node = inputs[0]
        return False

    a, b = calls
    if _width(a) != _width(b):
        return False
    for node in analysis.trace.graph.nodes:
        if is_op(node, "mul") and len(operands(node)) >= 2:
            left, right = operands(node)[:2]
            if (reaches(left, a) and reaches(right, b)) or (reaches(left, b) and reaches(right, a)):
                return True
    return False


def _split_inputs(analysis: ClassAnalysis, by_input: dict[fx.Node, list[fx.Node]]) -> Refusal | None:
    """Three projections none of which feeds another, two reading one value and the third another:
    q, k and v of cross-attention, or of a value rebound between the calls. Only projections of one
    value merge, so this is refused (with the reason) rather than passed over in silence."""
    calls = [c for group in by_input.values() for c in group]
    independent = {c for c in calls if not any(other in ancestors(c) for other in calls if other is not c)}
    for source, group in by_input.items():
        pair = [c for c in group if c in independent]
        odd = [c for c in independent if c not in group]
        if len(pair) == 2 and odd:
            read = getattr(source, "name", source)
            return Refusal(
                "qkv.inputs-differ",
                f"{pair[0].target} and {pair[1].target} read {read}, but {odd[0].target} reads "
                f"{getattr(odd[0].args[0], 'name', odd[0].args[0])}: only projections of one value merge.",
                analysis.where(odd[0]),
            )
    arguments = [c for c in independent if isinstance(c.args[0], fx.Node) and c.args[0].op == "placeholder"]
    if len(arguments) >= 3 and len({c.args[0] for c in arguments}) == len(arguments):
        return Refusal(
            "qkv.inputs-differ",
            f"{', '.join(c.target for c in arguments)} read the forward's arguments "
            f"{', '.join(c.args[0].name for c in arguments)}, not one value: whether a caller passes one tensor for "
            "all of them is not this class's to prove.",
            analysis.where(arguments[0]),
        )
    return None


def _cast_inputs(analysis: ClassAnalysis, by_input: dict[fx.Node, list[fx.Node]]) -> Refusal | None:
    """Projections of one value, one of them reading it cast (hy_v4's indexer: ``wk(x)`` beside
    ``weights_proj(x.float())``): a merged projection would compute both in one dtype, so this is
    refused (with the reason) rather than passed over in silence."""
    by_base: dict[object, list[tuple[fx.Node, list]]] = defaultdict(list)
    for source, group in by_input.items():
        base, casts = peel_casts(source)
        by_base[base].extend((call, casts) for call in group)
    for base, calls in by_base.items():
        call, casts = next(((c, k) for c, k in calls if k), (None, None))
        other = next((c for c, _ in calls if call is not None and c.args[0] is not call.args[0]), None)
        if other is not None:
            return Refusal(
                "qkv.inputs-differ",
                f"{other.target} reads {getattr(other.args[0], 'name', other.args[0])} and {call.target} reads "
                f"{getattr(base, 'name', base)} cast to {casts[0].describe()}: a merged projection would compute both "
                "in one dtype.",
                analysis.where(call),
            )
    return None


def _unreached(analysis: ClassAnalysis) -> Refusal | None:
    """Two or more linear children of which the trace saw too few calls to group: a list of linears
    (no forward of its own; the module holding it calls them), a module the probe never reached (nor
    another of its class, whose call it would be traced with), or a trace that stopped first."""
    linears = linear_children(analysis)
    called = {n.target for n in analysis.trace.graph.nodes if n.op == "call_module" and n.target in linears}
    if len(linears) < 2 or not analysis.trace.partial or len(called) == len(linears):
        return None
    if issubclass(analysis.cls, (nn.ModuleList, nn.ModuleDict)):
        return Refusal(
            "qkv.module-list",
            f"the {len(linears)} linears of this {analysis.cls.__name__} are called by the module that holds it, "
            "whose forward is not this class's: members of a list are not merged.",
            analysis.where(),
        )
    if not analysis.had_example:
        return Refusal(
            "qkv.not-reached",
            f"the probe input never reached this module, nor another of its class, so its forward was traced "
            f"without input values and stopped before {len(linears) - len(called)} of its {len(linears)} linear "
            f"children ({analysis.trace.describe_stop()}): which of them read one value is not known. Pass "
            "example_inputs that reach it.",
            analysis.where(),
        )
    return Refusal(
        "qkv.partial-trace",
        f"the forward could not be traced past its first {len(called)} of {len(linears)} linear children "
        f"({analysis.trace.describe_stop()}), so which of them read one value is not known.",
        analysis.where(),
    )


def _paths(tree: cst.FunctionDef):
    """The forward specialised to one path, then to two conditions at once, as (body, the tests that
    select it): an optional argument or an attribute being None (``rewriter/specialise.py``), or an
    attribute tested for truth (``if self.is_shared:``) being false or true. gemma4's attention
    needs two: ``self.v_proj is not None`` (v is k where it is None) and ``not
    self.is_kv_shared_layer`` (k and v come from another layer where it is true)."""
    singles = [(body, [test]) for body, test in _specialisations(tree)]
    yield from singles
    for body, tests in singles:
        for deeper, test in _specialisations(body):
            if test not in tests:
                yield deeper, [*tests, test]


def _specialisations(tree: cst.FunctionDef):
    for subject, none in cases(tree):
        specialised = specialise(tree, subject, none)
        if specialised is not None:
            yield specialised, f"{subject} is {'' if none else 'not '}None"
    for subject in _flags(tree):
        for truth in (False, True):
            specialised = _specialise_flag(tree, subject, truth)
            if specialised is not None:
                yield specialised, subject if truth else f"not {subject}"


def _truth_tested(expression: cst.BaseExpression) -> list[cst.Attribute]:
    """The attributes of ``self`` whose truth alone an if's test uses: the test itself, under ``not``,
    or an operand of ``and``/``or`` in such a place (their value is not the test's value elsewhere)."""
    if m.matches(expression, m.Attribute(value=m.Name("self"), attr=m.Name())):
        return [expression]
    if m.matches(expression, m.UnaryOperation(operator=m.Not())):
        return _truth_tested(expression.expression)
    if isinstance(expression, cst.BooleanOperation):
        return _truth_tested(expression.left) + _truth_tested(expression.right)
    return []


def _tested_flags(tree: cst.FunctionDef) -> list[cst.Attribute]:
    tests = [node.test for node in m.findall(tree.body, m.If() | m.IfExp() | m.While())]
    negated = [node.expression for node in m.findall(tree.body, m.UnaryOperation(operator=m.Not()))]
    return [found for test in (*tests, *negated) for found in _truth_tested(test)]


def _flags(tree: cst.FunctionDef) -> list[str]:
    """Attributes of ``self`` tested for truth and never compared with None (those are ``cases``')."""
    none_tested = {subject for subject, _ in cases(tree)}
    found = []
    for node in _tested_flags(tree):
        subject = f"self.{node.attr.value}"
        if subject not in none_tested and subject not in found:
            found.append(subject)
    return found


def _specialise_flag(tree: cst.FunctionDef, subject: str, truth: bool) -> cst.FunctionDef | None:
    """``tree`` with the attribute ``subject`` false (or true) where only its truth is tested, folded.
    The truth tests become the constant, then ``specialise`` folds what is constant and refuses an
    attribute the body assigns. Its None tests on the subject are moot: ``_flags`` keeps none."""
    attribute = subject.partition(".")[2]
    tested = {id(node) for node in _tested_flags(tree) if node.attr.value == attribute}
    substituted = tree.visit(_Constant(tested, truth))
    return specialise(substituted, subject, none=False)


class _Constant(cst.CSTTransformer):
    def __init__(self, nodes: set[int], truth: bool):
        self.nodes, self.truth = nodes, truth

    def leave_Attribute(self, original_node, updated_node):
        return cst.Name(repr(self.truth)) if id(original_node) in self.nodes else updated_node
