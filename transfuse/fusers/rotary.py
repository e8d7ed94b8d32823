"""Rotary position embedding: a call of a function that computes rotate-half RoPE on q and k →
``rotary(q, k, cos, sin, unsqueeze_dim)``, one fused op (on GPU one kernel for both, forward
and backward, where the model's own function is about ten elementwise kernels and a
concatenation each way).

Models call RoPE through a module-level function of their own (transformers copies
``apply_rotary_pos_emb`` into every modeling file, with variants: partial rotary, interleaved
pairs, multimodal sections). A function is taken for the fused op only when both hold:

* **Its graph** (``torch.fx`` traces it on its own) has only the operations rotate-half RoPE is
  made of: multiplications, additions, negations, a concatenation and slices of q and k, and an
  ``unsqueeze`` of cos and sin. Every value is then a polynomial in the inputs' elements, and
  cos and sin are read only through that ``unsqueeze``, never their shape: a function that slices
  q by cos's width (partial rotary) or computes anything else is refused.
* **Its values** equal the fused op's native definition bit for bit on random inputs, in float32
  and bfloat16, at two head widths, with its own arguments. Two polynomials that agree at random
  real points are the same polynomial (with probability one), so with the first condition this
  is a proof up to that probability, not a sample.

Each call site in the forward must pass q, k, cos and sin positionally, and constants for the
function's other parameters; the unsqueeze dimension the function applies is found by the check
(1 for ``[batch, heads, tokens, dim]``, 2 for ``[batch, tokens, heads, dim]``).

A call may pass a fifth argument (``position_ids``) when the function, traced with that parameter
free, either never reads it (a parameter kept for compatibility) or reads cos and sin only at it
(``cos[position_ids].unsqueeze(dim)``, the older transformers form, tables squeezed of leading
ones first or not): the proof is then run for that call form, tables and positions included, and
the fused op reads the tables itself. Forms the op does not compute are refused each with its own
tag, found from the graph of the functions the forward calls: interleaved pairs
(``rotary.interleaved``), a rotary width read from cos (``rotary.partial``), complex frequencies
(``rotary.complex``), and a function applied to one tensor at a time (``rotary.one-tensor``).
The fused op replaces calls in the forward only: RoPE called in a method of the class that the
forward calls (``self._projections_and_rope(...)``), or a static method of the class that is
itself the RoPE (``self.apply_rotary(...)``), is refused (``rotary.in-method``), or with the tag of
its form where the op would not compute it anyway.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
from dataclasses import dataclass
from typing import Any

import libcst as cst
import libcst.matchers as m
import torch
import torch.fx as fx
from torch import nn

from ..ops.rotary import set_prover
from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Fused, Refusal, SourceFuser
from ..rewriter.graph import NoMatch
from ..rewriter.source import EditContext
from ..rewriter.syntax import expression_code, replace_nodes
from ..rewriter.tracer import unwrapped_forward

__all__ = ["RotaryFuser", "RotaryMatch", "prove", "rotary_unsqueeze_dim"]


# How a call passes its arguments: (a fifth argument is passed, cos and sin are read at it).
Form = tuple[bool, bool]
FOUR: Form = (False, False)
INDEXED: Form = (True, True)
IGNORED_FIFTH: Form = (True, False)


@dataclass(frozen=True)
class RotaryMatch:
    """The module-level functions of the forward that compute rotate-half RoPE, with the call
    forms proved for each and the unsqueeze dimension it applies: ``((name, ((form, dim), ...)), ...)``."""

    functions: tuple[tuple[str, tuple[tuple[Form, int], ...]], ...]


# What a rotate-half RoPE function's graph may hold besides its inputs and output.
_FUNCTIONS = {operator.mul, operator.add, operator.neg, operator.getitem, operator.floordiv, operator.sub, torch.cat}
_METHODS = {"unsqueeze", "squeeze", "size"}


class RotaryFuser(SourceFuser[RotaryMatch]):
    kind = "rotary"

    def wants(self, module: nn.Module) -> bool:
        forward = unwrapped_forward(type(module))
        methods = _methods_called(type(module), forward)
        if any(static for _, _, static in methods):
            return True  # a static method may be the RoPE itself
        return any(_candidates(f) or _own_functions(f) for f in [forward] + [method for _, method, _ in methods])

    def match(self, analysis: ClassAnalysis) -> RotaryMatch | Refusal | None:
        forward = unwrapped_forward(analysis.cls)
        if _calls_the_op(forward):
            return None  # already the fused form (an emitted modeling file's forward)
        found = []
        for name, function in _candidates(forward):
            forms = tuple((form, dim) for form in (FOUR, INDEXED, IGNORED_FIFTH) if (dim := prove(function, form)))
            if forms:
                found.append((name, forms))
        if found:
            return RotaryMatch(tuple(found))
        for name, function in _own_functions(forward):
            near = _near_miss(function)
            if near is not None:
                tag, why = near
                return Refusal(tag, f"{name} {why}", analysis.where())
        for name, method, static in _methods_called(analysis.cls, forward):
            refusal = _in_method(name, method, static)
            if refusal is not None:
                return Refusal(*refusal, analysis.where())
        return None

    def edit(self, tree: cst.FunctionDef, found: RotaryMatch, context: EditContext) -> cst.FunctionDef:
        forms = {name: dict(proved) for name, proved in found.functions}
        function_globals = context.source.function.__globals__
        replacements = []
        for call in m.findall(tree, m.Call(func=m.Name())):
            name = call.func.value
            if name not in forms:
                continue
            form, dim = _check_call(call, function_globals.get(name), name, forms[name])
            fused_op = context.require("transfuse.ops", "rotary")
            arguments = ", ".join(expression_code(arg.value) for arg in call.args[:4])
            # ``original``: the function by its global name, read at each call, so that a later patch
            # of the module's function (another library's kernel) is still honoured.
            fused = f"{fused_op}({arguments}, unsqueeze_dim={dim}, original={name}"
            if form[0]:
                fused += f", position_ids={expression_code(call.args[4].value)}"
            fused += ", indexed=True)" if form[1] else ")"
            replacements.append((call, cst.parse_expression(fused)))
        if not replacements:
            raise NoMatch("rotary.placement", f"no call of {', '.join(forms)} in the forward passes q, k, cos and sin.")
        return replace_nodes(tree, replacements)

    def declaration(self, found: RotaryMatch) -> None:
        return None  # no module changes: the edited forward is the whole fusion

    def fuse(self, module: nn.Module, found: RotaryMatch) -> Fused:
        return Fused(replaced=tuple(name for name, _ in found.functions), into="rotary")


def _prove(function: Any, form: Form) -> int | None:
    """The op's check of an ``original`` function it has not seen (the same proof, once per
    function and call form: a function patched in after the rewrite, or an emitted file's own
    copy). The proof traces and runs the function on small CPU tensors; a wrapper taking ``*args``
    is not tried."""
    if not (isinstance(function, types.FunctionType) and _takes_four(function)):
        return None
    return prove(function, form)


def _calls_the_op(forward: Any) -> bool:
    from ..ops.rotary import rotary

    code = getattr(forward, "__code__", None)
    return code is not None and any(forward.__globals__.get(name) is rotary for name in code.co_names)


def _candidates(forward: Any) -> list[tuple[str, types.FunctionType]]:
    """Module-level Python functions the forward names that take at least q, k, cos and sin."""
    code = getattr(forward, "__code__", None)
    if code is None:
        return []
    found = []
    for name in code.co_names:
        value = forward.__globals__.get(name)
        # transfuse's own op (an emitted modeling file calls it) is already the fused form.
        ours = getattr(value, "__module__", "").startswith("transfuse.")
        if isinstance(value, types.FunctionType) and not ours and _takes_four(value):
            found.append((name, value))
    return found


def _positional(function: types.FunctionType) -> list[inspect.Parameter] | None:
    """The positional parameters, or None for a function taking ``*args`` or without a signature."""
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _takes_four(function: types.FunctionType) -> bool:
    """q, k, cos, sin, then parameters with defaults (the fifth may have none: the positions)."""
    positional = _positional(function)
    return positional is not None and len(positional) >= 4 and all(p.default is not p.empty for p in positional[5:])


def rotary_unsqueeze_dim(function: types.FunctionType) -> int | None:
    """The unsqueeze dimension (1 or 2) at which ``function(q, k, cos, sin)`` is rotate-half RoPE,
    proved as the module docstring says; None when it is not."""
    return prove(function, FOUR)


@functools.lru_cache(maxsize=512)
def prove(function: types.FunctionType, form: Form) -> int | None:
    """The unsqueeze dimension (1 or 2) at which ``function`` called in ``form`` is rotate-half
    RoPE (``(q, k, cos, sin)``, or with a fifth argument the function ignores or reads cos and sin
    at), proved as the module docstring says; None when it is not."""
    positional = _positional(function)
    if positional is None or len(positional) < (5 if form[0] else 4):
        return None
    if not form[0] and positional[4:5] and positional[4].default is positional[4].empty:
        return None
    if not _graph_is_polynomial(function, form):
        return None
    for dim in (1, 2):
        if _values_agree(function, dim, form):
            return dim
    return None


@functools.lru_cache(maxsize=512)
def _graph(function: types.FunctionType, fifth_free: bool = False) -> fx.Graph | None:
    """The function's fx graph, its parameters past q, k, cos and sin at their defaults (past the
    fifth with ``fifth_free``); None when fx cannot trace it (which is then not this pattern)."""
    try:
        return fx.symbolic_trace(function, concrete_args=_defaults(function, 5 if fifth_free else 4)).graph
    except Exception:  # noqa: BLE001
        return None


# fx checks each parameter given a constant (``concrete_args``) with an ``eq`` and an ``_assert``,
# or for ``None`` with an ``_assert_is_none``.
_CONSTANT_CHECKS = (operator.eq, torch._assert, fx._symbolic_trace._assert_is_none)


def _graph_is_polynomial(function: types.FunctionType, form: Form = FOUR) -> bool:
    graph = _graph(function, form[0])
    if graph is None:
        return False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) < (5 if form[0] else 4):
        return False
    positions = placeholders[4] if form[0] else None
    if positions is not None and bool(positions.users) != form[1]:
        return False  # read when it should be ignored, or the reverse
    tables = set(placeholders[2:4])  # cos and sin, squeezed or read at the positions
    cos_sin = set()  # their unsqueezed forms
    constant_checks = set(placeholders[5:] if form[0] else placeholders[4:])
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in _CONSTANT_CHECKS:
            if set(node.all_input_nodes) <= constant_checks:
                constant_checks.add(node)
                continue
            return False
        if not _allowed(node):
            return False
        if positions in node.all_input_nodes:
            # positions only index a table: ``cos[position_ids]``
            if not (_is_call(node, operator.getitem) and node.args[0] in tables and node.args[1] is positions):
                return False
            tables.add(node)
            continue
        if not _reads_cos_sin_as_rope(node, tables, cos_sin):
            return False
    return True


def _allowed(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _FUNCTIONS or (node.target is getattr and node.args[1] == "shape")
    return node.op == "call_method" and node.target in _METHODS


def _is_call(node: fx.Node, target: Any) -> bool:
    return node.op == "call_function" and node.target is target


def _reads_cos_sin_as_rope(node: fx.Node, tables: set[fx.Node], cos_sin: set[fx.Node]) -> bool:
    """cos and sin (or their squeezes) are read only by an unsqueeze, and that only by products:
    never sliced, never measured (a width taken from cos is partial rotary). Adds ``node`` to the
    set it joins."""
    read = set(node.all_input_nodes) & (tables | cos_sin)
    if not read:
        return True
    method = node.target if node.op == "call_method" else None
    if method in ("unsqueeze", "squeeze") and node.args[0] in tables and len(node.all_input_nodes) == 1:
        (tables if method == "squeeze" else cos_sin).add(node)
        return True
    return _is_call(node, operator.mul) and read <= cos_sin


def _defaults(function: types.FunctionType, start: int = 4) -> dict[str, Any]:
    params = list(inspect.signature(function).parameters.values())
    return {p.name: p.default for p in params[start:] if p.default is not p.empty}


def _values_agree(function: types.FunctionType, dim: int, form: Form = FOUR) -> bool:
    # On the CPU whatever the default device is (a rewrite under ``with torch.device("meta")``).
    with torch.device("cpu"):
        return _values_agree_on_cpu(function, dim, form)


def _values_agree_on_cpu(function: types.FunctionType, dim: int, form: Form) -> bool:
    from ..ops import rotary_native

    generator = torch.Generator().manual_seed(0)
    for width in (8, 16):
        for dtype in (torch.float32, torch.bfloat16):
            shape_q, shape_k = ((2, 4, 5, width), (2, 2, 5, width)) if dim == 1 else ((2, 5, 4, width), (2, 5, 2, width))
            q, k = (torch.randn(s, generator=generator).to(dtype) for s in (shape_q, shape_k))
            positions = torch.randint(0, 7, (2, 5), generator=generator)
            if form[1]:  # tables of 7 positions, as they are held: [7, width] or [1, 1, 7, width]
                tables = [torch.randn(7, width, generator=generator).to(dtype) for _ in range(2)]
                cases = [(tuple(t.view(shape) for t in tables), tuple(t[positions] for t in tables))
                         for shape in ((7, width), (1, 1, 7, width))]  # fmt: skip
            else:
                cos, sin = (torch.randn(2, 5, width, generator=generator).to(dtype) for _ in range(2))
                cases = [((cos, sin), (cos, sin))]
            taken = 0
            for passed, read in cases:
                try:
                    got = function(q, k, *passed, *([positions] if form[0] else []))
                except Exception:  # noqa: BLE001 - a function that cannot take these shapes is not this one
                    continue
                want = rotary_native(q, k, *read, unsqueeze_dim=dim)
                if not _same(got, want):
                    return False
                taken += 1
            if not taken:
                return False
    return True


def _same(got: Any, want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    if not (isinstance(got, tuple) and len(got) == 2):
        return False
    return all(isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


def _check_call(call: cst.Call, function: Any, name: str, forms: dict[Form, int]) -> tuple[Form, int]:
    """A call site the fused op can take: q, k, cos, sin by position (and a fifth argument where
    its form was proved), the rest left at the defaults the proof used. Its form and dimension."""
    if not isinstance(function, types.FunctionType) or not any(prove(function, form) for form in forms):
        raise NoMatch("rotary.placement", f"{name} is rebound in the forward's module.")
    by_position = not any(arg.keyword is not None or arg.star for arg in call.args)
    for form in ((INDEXED, IGNORED_FIFTH) if len(call.args) == 5 else (FOUR,)) if by_position else ():
        if form in forms:
            return form, forms[form]
    raise NoMatch(
        "rotary.arguments",
        f"{name}({', '.join(expression_code(a.value) for a in call.args)}) does not pass q, k, cos and sin "
        "by position (and at most a fifth argument the function ignores or reads cos and sin at); the fused "
        "op was proved with the function's defaults for the rest.",
    )


# ---- forms the op does not compute, each with its tag ------------------------------------


def _own_functions(forward: Any) -> list[tuple[str, types.FunctionType]]:
    """Functions of the forward's own module that it names taking two or more arguments, and the
    candidates from elsewhere: where a RoPE the op does not compute would be."""
    code = getattr(forward, "__code__", None)
    if code is None:
        return []
    found = []
    for name in code.co_names:
        value = forward.__globals__.get(name)
        if not isinstance(value, types.FunctionType) or value.__module__.startswith("transfuse."):
            continue
        if value.__globals__ is forward.__globals__ or _takes_four(value):
            positional = _positional(value)
            if positional is not None and len(positional) >= 2:
                found.append((name, value))
    return found


def _methods_called(cls: type, forward: Any) -> list[tuple[str, types.FunctionType, bool]]:
    """The methods of ``cls`` the forward names, and those they name in turn: (name, function,
    whether it is static). Names that are not methods of the class (child modules) are passed over."""
    found, seen, todo = [], {"forward"}, [forward]
    while todo:
        code = getattr(todo.pop(), "__code__", None)
        for name in code.co_names if code is not None else ():
            if name in seen:
                continue
            seen.add(name)
            value = inspect.getattr_static(cls, name, None)
            static = isinstance(value, staticmethod)
            function = value.__func__ if static else value
            if isinstance(function, types.FunctionType):
                found.append((name, function, static))
                todo.append(function)
    return found


def _in_method(name: str, method: types.FunctionType, static: bool) -> tuple[str, str] | None:
    """(tag, sentence) for RoPE computed in a method the forward calls; None where it holds none.
    Below the forward, a form the op does not compute is named only for functions of four or more
    arguments (q, k, cos and sin): the graph test of ``_near_miss`` also takes other arithmetic of
    fewer arguments (relative position buckets) for a rotation of one tensor."""
    if static:
        near = _near_miss(method) if len(_positional(method) or ()) >= 4 else None
        if near is not None:
            return near[0], f"{name}, a static method of the class, {near[1]}"
        if _takes_four(method) and any(prove(method, form) for form in (FOUR, INDEXED, IGNORED_FIFTH)):
            return "rotary.in-method", f"{name} is rotate-half RoPE, but a static method of the class; {_FORWARD_ONLY}"
        return None
    for function_name, function in _candidates(method):
        if any(prove(function, form) for form in (FOUR, INDEXED, IGNORED_FIFTH)):
            return "rotary.in-method", f"{function_name} is called in {name}, a method the forward calls; {_FORWARD_ONLY}"
    for function_name, function in _own_functions(method):
        near = _near_miss(function) if len(_positional(function) or ()) >= 4 else None
        if near is not None:
            return near[0], f"{function_name} (called in {name}, a method the forward calls) {near[1]}"
    return None


_FORWARD_ONLY = "the fused op replaces calls of module-level functions in the forward only."


def _near_miss(function: types.FunctionType) -> tuple[str, str] | None:
    """(tag, the rest of a sentence) for a function whose graph rotates pairs of channels by cos
    and sin in a form the op does not compute; None for any other function."""
    if {"view_as_complex", "view_as_real"} <= set(function.__code__.co_names):  # fx cannot unpack shapes there
        return "rotary.complex", "rotates by complex frequencies (view_as_complex); the fused op takes cos and sin."
    graph = _graph(function)
    if graph is None:
        return None
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    names = {getattr(n.target, "__name__", n.target) for n in calls}
    # a rotation by cos and sin: products, a negation or a difference, halves or pairs put together
    if not ("mul" in names and names & {"neg", "sub"} and names & {"cat", "stack"} and names & {"add", "sub"}):
        return None
    interleaved = "stack" in names or "repeat_interleave" in names or any(_steps_by_two(n) for n in calls)
    if len(_positional(function) or ()) < 4:
        pairs = "interleaved pairs" if interleaved else "halves"
        return "rotary.one-tensor", (
            f"rotates {pairs} of one tensor at a time; the fused op rotates q and k in one call from q, k, cos and sin."
        )
    if interleaved:
        return "rotary.interleaved", "rotates interleaved pairs of channels; the fused op rotates halves."
    if any((_is_call(n, getattr) or n.target == "size") and n.args[0] in _cos_sin_views(graph) for n in calls):
        return "rotary.partial", "rotates a width read from cos (partial rotary); the fused op rotates the whole head."
    return "rotary.form", (
        "rotates halves of its inputs but is not rotate-half RoPE as the fused op computes it (other arithmetic)."
    )


def _cos_sin_views(graph: fx.Graph) -> set[fx.Node]:
    """cos and sin, and what only reshapes them (unsqueeze, squeeze, a cast)."""
    views = set([n for n in graph.nodes if n.op == "placeholder"][2:4])
    for node in graph.nodes:
        if node.op == "call_method" and node.target in ("unsqueeze", "squeeze", "to") and node.args[0] in views:
            views.add(node)
    return views


def _steps_by_two(node: fx.Node) -> bool:
    """``x[..., ::2]`` or ``x[..., 1::2]``."""
    if not _is_call(node, operator.getitem) or not isinstance(node.args[1], tuple):
        return False
    return any(isinstance(part, slice) and part.step == 2 for part in node.args[1])


set_prover(_prove)
