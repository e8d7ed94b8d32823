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

__all__ = ["RotaryFuser", "RotaryMatch", "rotary_unsqueeze_dim"]


@dataclass(frozen=True)
class RotaryMatch:
    """The module-level functions of the forward that compute rotate-half RoPE, with the
    unsqueeze dimension each applies: ``((name, dim), ...)``."""

    functions: tuple[tuple[str, int], ...]


# What a rotate-half RoPE function's graph may hold besides its inputs and output.
_FUNCTIONS = {operator.mul, operator.add, operator.neg, operator.getitem, operator.floordiv, operator.sub, torch.cat}
_METHODS = {"unsqueeze", "size"}


class RotaryFuser(SourceFuser[RotaryMatch]):
    kind = "rotary"

    def wants(self, module: nn.Module) -> bool:
        return bool(_candidates(unwrapped_forward(type(module))))

    def match(self, analysis: ClassAnalysis) -> RotaryMatch | Refusal | None:
        forward = unwrapped_forward(analysis.cls)
        if _calls_the_op(forward):
            return None  # already the fused form (an emitted modeling file's forward)
        found, near = [], []
        for name, function in _candidates(forward):
            dim = rotary_unsqueeze_dim(function)
            if dim is not None:
                found.append((name, dim))
            elif _rotates_half(function):
                near.append(name)
        if found:
            return RotaryMatch(tuple(found))
        if near:
            return Refusal(
                "rotary.form",
                f"{', '.join(near)} rotates halves of its inputs but is not rotate-half RoPE as the fused op "
                "computes it (a partial rotary width, interleaved pairs, or other arithmetic).",
                analysis.where(),
            )
        return None

    def edit(self, tree: cst.FunctionDef, found: RotaryMatch, context: EditContext) -> cst.FunctionDef:
        names = dict(found.functions)
        function_globals = context.source.function.__globals__
        replacements = []
        for call in m.findall(tree, m.Call(func=m.Name())):
            name = call.func.value
            if name not in names:
                continue
            function = function_globals.get(name)
            _check_call(call, function, name)
            fused_op = context.require("transfuse.ops", "rotary")
            arguments = ", ".join(expression_code(arg.value) for arg in call.args[:4])
            # ``original``: the function by its global name, read at each call, so that a later patch
            # of the module's function (another library's kernel) is still honoured.
            fused = f"{fused_op}({arguments}, unsqueeze_dim={names[name]}, original={name})"
            replacements.append((call, cst.parse_expression(fused)))
        if not replacements:
            raise NoMatch("rotary.placement", f"no call of {', '.join(names)} in the forward passes q, k, cos and sin.")
        return replace_nodes(tree, replacements)

    def declaration(self, found: RotaryMatch) -> None:
        return None  # no module changes: the edited forward is the whole fusion

    def fuse(self, module: nn.Module, found: RotaryMatch) -> Fused:
        return Fused(replaced=tuple(name for name, _ in found.functions), into="rotary")


def _prove(function: Any) -> int | None:
    """The op's check of an ``original`` function it has not seen (the same proof, once per
    function: a function patched in after the rewrite, or an emitted file's own copy). The proof
    traces and runs the function on small CPU tensors; a wrapper taking ``*args`` is not tried."""
    if not (isinstance(function, types.FunctionType) and _takes_four(function)):
        return None
    return rotary_unsqueeze_dim(function)


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


def _takes_four(function: types.FunctionType) -> bool:
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest_have_defaults = all(p.default is not p.empty for p in positional[4:])
    return len(positional) >= 4 and rest_have_defaults and all(p.kind != p.VAR_POSITIONAL for p in params)


@functools.lru_cache(maxsize=256)
def rotary_unsqueeze_dim(function: types.FunctionType) -> int | None:
    """The unsqueeze dimension (1 or 2) at which ``function(q, k, cos, sin)`` is rotate-half RoPE,
    proved as the module docstring says; None when it is not."""
    if not _graph_is_polynomial(function):
        return None
    for dim in (1, 2):
        if _values_agree(function, dim):
            return dim
    return None


