"""A method's body specialised to one optional argument being None, folded on the syntax tree.

Some forwards take one of two paths on an optional argument: an attention class shared by
self- and cross-attention projects ``key_value_states if is_cross_attention else
hidden_states``, with ``is_cross_attention = key_value_states is not None``. With the argument
None, that flag, the branches it guards and the variable it selects are constants, and q, k
and v provably read one value. ``specialise(function, name)`` substitutes None for the argument
and folds what is then constant:

* ``None is None``, ``not False``, ``False and x``, ``a if True else b`` and the like;
* ``if`` statements whose test is constant, replaced by the branch that runs;
* a variable bound once, in the function's top-level block, to a constant or to a parameter
  that is never rebound: its later reads become that value.

Each fold is exact in Python's semantics (an expression that could have an effect is never
dropped; ``False and f()`` is ``False`` because ``f()`` never runs), so the specialised body
equals the original whenever the argument is None. ``guarded(function, specialised, name)``
is the method that runs the specialised body when the argument is None and the original
otherwise; an edit proved on the specialised body then holds on the path it covers.

``decide(function, decisions)`` folds the same way a body whose branch tests are known for one
instance (a test on a configuration value, ``if self.config.pretraining_tp > 1``, decided by
``rewriter.branches.constant_tests``): each such test becomes its value, and the arm not taken goes.
"""

from __future__ import annotations

from collections import defaultdict

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ExpressionContext, ExpressionContextProvider, MetadataWrapper

from .syntax import comment_line

__all__ = ["cases", "decide", "guarded", "guarded_by", "pure", "specialise"]

_CONSTANTS = {"True": True, "False": False, "None": None}
_MAX_PASSES = 16


def cases(function: cst.FunctionDef) -> list[tuple[str, bool]]:
    """What a forward may be specialised on, as (subject, is None): each parameter whose default is
    None, being None; each attribute of ``self`` the body compares with None, being None or not."""
    params = [*function.params.params, *function.params.kwonly_params]
    found = [(p.name.value, True) for p in params if p.default is not None and m.matches(p.default, m.Name("None"))]
    for comparison in m.findall(function.body, m.Comparison()):
        for subject in _none_tested(comparison):
            if subject.startswith("self.") and (subject, False) not in found:
                found += [(subject, False), (subject, True)]
    return found


def specialise(function: cst.FunctionDef, subject: str, none: bool = True) -> cst.FunctionDef | None:
    """``function`` with ``subject`` (a parameter, or ``self.<attribute>``) None or not None, folded.

    None if the subject is rebound in the body (an attribute assigned or deleted, ``self``
    rebound) or nothing folds. An attribute of ``self`` is taken to keep its value through one
    call, as the tracer's per-instance flags are. A function of the source alone: a result is
    kept by the function's code, and a path search that reaches the same body again (the same
    two conditions in either order) folds it once.
    """
    key = (cst.Module(body=[function]).code, subject, none)
    if key not in _SPECIALISED:
        if len(_SPECIALISED) >= _KEPT:
            _SPECIALISED.clear()
        _SPECIALISED[key] = _specialise(function, subject, none)
    return _SPECIALISED[key]


# Specialised bodies by (the function's code, subject, none); syntax trees are immutable.
_SPECIALISED: dict[tuple[str, str, bool], cst.FunctionDef | None] = {}
_KEPT = 512


def _specialise(function: cst.FunctionDef, subject: str, none: bool) -> cst.FunctionDef | None:
    module = cst.Module(body=[function])
    stores, loads = _names(module)
    params = _parameters(function)
    if "." in subject:
        owner, _, attribute = subject.partition(".")
        if owner not in params or len(stores[owner]) != 1 or _assigns_attribute(function, owner, attribute):
            return None
    else:
        if not none or subject not in params or len(stores[subject]) != 1:
            return None  # a parameter is specialised to None, and only if never rebound
        keywords = _keyword_names(module)
        module = module.visit(_Substitute({id(n): _constant(None) for n in loads[subject] if id(n) not in keywords}))
    result = _folded(module, params, {subject: none}).body[0]
    return None if result.deep_equals(function) else result


