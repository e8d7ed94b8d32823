"""What the projection-merging fusers (qkv, gate_up) share: linear children, a free name for
the merged child, the proof that a projection is called exactly once and nowhere else, and the
edit that turns the calls of projections of one value into one merged call (proved first), and
the two ways such an edit is proved on a forward with branches: on the arm the traced instance
takes of branches on configuration values (``on_decided_path``), and in each arm of an if/else
that calls the projections once in each (``in_each_arm``)."""

from __future__ import annotations

import inspect
import types
from typing import Callable

import libcst as cst
import libcst.matchers as m
from torch import nn

from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Refusal
from ..rewriter.graph import NoMatch
from ..rewriter.source import EditContext, method_source, self_calls, self_references
from ..rewriter.specialise import decide, guarded_by, pure
from ..rewriter.syntax import (
    ParentMap,
    assigned_names,
    calls_taking,
    comment_line,
    expression_code,
    in_place_writes,
    replace_nodes,
    statement_block,
)

__all__ = [
    "adapter_refusal",
    "free_child_name",
    "in_each_arm",
    "linear_children",
    "merge_calls",
    "on_decided_path",
    "single_call",
    "wrapped_children",
]


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
    """The one call ``self.<name>(arg)``; refused if the projection is called or used otherwise, or
    called in another method of the class that ``tree`` calls (``<kind>.in-method``): an edit
    rewrites one method's source."""
    calls = self_calls(tree, name)
    method = _method_calling(tree, name, context.cls) if not calls else None
    if method is not None:
        raise NoMatch(
            f"{kind}.in-method",
            f"self.{name} is called in self.{method}, a method that {tree.name.value} calls, not in {tree.name.value}: "
            f"the merge rewrites the source of {tree.name.value} only.",
        )
    if len(calls) != 1:
        tag = f"{kind}.called-twice" if calls else f"{kind}.not-called"
        raise NoMatch(tag, f"self.{name}(...) is written {len(calls)} times in {tree.name.value}, not once.")
    if len(self_references(tree, name)) != 1:
        raise NoMatch(f"{kind}.other-use", f"self.{name} is used other than in its one call.")
    line = context.rebinds_elsewhere(name)
    if line is not None:
        raise NoMatch(f"{kind}.other-use", f"self.{name} is rebound by another method (line {line}).")
    call = calls[0]
    if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
        raise NoMatch(f"{kind}.input-expression", f"self.{name} is not called with one positional argument.")
    return call


def _method_calling(tree: cst.FunctionDef, name: str, cls: type) -> str | None:
    """The method of ``cls`` that calls ``self.<name>(...)`` among those ``tree`` calls through
    ``self``, directly or through one another (``self._project(x)`` projecting q, k and v), as
    the census reads them; None if none does. Static methods are not followed: no ``self``."""
    seen, pending = {tree.name.value}, [tree]
    while pending:
        for call in m.findall(pending.pop(0), m.Call(func=m.Attribute(value=m.Name("self")))):
            called = call.func.attr.value
            method = inspect.getattr_static(cls, called, None) if called not in seen else None
            seen.add(called)
            source = method_source(method) if isinstance(method, types.FunctionType) else None
            if source is None:
                continue
            if self_calls(source.node, name):
                return called
            pending.append(source.node)
    return None


def merge_calls(
    tree: cst.FunctionDef, parts: tuple[str, ...], into: str, linears: frozenset[str], context: EditContext, kind: str
) -> cst.FunctionDef:
    """The calls of the projections ``parts`` in ``tree`` become one call of the merged child ``into``,
    ``a_out, b_out, ... = self.<into>(x).split(self.<into>.split_sizes, dim=-1)`` placed right before
    the first of them, once the proof holds: each is called exactly once as ``self.<name>(<name>)``,
    on one variable, in sibling statements, and between the first and the last nothing rebinds the
    variable, writes a tensor in place or hands it to another call (``linears``: the class's linear
    children, named when one of them is that other reader). Refusals are tagged ``<kind>.*``."""
    calls = [_single_call(tree, name, context, kind) for name in parts]
    source = _common_input(calls, kind)
    parents = ParentMap(tree)
    block, first, last = _sibling_statements(calls, parents, kind)
    _prove_input_unchanged(block.body[first : last + 1], source, calls, linears, last - first, kind)
    outputs = [context.fresh_name(f"{name}_out") for name in parts]
    merged_call = cst.parse_expression(f"self.{into}({source}).split(self.{into}.split_sizes, dim=-1)")
    statement = cst.SimpleStatementLine(
        body=[cst.Assign(targets=[cst.AssignTarget(cst.parse_expression(", ".join(outputs)))], value=merged_call)],
        leading_lines=[
            *block.body[first].leading_lines,
            comment_line(f"transfuse: {', '.join(parts)} run as one merged projection"),
        ],
    )
    replacements = [(call, cst.Name(out)) for call, out in zip(calls, outputs)]
    # The first statement's comments now stand above the merged call.
    replacements.append((block.body[first], lambda updated: updated.with_changes(leading_lines=[])))
    return replace_nodes(tree, replacements, insert=(block, first, [statement]))


