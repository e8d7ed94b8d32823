"""Sizes read off a traced tensor that remember where they came from.

``x.shape``, ``x.size(1)``, ``x.dim()`` and ``x.numel()`` of a traced tensor are ints (and tuples
of them) for every use, so shape arithmetic runs as written; when Python control flow tests one
(``if x.dim() == 2``, a comparison's truth, an int's truth), the origin is told, and the trace
records a ``ShapeGuard``: its graph holds for inputs of this shape only. What graphs and real ops
receive is the plain int (``plain_size``).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

__all__ = ["SIZE_READS", "ShapeGuard", "SizeInt", "SizeOrigin", "SizeTuple", "plain_size", "tracked_size"]


@dataclass(frozen=True)
class ShapeGuard:
    """Where Python control flow tested a size read off a traced tensor (``if x.dim() == 2``)."""

    node: fx.Node  # the tensor whose size was read
    read: str  # what was read: "shape", "dim()", ...
    location: tuple[str, int] | None

    def describe(self) -> str:
        where = f" at {os.path.basename(self.location[0])}:{self.location[1]}" if self.location else ""
        return f"a test of {self.node.name}.{self.read}{where}"


class SizeBool:
    """The truth of a comparison of sizes; testing it records a shape guard."""

    __slots__ = ("value", "origin")

    def __init__(self, value: bool, origin: SizeOrigin):
        self.value = bool(value)
        self.origin = origin

    def __bool__(self) -> bool:
        self.origin.guard()
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


class SizeOrigin:
    """Which tensor a size was read from, and whom to tell when control flow tests it (``record``:
    the trace, which keeps a ``ShapeGuard`` while it runs the traced code)."""

    __slots__ = ("node", "read", "record")

    def __init__(self, node: fx.Node, read: str, record: Callable[[fx.Node, str], None]):
        self.node, self.read, self.record = node, read, record

    def guard(self) -> None:
        self.record(self.node, self.read)


def _size_op(op: Callable) -> Callable:
    def method(self, *others):
        result = op(int(self), *(int(o) if isinstance(o, int) else o for o in others))
        return SizeInt(result, self._origin) if type(result) is int and self._origin is not None else result

    return method


def _size_compare(op: Callable) -> Callable:
    def method(self, other):
        result = op(int(self), int(other) if isinstance(other, int) else other)
        return SizeBool(result, self._origin) if self._origin is not None else result

    return method


class SizeInt(int):
    """A size read off a traced tensor: an int for every use, that records a shape guard when
    control flow tests it (comparisons give a ``SizeBool``; arithmetic keeps the origin)."""

    def __new__(cls, value: int, origin: SizeOrigin | None = None):
        obj = super().__new__(cls, value)
        obj._origin = origin
        return obj

    def __bool__(self) -> bool:
        if self._origin is not None:
            self._origin.guard()
        return int(self) != 0

    __hash__ = int.__hash__
    __eq__ = _size_compare(operator.eq)
    __ne__ = _size_compare(operator.ne)
    __lt__ = _size_compare(operator.lt)
    __le__ = _size_compare(operator.le)
    __gt__ = _size_compare(operator.gt)
    __ge__ = _size_compare(operator.ge)
    __add__ = _size_op(operator.add)
    __radd__ = _size_op(lambda a, b: b + a)
    __sub__ = _size_op(operator.sub)
    __rsub__ = _size_op(lambda a, b: b - a)
    __mul__ = _size_op(operator.mul)
    __rmul__ = _size_op(lambda a, b: b * a)
    __floordiv__ = _size_op(operator.floordiv)
    __rfloordiv__ = _size_op(lambda a, b: b // a)
    __mod__ = _size_op(operator.mod)
    __rmod__ = _size_op(lambda a, b: b % a)
    __neg__ = _size_op(operator.neg)


class SizeTuple(tuple):
    """``x.shape`` / ``x.size()`` of a traced tensor: a tuple of ``SizeInt`` (with ``numel``)."""

    def numel(self) -> int:
        total = 1
        for d in self:
            total *= int(d)
        return total


def plain_size(value: Any) -> Any:
    """A tracked size as the plain int (or tuple) it stands for: what graphs and real ops see."""
    if isinstance(value, SizeInt):
        return int(value)
    if isinstance(value, SizeTuple):
        return tuple(int(d) for d in value)
    return value


# Tensor reads that give sizes, tracked for control flow.
SIZE_READS = frozenset({"shape", "ndim", "size", "dim", "numel", "nelement"})


def tracked_size(value: Any, origin: SizeOrigin) -> Any:
    if isinstance(value, torch.Size):
        return SizeTuple(SizeInt(d, origin) for d in value)
    if type(value) is int:
        return SizeInt(value, origin)
    return value
