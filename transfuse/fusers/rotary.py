"""Rotary position embedding: a call of a function proved to compute RoPE in one of the op's layouts →
``rotary(q, k, cos, sin, unsqueeze_dim, <layout>)`` for q and k together, or ``rotary_one(x, cos,
sin, unsqueeze_dim, <layout>)`` for one tensor: one fused op (on GPU one kernel for both, forward and
backward, where the model's own function is about ten elementwise kernels and a concatenation each way).

Models call RoPE through a module-level function of their own (transformers copies
``apply_rotary_pos_emb`` into every modeling file, with variants). The op's layouts
(``transfuse/ops/rotary.py``) cover those variants: halves or interleaved pairs, tables read whole,
cut to their first half, widened by ``repeat_interleave`` or ``repeat``, a rotary width read from
cos with the rest passed through (partial rotary), computed from float32 copies or cast back. A
function is taken for the op in a layout only when both hold:

* **Its graph** (``torch.fx`` traces it on its own) has only the operations RoPE in those layouts is
  made of: products, sums, differences, negations, concatenations, stacks, slices, flattens and
  casts of the rotated tensors, and cos and sin read only through data movement (unsqueeze,
  squeeze, a cut of their width ``t[..., :w]`` or a new dimension ``t[:, None]``, never of their
  positions, which would be whole at the proof's sizes only; ``repeat_interleave``, ``repeat``, a
  concatenation or stack of themselves, casts) into products, and through their shape (the width of
  partial rotary and of a table's first half). Every value is then a polynomial in the inputs'
  elements, rounded where the casts and the input dtypes round.
* **Its values** equal the op's native definition in that layout bit for bit on random inputs, in
  float32, in bfloat16, and bfloat16 tensors with float32 tables, at two rotary widths (for partial
  rotary, one narrower than the head and one as wide), with its own arguments; the inputs are laid
  out as a model's (transposed heads, heads cut from wider ones) and the outputs must be laid out
  alike (the strides decide how the matmuls after them sum). Two such polynomials
  that agree at random real points are the same polynomial (with probability one), so with the
  first condition this is a proof up to that probability, not a sample. The layouts are
  enumerated (partial rotary and a table's first half only where the graph reads a table's width,
  casts only where it casts); the first that agrees is the function's, partial rotary before whole
  (a partial function called with tables as wide as the head is the whole form too). A whole layout
  is not taken for a function that reads a table's width and computes a value from tables narrower
  than the head: it does something there that the op does not (the passed channels first, say).

At run time the op hands a call outside what the proof covered to the function itself
(``transfuse.ops.rotary._outside``: tables narrower than the head for a whole layout, q and k of
two dtypes with a cast).

Each call site in the forward must pass its tensors, cos and sin positionally, and constants for
the function's other parameters; the unsqueeze dimension the function applies is found by the check
(1 for ``[batch, heads, tokens, dim]``, 2 for ``[batch, tokens, heads, dim]``). The call forms
(``CallForm``): ``(q, k, cos, sin)``; the same with a fifth argument (``position_ids``) that the
function, traced with that parameter free, either never reads (a parameter kept for compatibility)
or reads cos and sin only at (``cos[position_ids].unsqueeze(dim)``, the older transformers form,
tables squeezed of leading ones first or not: the fused op then reads the tables itself); and one
tensor with ``(cos, sin)`` or ``(sin, cos)`` (GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)``,
called once for q and once for k, each call its own ``rotary_one``). The proof runs in the call form,
tables and positions included.

A function with the graph of a rotation by cos and sin that the proof does not take is refused with
the tag of the form it has: complex frequencies (``rotary.complex``), sin and cos read from one
table (``rotary.one-table``), one tensor at a time (``rotary.one-tensor``), interleaved pairs
(``rotary.interleaved``), a width read from cos (``rotary.partial``), else ``rotary.form``; its
sentence says what failed (an operation of its graph, its values, or narrower tables). The fused op replaces calls in
the forward only: RoPE called in a method of the class that the forward calls
(``self._projections_and_rope(...)``), or a static method of the class that is itself the RoPE
(``self.apply_rotary(...)``), is refused (``rotary.in-method``), or with the tag of its form where
the op would not compute it anyway.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import libcst as cst
import libcst.matchers as m
import torch
import torch.fx as fx
from torch import nn

from ..ops.rotary import (
    EXPANDS,
    FOUR,
    IGNORED_FIFTH,
    INDEXED,
    ONE,
    ONE_SIN_FIRST,
    CallForm,
    RotaryLayout,
    set_prover,
    table_width,
    with_keywords,
)
from ..rewriter.analysis import ClassAnalysis
from ..rewriter.fusion import Fused, Refusal, SourceFuser
from ..rewriter.graph import NoMatch
from ..rewriter.source import EditContext
from ..rewriter.syntax import expression_code, replace_nodes
from ..rewriter.tracer import unwrapped_forward

__all__ = ["FORMS", "RotaryFuser", "RotaryMatch", "prove", "rotary_layout"]

# Every call form the proof is run in.
FORMS = (FOUR, INDEXED, IGNORED_FIFTH, ONE, ONE_SIN_FIRST)


@dataclass(frozen=True)
class RotaryMatch:
    """The module-level functions of the forward proved to compute RoPE, with the call forms proved
    for each and the layout it computes in each: ``((name, ((form, layout), ...)), ...)``."""

    functions: tuple[tuple[str, tuple[tuple[CallForm, RotaryLayout], ...]], ...]


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
            forms = tuple((form, layout) for form in FORMS if (layout := prove(function, form)))
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
            form, layout, keywords = _check_call(call, function_globals.get(name), name, forms[name])
            fused = _fused_call(call, name, form, layout, keywords, context)
            replacements.append((call, cst.parse_expression(fused)))
        if not replacements:
            raise NoMatch(
                "rotary.placement", f"no call of {', '.join(forms)} in the forward passes its tensors, cos and sin."
            )
        return replace_nodes(tree, replacements)

    def declaration(self, found: RotaryMatch) -> None:
        return None  # no module changes: the edited forward is the whole fusion

    def fuse(self, module: nn.Module, found: RotaryMatch) -> Fused:
        return Fused(replaced=tuple(name for name, _ in found.functions), into="rotary")


def _fused_call(
    call: cst.Call, name: str, form: CallForm, layout: RotaryLayout, keywords: tuple, context: EditContext
) -> str:
    """The op's call standing for ``call``: its tensors, cos and sin, the layout, and ``original``: the
    function by its global name, read at each call, so that a later patch of the module's function
    (another library's kernel) is still honoured; the constants the call passed by keyword as
    ``original_keywords``."""
    arguments = [expression_code(arg.value) for arg in call.args if arg.keyword is None]
    named = ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in layout.keywords().items())
    passed = f", original_keywords={keywords!r}" if keywords else ""
    if form.tensors == 1:
        x, first, second = arguments
        cos, sin = (second, first) if form.sin_first else (first, second)
        fused_op = context.require("transfuse.ops", "rotary_one")
        return f"{fused_op}({x}, {cos}, {sin}, {named}, original={name}{passed}" + (
            ", sin_first=True)" if form.sin_first else ")"
        )
    fused_op = context.require("transfuse.ops", "rotary")
    fused = f"{fused_op}({', '.join(arguments[:4])}, {named}, original={name}{passed}"
    if form.fifth:
        fused += f", position_ids={arguments[4]}"
    return fused + (", indexed=True)" if form.indexed else ")")


def _prove(function: Any, form: CallForm) -> RotaryLayout | None:
    """The op's check of an ``original`` function it has not seen (the same proof, once per
    function and call form: a function patched in after the rewrite, or an emitted file's own
    copy). The proof traces and runs the function on small CPU tensors; a wrapper taking ``*args``
    is not tried."""
    if not (isinstance(function, types.FunctionType) and _takes_three(function)):
        return None
    return prove(function, form)


def _calls_the_op(forward: Any) -> bool:
    from ..ops.rotary import rotary, rotary_one

    code = getattr(forward, "__code__", None)
    return code is not None and any(forward.__globals__.get(name) in (rotary, rotary_one) for name in code.co_names)


def _candidates(forward: Any) -> list[tuple[str, types.FunctionType]]:
    """Module-level Python functions the forward names that take at least a tensor, cos and sin."""
    code = getattr(forward, "__code__", None)
    if code is None:
        return []
    found = []
    for name in code.co_names:
        value = forward.__globals__.get(name)
        # transfuse's own op (an emitted modeling file calls it) is already the fused form.
        ours = getattr(value, "__module__", "").startswith("transfuse.")
        if isinstance(value, types.FunctionType) and not ours and _takes_three(value):
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


def _takes_three(function: types.FunctionType) -> bool:
    """A tensor, cos and sin (or q, k, cos, sin, and the positions), then parameters with defaults."""
    positional = _positional(function)
    return positional is not None and len(positional) >= 3 and all(p.default is not p.empty for p in positional[5:])


def _arity(form: CallForm) -> int:
    """The arguments a call in ``form`` passes."""
    return form.tensors + 2 + form.fifth


def rotary_layout(function: types.FunctionType, form: CallForm = FOUR) -> RotaryLayout | None:
    """The layout in which ``function`` called in ``form`` computes the op, proved as the module
    docstring says; None when it computes none."""
    return prove(function, form)


def prove(function: types.FunctionType, form: CallForm) -> RotaryLayout | None:
    """The layout in which ``function`` called in ``form`` computes the op (the first of the
    enumeration that agrees), proved as the module docstring says; None when it computes none."""
    return _proof(function, form)[0]


def _takes_form(function: types.FunctionType, form: CallForm) -> bool:
    """Calls in ``form`` pass every parameter without a default, and no more than it has."""
    positional = _positional(function)
    if positional is None or len(positional) < _arity(form):
        return False
    return all(p.default is not p.empty for p in positional[_arity(form) :])


@functools.lru_cache(maxsize=512)
def _proof(function: types.FunctionType, form: CallForm) -> tuple[RotaryLayout | None, str]:
    """``prove``'s layout, and why there is none (the rest of a sentence)."""
    if not _takes_form(function, form):
        return None, "it takes other arguments than a tensor (or q and k), cos and sin"
    graph = _graph(function, _arity(form))
    if graph is None:
        return None, "fx cannot trace it"
    found = _examine(graph, form)
    if found.refusal is not None:
        return None, f"its graph {found.refusal}"
    outputs: dict = {}  # the function's outputs per input case, shared by the layouts tried
    layout = next((each for each in _layouts(found) if _values_agree(function, form, each, outputs)), None)
    if layout is None:
        return None, "its values equal those of none of the op's layouts (bit for bit and laid out alike, on random inputs)"
    if found.measures and not layout.partial and _takes_narrower_tables(function, form, layout, outputs):
        # at run time the op would hand every such call to the function (``ops.rotary._outside``)
        return None, (
            "it computes a value from tables narrower than the head, not as the op's partial rotary does "
            "(the first channels rotated, the rest passed through after them)"
        )
    return layout, ""