def _single_call(tree: cst.FunctionDef, name: str, context: EditContext, kind: str) -> cst.Call:
    call = single_call(tree, name, context, kind)
    if not isinstance(call.args[0].value, cst.Name):
        raise NoMatch(
            f"{kind}.input-expression",
            f"self.{name} is called on {expression_code(call.args[0].value)}, an expression, not a variable: "
            "merging would change how often it is evaluated.",
        )
    return call


def _common_input(calls: list[cst.Call], kind: str) -> str:
    names = [call.args[0].value.value for call in calls]
    if len(set(names)) != 1:
        raise NoMatch(f"{kind}.inputs-differ", f"the projections read different variables: {', '.join(names)}.")
    return names[0]


def _sibling_statements(calls: list[cst.Call], parents: ParentMap, kind: str) -> tuple[cst.IndentedBlock, int, int]:
    """The block holding the calls' statements, and the first and last statement's index."""
    placed = []
    for call in calls:
        if parents.in_nested_scope(call):
            raise NoMatch(f"{kind}.placement", "a projection is called inside a lambda, comprehension or nested function.")
        statement = parents.statement(call)
        if not isinstance(statement, cst.SimpleStatementLine):
            raise NoMatch(f"{kind}.placement", "a projection is called in the header of a compound statement.")
        placed.append(statement_block(parents, statement))
    blocks = {id(block) for block, _ in placed}
    if len(blocks) != 1:
        raise NoMatch(f"{kind}.placement", "the projections are called in different blocks (one is under a branch or loop).")
    indices = [i for _, i in placed]
    return placed[0][0], min(indices), max(indices)


def _prove_input_unchanged(statements, source: str, calls, linears: frozenset[str], span: int, kind: str) -> None:
    """Between the first and the last call, the input keeps its value."""
    for offset, statement in enumerate(statements):
        if offset < span and source in assigned_names(statement):
            raise NoMatch(f"{kind}.input-mutated", f"{source} is rebound between the projections.")
        writes = in_place_writes(statement)
        if writes:
            raise NoMatch(f"{kind}.input-mutated", f"{writes[0]} may change a tensor in place between the projections.")
        others = calls_taking(statement, source, exclude=tuple(calls))
        if others:
            callee = expression_code(others[0].func)
            if isinstance(others[0].func, cst.Attribute) and expression_code(others[0].func.value) == "self":
                if others[0].func.attr.value in linears:
                    raise NoMatch(f"{kind}.extra-reader", f"{callee} also reads {source} between the projections.")
            raise NoMatch(f"{kind}.input-mutated", f"{source} is passed to {callee} between the projections.")


Edit = Callable[[cst.FunctionDef], cst.FunctionDef]


def on_decided_path(
    tree: cst.FunctionDef, decided: tuple[tuple[str, bool], ...], edit: Edit, context: EditContext, kind: str, why: str
) -> cst.FunctionDef:
    """``edit`` proved on the arm the traced instance takes of the branches ``decided`` (their tests'
    code and values, ``rewriter.branches.constant_tests``): the forward runs that edited arm while
    the tests have those values, and the original forward otherwise. The arm not taken (a
    ``pretraining_tp > 1`` weight-slicing branch) is then no use of the projections. NoMatch where no
    decided test is in the forward, or the edit is refused on the arm taken too."""
    decisions = dict(decided)
    found = decide(tree, decisions)
    if found is None:
        raise NoMatch(f"{kind}.control-flow", "no branch of the forward is decided by the traced instance.")
    specialised, tests = found
    edited = edit(specialised)
    taken = [code if decisions[code] else f"not ({code})" for code in tests]
    context.notes.append(
        f"{context.cls.__name__}.{tree.name.value}: {kind} fused on the branch taken where "
        f"{' and '.join(taken)} (as the traced instance has it); where that changes, the original forward runs"
    )
    return guarded_by(tree, edited, taken, why)


_ARM = "_transfuse_arm"  # the test that marks the arm being edited (a name no source uses)