def decide(function: cst.FunctionDef, decisions: dict[str, bool]) -> tuple[cst.FunctionDef, list[str]] | None:
    """``function`` with each ``if``/conditional expression whose test's code is in ``decisions``
    replaced by the arm that value takes, folded, and the tests so decided (their code, in source
    order); None if none is found. The tests must read nothing the body assigns (``constant_tests``
    proves it)."""
    tests = [n.test for n in m.findall(function.body, m.If() | m.IfExp()) if _code(n.test) in decisions]
    if not tests:
        return None
    module = cst.Module(body=[function]).visit(_Decided({id(t): decisions[_code(t)] for t in tests}))
    result = _folded(module, _parameters(function), {}).body[0]
    if result.deep_equals(function):
        return None
    return result, list(dict.fromkeys(_code(t) for t in tests))


def _folded(module: cst.Module, params: set[str], known: dict[str, bool]) -> cst.Module:
    for _ in range(_MAX_PASSES):
        folded = _propagate(module.visit(_Fold(params, known)))
        if folded.deep_equals(module):
            break
        module = folded
    return module


class _Decided(cst.CSTTransformer):
    """Tests (by node identity) replaced by their decided values."""

    def __init__(self, values: dict[int, bool]):
        self.values = values

    def on_leave(self, original_node, updated_node):
        value = self.values.get(id(original_node))
        if value is None:
            return updated_node
        return _constant(value)


def _none_tested(comparison: cst.Comparison) -> list[str]:
    """The expressions a comparison tests for identity with None (``x is None``, ``None is not x``)."""
    if len(comparison.comparisons) != 1 or not isinstance(comparison.comparisons[0].operator, (cst.Is, cst.IsNot)):
        return []
    left, right = comparison.left, comparison.comparisons[0].comparator
    sides = [(left, right), (right, left)]
    return [_code(a) for a, b in sides if m.matches(b, m.Name("None")) and not m.matches(a, m.Name("None"))]


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node.with_changes(lpar=[], rpar=[]) if hasattr(node, "lpar") else node)


def _assigns_attribute(function: cst.FunctionDef, owner: str, attribute: str) -> bool:
    target = m.Attribute(value=m.Name(owner), attr=m.Name(attribute))
    written = [
        *(t.target for a in m.findall(function, m.Assign()) for t in a.targets),
        *(a.target for a in m.findall(function, m.AnnAssign() | m.AugAssign())),
        *(d.target for d in m.findall(function, m.Del())),
    ]
    return any(m.findall(w, target) or m.matches(w, target) for w in written) or bool(
        m.findall(function, m.Call(func=m.Name("setattr") | m.Name("delattr")))
    )


def guarded(function: cst.FunctionDef, specialised: cst.FunctionDef, subject: str, none: bool, why: str) -> cst.FunctionDef:
    """``if <subject> is [not] None: <specialised body> else: <original body>``, the docstring kept on top."""
    head, original = _split_docstring(function.body.body)
    _, special = _split_docstring(specialised.body.body)
    original, special = _without_leading_blank(original), _without_leading_blank(special)
    test = f"{subject} is {'' if none else 'not '}None"
    branch = cst.If(
        test=cst.parse_expression(test),
        body=cst.IndentedBlock(body=special),
        orelse=cst.Else(body=cst.IndentedBlock(body=original)),
        leading_lines=[comment_line(f"transfuse: where {test} this forward is specialised: {why}")],
    )
    return function.with_changes(body=function.body.with_changes(body=[*head, branch]))


def guarded_by(function: cst.FunctionDef, specialised: cst.FunctionDef, tests: list[str], why: str) -> cst.FunctionDef:
    """``if <tests joined by and>: <specialised body> else: <original body>``, the docstring kept on top."""
    test = " and ".join(tests)
    guarded_function = guarded(function, specialised, "None", True, why)  # its test and comment are replaced here
    *head, branch = guarded_function.body.body
    branch = branch.with_changes(
        test=cst.parse_expression(test),
        leading_lines=[comment_line(f"transfuse: where {test} this forward is specialised: {why}")],
    )
    return guarded_function.with_changes(body=guarded_function.body.with_changes(body=[*head, branch]))


# ---- reading the tree --------------------------------------------------------------------