@functools.lru_cache(maxsize=256)
def _graph(function: types.FunctionType) -> fx.Graph | None:
    """The function's fx graph, its parameters past q, k, cos and sin at their defaults; None when
    fx cannot trace it (which is then not this pattern)."""
    try:
        return fx.symbolic_trace(function, concrete_args=_defaults(function)).graph
    except Exception:  # noqa: BLE001
        return None


def _graph_is_polynomial(function: types.FunctionType) -> bool:
    graph = _graph(function)
    if graph is None:
        return False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) < 4:
        return False
    cos_sin = set(placeholders[2:4])
    # fx checks each parameter given a constant (``concrete_args``) with an ``eq`` and an ``_assert``.
    constant_checks = set(placeholders[4:])
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in (operator.eq, torch._assert):
            if set(node.all_input_nodes) <= constant_checks:
                constant_checks.add(node)
                continue
            return False
        if node.op == "call_function" and node.target in _FUNCTIONS:
            pass
        elif node.op == "call_function" and node.target is getattr and node.args[1] == "shape":
            pass
        elif node.op == "call_method" and node.target in _METHODS:
            pass
        else:
            return False
        # cos and sin are read only by an unsqueeze, and that only by products: never sliced,
        # never measured (a width taken from cos is partial rotary).
        read = set(node.all_input_nodes) & cos_sin
        if read:
            unsqueezed = node.op == "call_method" and node.target == "unsqueeze" and node.args[0] in placeholders[2:4]
            if unsqueezed:
                cos_sin.add(node)
            elif not (node.op == "call_function" and node.target is operator.mul and read <= cos_sin - set(placeholders[2:4])):
                return False
    return True


def _rotates_half(function: types.FunctionType) -> bool:
    """A function of q, k, cos, sin that negates and concatenates: RoPE-like, for the refusal."""
    graph = _graph(function)
    if graph is None:
        return False
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    return {torch.cat, operator.neg, operator.mul} <= targets


def _defaults(function: types.FunctionType) -> dict[str, Any]:
    params = list(inspect.signature(function).parameters.values())
    return {p.name: p.default for p in params[4:] if p.default is not p.empty}


def _values_agree(function: types.FunctionType, dim: int) -> bool:
    # On the CPU whatever the default device is (a rewrite under ``with torch.device("meta")``).
    with torch.device("cpu"):
        return _values_agree_on_cpu(function, dim)


def _values_agree_on_cpu(function: types.FunctionType, dim: int) -> bool:
    from ..ops import rotary_native

    generator = torch.Generator().manual_seed(0)
    for width in (8, 16):
        for dtype in (torch.float32, torch.bfloat16):
            shape_q, shape_k = ((2, 4, 5, width), (2, 2, 5, width)) if dim == 1 else ((2, 5, 4, width), (2, 5, 2, width))
            q, k = (torch.randn(s, generator=generator).to(dtype) for s in (shape_q, shape_k))
            cos, sin = (torch.randn(2, 5, width, generator=generator).to(dtype) for _ in range(2))
            try:
                got = function(q, k, cos, sin)
            except Exception:  # noqa: BLE001 - a function that cannot take these shapes is not this one
                return False
            want = rotary_native(q, k, cos, sin, unsqueeze_dim=dim)
            if not (isinstance(got, tuple) and len(got) == 2):
                return False
            if not all(isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want)):
                return False
    return True


def _check_call(call: cst.Call, function: Any, name: str) -> None:
    """A call site the fused op can take: q, k, cos, sin by position, the rest left at the
    defaults the proof used."""
    if not isinstance(function, types.FunctionType) or rotary_unsqueeze_dim(function) is None:
        raise NoMatch("rotary.placement", f"{name} is rebound in the forward's module.")
    if len(call.args) != 4 or any(arg.keyword is not None or arg.star for arg in call.args):
        raise NoMatch(
            "rotary.arguments",
            f"{name}({', '.join(expression_code(a.value) for a in call.args)}) does not pass exactly q, k, cos and sin "
            "by position; the fused op was proved with the function's defaults for the rest.",
        )


set_prover(_prove)