def _takes_narrower_tables(function: types.FunctionType, form: CallForm, layout: RotaryLayout, outputs: dict) -> bool:
    """The function returns a value where the tables rotate 8 channels of a head of 16."""
    with torch.device("cpu"):
        key = (layout.unsqueeze_dim, table_width(8, layout.expand, layout.first_half), 16, _DTYPES[0])
        if key not in outputs:
            outputs[key] = _run(function, form, *key)
    return any(got is not None for _, _, got in outputs[key])


@functools.lru_cache(maxsize=512)
def _graph(function: types.FunctionType, free: int = 4) -> fx.Graph | None:
    """The function's fx graph, its parameters past the first ``free`` at their defaults; None when
    fx cannot trace it (which is then not this pattern)."""
    try:
        return fx.symbolic_trace(function, concrete_args=_defaults(function, free)).graph
    except Exception:  # noqa: BLE001
        return None


def _defaults(function: types.FunctionType, start: int) -> dict[str, Any]:
    params = list(inspect.signature(function).parameters.values())
    return {p.name: p.default for p in params[start:] if p.default is not p.empty}


# ---- the graph ----------------------------------------------------------------------------


# fx checks each parameter given a constant (``concrete_args``) with an ``eq`` and an ``_assert``,
# or for ``None`` with an ``_assert_is_none``.
_CONSTANT_CHECKS = (operator.eq, torch._assert, fx._symbolic_trace._assert_is_none)
# What a RoPE function's graph may hold besides its inputs and output.
_FUNCTIONS = {
    operator.mul, operator.add, operator.neg, operator.getitem, operator.floordiv, operator.sub,
    torch.cat, torch.stack, torch.flatten, torch.chunk, torch.repeat_interleave,
}  # fmt: skip
_METHODS = {"unsqueeze", "squeeze", "size", "flatten", "reshape", "reshape_as", "view", "view_as", "contiguous",
            "chunk", "float", "to", "type_as", "repeat_interleave", "repeat"}  # fmt: skip