def _names(module: cst.Module) -> tuple[dict[str, list[cst.Name]], dict[str, list[cst.Name]]]:
    """Every Name that binds and every Name that reads, by identifier (nested scopes included)."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    contexts = wrapper.resolve(ExpressionContextProvider)
    stores: dict[str, list[cst.Name]] = defaultdict(list)
    loads: dict[str, list[cst.Name]] = defaultdict(list)
    for node in m.findall(module, m.Name()):
        context = contexts.get(node)
        if context in (ExpressionContext.STORE, ExpressionContext.DEL):
            stores[node.value].append(node)
        elif context is ExpressionContext.LOAD:
            loads[node.value].append(node)
    # Names bound without a context (global/nonlocal declarations, imports) count as bindings.
    for declaration in m.findall(module, m.Global() | m.Nonlocal()):
        for item in declaration.names:
            stores[item.name.value].append(item.name)
    for alias in m.findall(module, m.ImportAlias()):
        bound = alias.asname.name if alias.asname is not None else alias.name
        if isinstance(bound, cst.Name):
            stores[bound.value].append(bound)
    return stores, loads


def _parameters(function: cst.FunctionDef) -> set[str]:
    p = function.params
    named = [*p.posonly_params, *p.params, *p.kwonly_params]
    star = [s for s in (p.star_arg, p.star_kwarg) if isinstance(s, cst.Param)]
    return {param.name.value for param in (*named, *star)}


def _keyword_names(module: cst.Module) -> set[int]:
    """Names that are keywords of call arguments (``f(x=...)``), which read nothing."""
    return {id(arg.keyword) for arg in m.findall(module, m.Arg()) if arg.keyword is not None}


def _constant(value) -> cst.Name:
    return cst.Name(repr(value))


def _known(node: cst.BaseExpression) -> tuple[bool, object]:
    """(True, value) for the constants True, False and None (parenthesised or not)."""
    if isinstance(node, cst.Name) and node.value in _CONSTANTS:
        return True, _CONSTANTS[node.value]
    return False, None


_ATOMS = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.SimpleString, cst.Integer, cst.Float)


def _in_place_of(original: cst.BaseExpression, replacement: cst.BaseExpression) -> cst.BaseExpression:
    """``replacement`` where ``original`` stood, parenthesised as needed to keep its precedence."""
    if original.lpar and not replacement.lpar:
        return replacement.with_changes(lpar=original.lpar, rpar=original.rpar)
    if not replacement.lpar and not isinstance(replacement, _ATOMS):
        return replacement.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return replacement


# ---- folding ------------------------------------------------------------------------------


class _Substitute(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, cst.BaseExpression]):
        self.replacements = replacements

    def leave_Name(self, original_node, updated_node):
        return self.replacements.get(id(original_node), updated_node)


class _Fold(cst.CSTTransformer):
    """One bottom-up pass of the constant folds."""

    def __init__(self, params: set[str], known: dict[str, bool]):
        self.params = params  # always bound: reading one has no effect
        self.known = known  # expression code -> whether it is None
        self.elifs: set[int] = set()  # ``elif`` nodes (an If's orelse): folded in place, not flattened

    def visit_If(self, node):
        if isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))
        return True

    def leave_Comparison(self, original_node, updated_node):
        if len(updated_node.comparisons) != 1:
            return updated_node
        (target,) = updated_node.comparisons
        for subject in _none_tested(updated_node):
            if subject in self.known:
                same = self.known[subject] == isinstance(target.operator, cst.Is)
                return _in_place_of(updated_node, _constant(same))
        (left_known, left), (right_known, right) = _known(updated_node.left), _known(target.comparator)
        if not (left_known and right_known):
            return updated_node
        if isinstance(target.operator, cst.Is):
            return _in_place_of(updated_node, _constant(left is right))
        if isinstance(target.operator, cst.IsNot):
            return _in_place_of(updated_node, _constant(left is not right))
        return updated_node

    def leave_UnaryOperation(self, original_node, updated_node):
        known, value = _known(updated_node.expression)
        if known and isinstance(updated_node.operator, cst.Not):
            return _in_place_of(updated_node, _constant(not value))
        return updated_node

    def leave_BooleanOperation(self, original_node, updated_node):
        known, value = _known(updated_node.left)
        if not known:
            return updated_node
        # `a and b` is a when a is false, else b; `a or b` is a when a is true, else b.
        keeps_left = (not value) if isinstance(updated_node.operator, cst.And) else bool(value)
        return _in_place_of(updated_node, updated_node.left if keeps_left else updated_node.right)

    def leave_IfExp(self, original_node, updated_node):
        known, value = _known(updated_node.test)
        if not known:
            return updated_node
        return _in_place_of(updated_node, updated_node.body if value else updated_node.orelse)

    def leave_If(self, original_node, updated_node):
        known, value = _known(updated_node.test)
        if id(original_node) in self.elifs:  # an elif stands where only an elif or an else can
            if not known:
                return updated_node
            if value:
                return cst.Else(body=updated_node.body)
            return updated_node.orelse if updated_node.orelse is not None else cst.RemovalSentinel.REMOVE
        if not known:
            empty = updated_node.orelse is None and all(_is_pass(s) for s in updated_node.body.body)
            if empty and pure(updated_node.test, self.params) and not updated_node.leading_lines:
                return cst.RemovalSentinel.REMOVE  # `if x is not None: pass`, left by a fold
            return updated_node
        if value:
            statements = list(updated_node.body.body)
        elif isinstance(updated_node.orelse, cst.Else):
            statements = list(updated_node.orelse.body.body)
        elif isinstance(updated_node.orelse, cst.If):  # elif: the next test, as an if of its own
            statements = [updated_node.orelse]
        else:
            statements = []
        if not statements:
            return cst.RemovalSentinel.REMOVE
        first = statements[0]
        statements[0] = first.with_changes(leading_lines=[*updated_node.leading_lines, *first.leading_lines])
        return cst.FlattenSentinel(statements)

    def leave_IndentedBlock(self, original_node, updated_node):
        if not updated_node.body:  # every statement of the block was folded away
            return updated_node.with_changes(body=[cst.SimpleStatementLine(body=[cst.Pass()])])
        return updated_node


def _is_pass(statement: cst.BaseStatement) -> bool:
    return m.matches(statement, m.SimpleStatementLine(body=[m.Pass()]))


def pure(test: cst.BaseExpression, params: set[str]) -> bool:
    """A test whose evaluation has no effect: parameters and constants compared by identity,
    negated or joined by ``and``/``or``."""
    if isinstance(test, cst.Name):
        return test.value in params or test.value in _CONSTANTS
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return pure(test.expression, params)
    if isinstance(test, cst.BooleanOperation):
        return pure(test.left, params) and pure(test.right, params)
    if isinstance(test, cst.Comparison):
        identities = all(isinstance(c.operator, (cst.Is, cst.IsNot)) for c in test.comparisons)
        return identities and all(pure(e, params) for e in (test.left, *(c.comparator for c in test.comparisons)))
    return False


def _propagate(module: cst.Module) -> cst.Module:
    """Reads of variables bound once at the top level to a constant or a never-rebound parameter."""
    function = module.body[0]
    stores, loads = _names(module)
    params = _parameters(function)
    top = function.body.body
    position: dict[int, int] = {}  # id(node) -> index of the top-level statement holding it
    for index, statement in enumerate(top):
        for node in m.findall(statement, m.Name()):
            position[id(node)] = index
    replacements: dict[int, cst.BaseExpression] = {}
    keywords = _keyword_names(module)
    for index, statement in enumerate(top):
        if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
            continue
        assign = statement.body[0]
        if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1):
            continue
        target, value = assign.targets[0].target, assign.value
        if not isinstance(target, cst.Name) or len(stores[target.value]) != 1:
            continue
        known, _ = _known(value)
        copy = (
            isinstance(value, cst.Name)
            and not value.lpar
            and value.value in params
            and len(stores[value.value]) == 1  # the parameter, never rebound
        )
        if not (known or copy):
            continue
        reads = [n for n in loads[target.value] if id(n) not in keywords]
        if any(position.get(id(n), -1) <= index for n in reads):
            continue  # read before it is bound (or outside the top level): leave it
        for node in reads:
            replacements[id(node)] = cst.Name(value.value)
    return module.visit(_Substitute(replacements)) if replacements else module


def _without_leading_blank(statements: list) -> list:
    """The first statement without the blank lines above it (its comments kept)."""
    if not statements:
        return statements
    first = statements[0]
    lines = list(first.leading_lines)
    while lines and lines[0].comment is None:
        lines.pop(0)
    return [first.with_changes(leading_lines=lines), *statements[1:]]


def _split_docstring(body) -> tuple[list, list]:
    body = list(body)
    if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])):
        return body[:1], body[1:]
    return [], body