def in_each_arm(tree: cst.FunctionDef, names: tuple[str, ...], edit: Edit, kind: str) -> cst.FunctionDef:
    """``edit`` made in each arm of the one ``if``/``else`` whose two arms each call every projection
    in ``names`` once (a GLU written alike in both arms of a dtype test): each arm is edited as the
    forward with only that arm in place of the ``if``, and the two edited arms go back under the
    test. Projections called once in the statements right above the ``if`` and not in it (bart's
    ``query_states = self.q_proj(hidden_states)`` above ``if past_key_value is not None:``, whose
    arms each project k and v) are first moved into both arms with those statements
    (``_sunk_into_arms``). NoMatch where there is no such ``if``, a projection is used in its test
    or outside it, or an arm's edit is refused or changes the forward outside the arm."""
    tree = _sunk_into_arms(tree, names)
    branch = next((b for b in m.findall(tree.body, m.If()) if _calls_once_in_each_arm(b, names)), None)
    if branch is None:
        raise NoMatch(f"{kind}.called-twice", f"{', '.join(names)} are not called once in each arm of one if/else.")
    edits = []
    for block in (branch.body, branch.orelse.body):
        edited = edit(replace_nodes(tree, [(branch, cst.If(test=cst.Name(_ARM), body=block))]))
        marked = list(m.findall(edited.body, m.If(test=m.Name(_ARM))))
        if len(marked) != 1:
            raise NoMatch(f"{kind}.placement", "an arm's edit did not stay in its arm.")
        outside = replace_nodes(edited, [(marked[0], cst.If(test=cst.Name(_ARM), body=cst.IndentedBlock([])))])
        edits.append((edited, marked[0], outside))
    (edited, marked, outside), (_, other, other_outside) = edits
    if not outside.deep_equals(other_outside):
        raise NoMatch(f"{kind}.placement", "the two arms' edits change the forward outside the if differently.")
    arms = [marked.body, other.body]
    both = branch.with_changes(body=arms[0], orelse=branch.orelse.with_changes(body=arms[1]))
    return replace_nodes(edited, [(marked, both)])


def _sunk_into_arms(tree: cst.FunctionDef, names: tuple[str, ...]) -> cst.FunctionDef:
    """``tree`` with the simple statements right above an ``if``/``else`` moved to the start of both
    its arms, where those statements call once each projection of ``names`` the ``if`` does not use,
    and each arm calls the others once; else ``tree`` as it is. Exact where the test has no effect
    and reads only parameters (``past_key_value is not None``) that the moved statements do not
    rebind: it then has the value it had after them, and they run once on either path."""
    parents = ParentMap(tree)
    params = {p.name.value for p in (*tree.params.posonly_params, *tree.params.params, *tree.params.kwonly_params)}
    for branch in m.findall(tree.body, m.If()):
        inside = tuple(n for n in names if self_references(branch, n))
        outside = [n for n in names if n not in inside]
        block = parents.parent(branch)
        if not (inside and outside and isinstance(block, cst.IndentedBlock) and _calls_once_in_each_arm(branch, inside)):
            continue
        index = next(i for i, statement in enumerate(block.body) if statement is branch)
        first = index
        while first > 0 and isinstance(block.body[first - 1], cst.SimpleStatementLine):
            first -= 1
        while first < index and not any(self_references(block.body[first], n) for n in outside):
            first += 1
        moved = block.body[first:index]
        once = all(
            sum(len(self_calls(s, n)) for s in moved) == sum(len(self_references(s, n)) for s in moved) == 1
            for n in outside
        )
        bound = set().union(*(assigned_names(s) for s in moved)) if moved else set()
        read = {name.value for name in m.findall(branch.test, m.Name())}
        if not once or not pure(branch.test, params) or read & bound:
            continue
        head = [moved[0].with_changes(leading_lines=[]), *moved[1:]]
        sunk = branch.with_changes(
            body=branch.body.with_changes(body=[*head, *branch.body.body]),
            orelse=branch.orelse.with_changes(body=branch.orelse.body.with_changes(body=[*head, *branch.orelse.body.body])),
            leading_lines=[*moved[0].leading_lines, *branch.leading_lines],
        )
        body = [*block.body[:first], sunk, *block.body[index + 1 :]]
        return replace_nodes(tree, [(block, block.with_changes(body=body))])
    return tree


def _calls_once_in_each_arm(branch: cst.If, names: tuple[str, ...]) -> bool:
    if not isinstance(branch.orelse, cst.Else):
        return False
    return all(
        len(self_references(branch.test, name)) == 0
        and len(self_calls(branch.body, name)) == len(self_references(branch.body, name)) == 1
        and len(self_calls(branch.orelse.body, name)) == len(self_references(branch.orelse.body, name)) == 1
        for name in names
    )