# Those that only move a table's values (or cast them) along its width or into new dimensions: what
# cos and sin may pass through.
_MOVES = {"unsqueeze", "squeeze", "contiguous", "float", "to", "type_as", "repeat_interleave", "repeat",
          torch.repeat_interleave}  # fmt: skip
_CASTS = {"float", "to", "type_as"}


@dataclass
class _Examined:
    """What a function's graph holds that the layouts are made of, or why it is none of them."""

    refusal: str | None = None
    measures: bool = False  # a table's shape read: partial rotary, or its first half
    casts: bool = False


def _examine(graph: fx.Graph, form: CallForm) -> _Examined:
    """The graph as the module docstring's first condition reads it."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) < _arity(form):
        return _Examined("takes fewer arguments than its calls pass")
    n = form.tensors
    positions = placeholders[n + 2] if form.fifth else None
    if positions is not None and bool(positions.users) != form.indexed:
        return _Examined("reads position_ids" if positions.users else "never reads position_ids")
    tables = set(placeholders[n : n + 2])  # cos and sin, and what only moves their values
    scalars: set[fx.Node] = set()  # shapes, dtypes and arithmetic of them
    constant_checks = set(placeholders[_arity(form) :])
    found = _Examined()
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in _CONSTANT_CHECKS and set(node.all_input_nodes) <= constant_checks:
            constant_checks.add(node)
            continue
        refusal = _examine_node(node, tables, scalars, positions, found)
        if refusal is not None:
            return _Examined(refusal)
    return found


def _examine_node(node: fx.Node, tables: set, scalars: set, positions: fx.Node | None, found: _Examined) -> str | None:
    """Why ``node`` is none of the layouts' operations, or None (noting what it shows in ``found``)."""
    if not _allowed(node):
        return f"holds {_name(node)}, which none of the op's layouts is made of"
    method = node.target if node.op == "call_method" else None
    found.casts |= method in _CASTS
    inputs = set(node.all_input_nodes)
    read = inputs & tables
    if _is_call(node, getattr) or method == "size":  # a shape or a dtype; a table's shape is its width
        found.measures |= bool(read) and node.args[-1] != "dtype"
        scalars.add(node)
        return None
    if inputs and inputs <= scalars:
        scalars.add(node)
        return None
    if positions in inputs:  # positions only index a table: ``cos[position_ids]``
        if _is_call(node, operator.getitem) and node.args[0] in tables and node.args[1] is positions:
            tables.add(node)
            return None
        return "reads position_ids other than as the index of cos and sin"
    if not read:
        return None
    if _moves_a_table(node, inputs, tables, scalars):
        found.measures |= _is_call(node, operator.getitem) and not _whole(node.args[1])
        tables.add(node)
        return None
    if _is_call(node, operator.mul) and len(read) == 1 and len(inputs) == 2:
        return None  # a product of a table with a rotated tensor
    return f"reads cos or sin through {_name(node)}, not only by moving them into products"


