"""Small named predicates over traced graphs, so that a matcher reads like the formula it detects.

An op is known by one canonical name however it was written: ``x * y``,
``torch.mul(x, y)``, ``x.mul(y)`` and ``Tensor.__mul__`` are all ``"mul"``, with the
operands in written order (reflected operators are turned back around). Casts are
peeled with ``peel_casts``, which reports each cast's target as a ``Cast``.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .tracer import UNKNOWN

__all__ = [
    "Cast",
    "ancestors",
    "calls_fused_op",
    "NoMatch",
    "cast_of",
    "location",
    "op_name",
    "operand",
    "operands",
    "is_op",
    "peel_casts",
    "value",
]


class NoMatch(Exception):
    """A matcher's refusal: a stable tag, one sentence, and the node it stopped at."""

    def __init__(self, tag: str, reason: str, node: fx.Node | None = None):
        super().__init__(reason)
        self.tag = tag
        self.reason = reason
        self.node = node if isinstance(node, fx.Node) else None  # matchers may hand on a constant operand


_OPERATOR_NAMES = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.isub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    operator.pow: "pow",
    operator.neg: "neg",
    operator.getitem: "getitem",
    operator.matmul: "matmul",
    getattr: "getattr",
    F.rms_norm: "rms_norm",
    F.layer_norm: "layer_norm",
    F.linear: "linear",
}
_ALIASES = {"truediv": "div", "multiply": "mul", "true_divide": "div", "divide": "div"}
_REFLECTED = {"radd": "add", "rsub": "sub", "rmul": "mul", "rtruediv": "div", "rdiv": "div", "rpow": "pow"}


def _raw_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        known = _OPERATOR_NAMES.get(node.target)
        if known is not None:
            return known
        name = getattr(node.target, "__name__", None)
        module = getattr(node.target, "__module__", None) or ""
        if name is not None and not module.startswith("torch") and module not in ("builtins", "_operator", "math"):
            return f"{module}.{name}"  # a library's own function is not the torch op of the same name
        return name
    return None


def op_name(node: Any) -> str | None:
    """Canonical op name of a call node (``"mul"``, ``"rsqrt"``, ``"to"``), else None."""
    if not isinstance(node, fx.Node):
        return None
    name = _raw_name(node)
    if name is None:
        return None
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    name = _REFLECTED.get(name, name)
    return _ALIASES.get(name, name)


def is_op(node: Any, *names: str) -> bool:
    return op_name(node) in names


def operands(node: fx.Node) -> tuple:
    """Positional operands with the receiver of a method call first, reflected ops turned around."""
    args = tuple(node.args)
    name = _raw_name(node) or ""
    if name.strip("_") in _REFLECTED and len(args) == 2:
        args = (args[1], args[0])
    return args


def operand(node: fx.Node, index: int, name: str | None = None, default: Any = None) -> Any:
    """Operand ``index`` (receiver of a method is 0), or the keyword ``name``."""
    args = operands(node)
    if index < len(args):
        return args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node ``node`` was computed from (not itself)."""
    seen: set[fx.Node] = set()
    pending = list(node.all_input_nodes)
    while pending:
        current = pending.pop()
        if current not in seen:
            seen.add(current)
            pending.extend(current.all_input_nodes)
    return seen


def value(node: Any) -> Any:
    """The traced value of a node (a meta tensor, a Python value, or UNKNOWN); constants as is."""
    if isinstance(node, fx.Node):
        return node.meta.get("val", UNKNOWN)
    return node


def location(node: fx.Node | None) -> str | None:
    """``file.py:line`` of the source line that created the node."""
    if not isinstance(node, fx.Node):
        return None
    loc = node.meta.get("location")
    return f"{os.path.basename(loc[0])}:{loc[1]}" if loc else None


@dataclass(frozen=True)
class Cast:
    """A dtype conversion: to a fixed dtype, or to the dtype of another node (``like``)."""

    dtype: torch.dtype | None = None
    like: fx.Node | None = None

    def describe(self) -> str:
        return str(self.dtype).replace("torch.", "") if self.dtype is not None else f"dtype of {self.like.name}"


_FIXED_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}


def _dtype_target(arg: Any) -> Cast | None:
    if isinstance(arg, torch.dtype):
        return Cast(dtype=arg)
    if isinstance(arg, fx.Node) and is_op(arg, "getattr") and arg.args[1] == "dtype":
        return Cast(like=arg.args[0])
    return None


def cast_of(node: Any) -> Cast | None:
    """If ``node`` only converts its input's dtype, the target; else None."""
    name = op_name(node)
    if name in _FIXED_CASTS and len(node.args) == 1 and not node.kwargs:
        return Cast(dtype=_FIXED_CASTS[name])
    if name == "type_as" and len(node.args) == 2:
        return Cast(like=node.args[1])
    if name in ("to", "type"):
        extra = set(node.kwargs) - {"dtype", "copy", "non_blocking"}
        if extra or node.kwargs.get("copy"):
            return None
        target = node.args[1] if len(node.args) == 2 else node.kwargs.get("dtype")
        if len(node.args) > 2 or (len(node.args) == 2 and "dtype" in node.kwargs):
            return None
        return _dtype_target(target)
    return None


def peel_casts(node: Any) -> tuple[Any, list[Cast]]:
    """Follow dtype casts down to the value they convert; the casts come outermost first."""
    casts: list[Cast] = []
    cast = cast_of(node)
    while cast is not None:
        casts.append(cast)
        node = node.args[0]
        cast = cast_of(node)
    return node, casts


def calls_fused_op(graph: fx.Graph) -> bool:
    """The graph already calls a transfuse op (an emitted or already rewritten module)."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        module = getattr(node.target, "__module__", None) or ""
        if module.startswith("transfuse.") or str(node.target).startswith("transfuse."):
            return True
    return False