def _moves_a_table(node: fx.Node, inputs: set, tables: set, scalars: set) -> bool:
    """``node`` moves (or casts) table values only: one of the moves of a table, a cut of its width
    or a new dimension, or a concatenation or stack of tables, with shapes and dtypes as its other
    inputs. (Positions are never cut: a table cut to the tensors' length would be whole at the
    proof's sizes and not at others.)"""
    if not inputs - tables <= scalars:
        return False
    if _is_call(node, operator.getitem):
        return node.args[0] in tables and (_whole(node.args[1]) or _cuts_width(node.args[1]))
    if _is_call(node, torch.cat) or _is_call(node, torch.stack):
        return all(part in tables for part in node.args[0])
    target = node.target if node.op in ("call_method", "call_function") else None
    return target in _MOVES and node.args[0] in tables


def _allowed(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _FUNCTIONS or (node.target is getattr and node.args[1] in ("shape", "dtype"))
    return node.op == "call_method" and node.target in _METHODS


def _name(node: fx.Node) -> str:
    target = node.target
    return f"`{getattr(target, '__name__', target)}`"


def _is_call(node: fx.Node, target: Any) -> bool:
    return node.op == "call_function" and node.target is target


def _whole(index: Any) -> bool:
    """An index that only adds dimensions: ``[:, :, None, :]``, ``[..., None]``."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or p == slice(None) for p in parts)


def _cuts_width(index: Any) -> bool:
    """``[..., :width]``: the first channels of the last dimension."""
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
        return False
    return index[1].start in (None, 0) and index[1].step is None


def _steps_by_two(node: fx.Node) -> bool:
    """``x[..., ::2]`` or ``x[..., 1::2]``."""
    if not _is_call(node, operator.getitem) or not isinstance(node.args[1], tuple):
        return False
    return any(isinstance(part, slice) and part.step == 2 for part in node.args[1])


def _layouts(found: _Examined) -> Iterator[RotaryLayout]:
    """The layouts made of what the graph holds, partial rotary before whole."""
    measured = (True, False) if found.measures else (False,)
    dtypes = ((False, False), (False, True), (True, False)) if found.casts else ((False, False),)
    for dim in (1, 2):
        for interleaved in (False, True):
            for expand in EXPANDS:
                for partial in measured:
                    for first_half in measured[::-1]:
                        for upcast, cast in dtypes:
                            yield RotaryLayout(dim, interleaved, expand, first_half, partial, upcast, cast)


# ---- the values ---------------------------------------------------------------------------

# (tensors' dtype, tables' dtype) of the cases run.
_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))


def _values_agree(function: types.FunctionType, form: CallForm, layout: RotaryLayout, outputs: dict) -> bool:
    # On the CPU whatever the default device is (a rewrite under ``with torch.device("meta")``).
    with torch.device("cpu"):
        return _values_agree_on_cpu(function, form, layout, outputs)


def _values_agree_on_cpu(function: types.FunctionType, form: CallForm, layout: RotaryLayout, outputs: dict) -> bool:
    from ..ops import rotary_native, rotary_one_native

    native = rotary_native if form.tensors == 2 else rotary_one_native
    for width, head in ((8, 16), (16, 16)) if layout.partial else ((8, 8), (16, 16)):
        table = table_width(width, layout.expand, layout.first_half)
        for dtypes in _DTYPES:
            key = (layout.unsqueeze_dim, table, head, dtypes)
            if key not in outputs:
                outputs[key] = _run(function, form, *key)
            taken = 0
            for tensors, read, got in outputs[key]:
                if got is None:
                    continue  # a function that cannot take these shapes is not this one
                if not _same(got, native(*tensors, *read, *layout)):
                    return False
                taken += 1
            if not taken:
                return False
    return True


def _run(function: types.FunctionType, form: CallForm, dim: int, table: int, head: int, dtypes: tuple) -> list:
    """The function's outputs on random inputs of these sizes, in each table shape the form reads:
    ``[(tensors, tables as read, output or None), ...]``."""
    generator = torch.Generator().manual_seed(0)
    heads = (4, 2)[: form.tensors]
    # laid out as a model's are: heads of one projection's output transposed, or cut from wider ones
    if dim == 1:
        tensors = tuple(torch.randn(2, 5, h, head, generator=generator).to(dtypes[0]).transpose(1, 2) for h in heads)
    else:
        tensors = tuple(torch.randn(2, 5, h, head + 2, generator=generator).to(dtypes[0])[..., :head] for h in heads)
    positions = torch.randint(0, 7, (2, 5), generator=generator)
    if form.indexed:  # tables of 7 positions, as they are held: [7, width] or [1, 1, 7, width]
        tables = [torch.randn(7, table, generator=generator).to(dtypes[1]) for _ in range(2)]
        cases = [(tuple(t.view(shape) for t in tables), tuple(t[positions] for t in tables))
                 for shape in ((7, table), (1, 1, 7, table))]  # fmt: skip
    else:
        cos, sin = (torch.randn(2, 5, table, generator=generator).to(dtypes[1]) for _ in range(2))
        cases = [((cos, sin), (cos, sin))]
    found = []
    for passed, read in cases:
        arguments = (*tensors, *(passed[::-1] if form.sin_first else passed), *([positions] if form.fifth else []))
        try:
            got = function(*arguments)
        except Exception:  # noqa: BLE001 - a function that cannot take these shapes is not this one
            got = None
        found.append((tensors, read, got))
    return found


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        got, want = (got,), (want,)
    if not (isinstance(got, tuple) and len(got) == len(want)):
        return False
    return all(
        isinstance(g, torch.Tensor) and g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
        and torch.equal(g, w)
        for g, w in zip(got, want)
    )  # fmt: skip


def _check_call(
    call: cst.Call, function: Any, name: str, forms: dict[CallForm, RotaryLayout]
) -> tuple[CallForm, RotaryLayout, tuple[tuple[str, Any], ...]]:
    """A call site the fused op can take: the tensors, cos and sin by position (and a fifth argument
    where its form was proved), the rest left at the defaults the proof used or passed by keyword
    as constants (literals), with which the function is proved again (``with_keywords``). Its form,
    layout and keywords."""
    if not isinstance(function, types.FunctionType) or not any(prove(function, form) for form in forms):
        raise NoMatch("rotary.placement", f"{name} is rebound in the forward's module.")
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    keywords = _constant_keywords(call)
    if keywords is not None and len(positional) + len(keywords) == len(call.args):
        if keywords:
            variant = with_keywords(function, keywords)
            forms = {form: layout for form in FORMS if variant is not None and (layout := prove(variant, form))}
        for form in forms:
            if _arity(form) == len(positional):
                return form, forms[form], keywords
    raise NoMatch(
        "rotary.arguments",
        f"{name}({', '.join(expression_code(a.value) for a in call.args)}) does not pass its tensors, cos and sin "
        "by position (and at most a fifth argument the function ignores or reads cos and sin at), and the rest as "
        "constants by keyword that the function is proved with.",
    )


def _constant_keywords(call: cst.Call) -> tuple[tuple[str, Any], ...] | None:
    """The call's keyword arguments whose values are literals (numbers, strings, True, False, None),
    as ``((name, value), ...)``; None where a keyword passes anything else, or ``**`` is used."""
    found = []
    for arg in call.args:
        if arg.star:
            if arg.star == "**":
                return None
            continue
        if arg.keyword is None:
            continue
        try:
            value = ast.literal_eval(expression_code(arg.value))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
        if not isinstance(value, (int, float, str, bool, type(None))):
            return None
        found.append((arg.keyword.value, value))
    return tuple(found)


# ---- forms the op does not take, each with its tag ----------------------------------------


def _own_functions(forward: Any) -> list[tuple[str, types.FunctionType]]:
    """Functions of the forward's own module that it names taking two or more arguments, and the
    candidates from elsewhere: where a RoPE the op does not take would be."""
    code = getattr(forward, "__code__", None)
    if code is None:
        return []
    found = []
    for name in code.co_names:
        value = forward.__globals__.get(name)
        if not isinstance(value, types.FunctionType) or value.__module__.startswith("transfuse."):
            continue
        if value.__globals__ is forward.__globals__ or _takes_three(value):
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


def _proved_somehow(function: types.FunctionType) -> bool:
    return _takes_three(function) and any(prove(function, form) for form in FORMS)


def _in_method(name: str, method: types.FunctionType, static: bool) -> tuple[str, str] | None:
    """(tag, sentence) for RoPE computed in a method the forward calls; None where it holds none.
    Below the forward, a form the op does not take is named only for functions of four or more
    arguments (q, k, cos and sin): the graph test of ``_near_miss`` also takes other arithmetic of
    fewer arguments (relative position buckets) for a rotation of one tensor."""
    if static:
        if _proved_somehow(method):
            return "rotary.in-method", f"{name} is RoPE, but a static method of the class; {_FORWARD_ONLY}"
        near = _near_miss(method) if len(_positional(method) or ()) >= 4 else None
        if near is not None:
            return near[0], f"{name}, a static method of the class, {near[1]}"
        return None
    for function_name, function in _candidates(method):
        if _proved_somehow(function):
            return "rotary.in-method", f"{function_name} is called in {name}, a method the forward calls; {_FORWARD_ONLY}"
    for function_name, function in _own_functions(method):
        near = _near_miss(function) if len(_positional(function) or ()) >= 4 else None
        if near is not None:
            return near[0], f"{function_name} (called in {name}, a method the forward calls) {near[1]}"
    return None


_FORWARD_ONLY = "the fused op replaces calls of module-level functions in the forward only."
# Splits of one argument into several tables.
_SPLITS = {"chunk", "split", "unbind", torch.chunk, torch.split, torch.unbind}


def _near_miss(function: types.FunctionType) -> tuple[str, str] | None:
    """(tag, the rest of a sentence) for a function whose graph rotates pairs of channels by cos
    and sin in a form the proof does not take; None for any other function."""
    if {"view_as_complex", "view_as_real"} <= set(function.__code__.co_names):  # fx cannot unpack shapes there
        return "rotary.complex", "rotates by complex frequencies (view_as_complex); the fused op takes cos and sin."
    graph = _graph(function) if len(_positional(function) or ()) >= 3 else None  # a tensor, cos and sin at least
    if graph is None:
        return None
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    names = {getattr(n.target, "__name__", n.target) for n in calls}
    # a rotation by cos and sin: products, a negation or a difference, halves or pairs put together
    if not ("mul" in names and names & {"neg", "sub"} and names & {"cat", "stack"} and names & {"add", "sub"}):
        return None
    if _one_table(graph, calls):
        return "rotary.one-table", (
            "reads sin and cos from one table (split in the function); the fused op takes cos and sin."
        )
    interleaved = "stack" in names or "repeat_interleave" in names or any(_steps_by_two(n) for n in calls)
    why = _why_not(function)
    if _outputs(graph) == 1:
        pairs = "interleaved pairs" if interleaved else "halves"
        return "rotary.one-tensor", f"rotates {pairs} of one tensor at a time, but {why}."
    if interleaved:
        return "rotary.interleaved", f"rotates interleaved pairs of channels, but {why}."
    if any((_is_call(n, getattr) or n.target == "size") and n.args[0] in _cos_sin_views(graph) for n in calls):
        return "rotary.partial", f"rotates a width read from cos (partial rotary), but {why}."
    return "rotary.form", f"rotates halves of its inputs, but {why}."


def _one_table(graph: fx.Graph, calls: list[fx.Node]) -> bool:
    """An argument split in the function, and one argument read more than the function has outputs:
    the rotated tensors and one table that holds sin and cos."""
    placeholders = [
        n for n in graph.nodes if n.op == "placeholder" and any(u.target not in _CONSTANT_CHECKS for u in n.users)
    ]
    split = any(n.target in _SPLITS and n.args[0] in placeholders for n in calls)
    return split and len(placeholders) == _outputs(graph) + 1


def _outputs(graph: fx.Graph) -> int:
    """How many values the function returns."""
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    return len(returned) if isinstance(returned, (tuple, list)) else 1


def _why_not(function: types.FunctionType) -> str:
    """Why the proof takes ``function`` in none of the call forms its signature allows: the reason of
    the first form it takes arguments for whose graph passes, else of the first form."""
    reasons = [_proof(function, form)[1] for form in FORMS if _takes_form(function, form)]
    values = [r for r in reasons if not r.startswith("its graph")]
    return (values or reasons or ["it takes other arguments than a tensor (or q and k), cos and sin"])[0]


def _cos_sin_views(graph: fx.Graph) -> set[fx.Node]:
    """cos and sin, and what only reshapes them (unsqueeze, squeeze, a cast)."""
    views = set([n for n in graph.nodes if n.op == "placeholder"][2:4])
    for node in graph.nodes:
        if node.op == "call_method" and node.target in ("unsqueeze", "squeeze", "to") and node.args[0] in views:
            views.add(node)
    return views


set_prover(_prove)
