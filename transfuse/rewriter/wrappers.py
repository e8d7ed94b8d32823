"""The wrappers around a class's forward, put around its rewritten forward the same way.

A class's ``forward`` attribute may be a chain of ``functools.wraps`` wrappers (each naming the
next in ``__wrapped__``) around the function written in the class body: decorators written above
the ``def``, which compiling the edited method applies again, and wrappers added when a class is
made, which it cannot (transformers' ``GradientCheckpointingLayer`` wraps each subclass's forward
in its checkpointing; the subclass FSDP2's ``fully_shard`` makes is wrapped once more). A rewritten
forward is bound to the instance, where no wrapper on the class reaches it, so each wrapper the
compiled method lacks is copied around it: the copy's closure holds the rewritten function where
the original's held the function it wrapped, and every other cell as it was, so a wrapper that asks
whether it is the outermost (``type(self).forward is wrapper``) answers as the original does.
A wrapper that holds what it wraps anywhere but in a closure cannot be copied: refused.
"""

from __future__ import annotations

import types
from typing import Callable

from .graph import NoMatch

__all__ = ["chain", "rewrapped"]


def chain(fn: Callable) -> list[Callable]:
    """``fn``, the function it wraps (``__wrapped__``), that one's, ... down to the unwrapped one."""
    found = [fn]
    while hasattr(found[-1], "__wrapped__") and len(found) < 100:
        found.append(found[-1].__wrapped__)
    return found


def _same_wrapper(a: Callable, b: Callable) -> bool:
    return type(a) is type(b) and getattr(a, "__code__", None) is getattr(b, "__code__", None)


def rewrapped(cls: type, name: str, original: Callable, compiled: Callable) -> Callable:
    """``compiled`` (the edited ``original``, its decorators applied) inside copies of the wrappers that
    ``cls.<name>`` has around ``original`` and ``compiled`` lacks; NoMatch where they cannot be copied."""
    outer = chain(getattr(cls, name))
    inner = chain(compiled)
    where = f"{cls.__qualname__}.{name}"
    if outer[-1] is not original or len(outer) < len(inner):
        raise NoMatch("source.class-wrapper", f"{where} does not run {original.__qualname__} as traced.")
    added = len(outer) - len(inner)
    if not all(_same_wrapper(a, b) for a, b in zip(outer[added:-1], inner[:-1])):
        raise NoMatch(
            "source.class-wrapper",
            f"the decorators of {where} make other wrappers when the rewritten method is compiled.",
        )
    function = compiled
    for wrapper, wrapped in reversed(list(zip(outer[:added], outer[1 : added + 1]))):
        function = _copy_around(wrapper, wrapped, function, where)
    return function


def _holds(cell: types.CellType, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _copy_around(wrapper: Callable, wrapped: Callable, new: Callable, where: str) -> Callable:
    """A copy of ``wrapper`` whose closure holds ``new`` where ``wrapper``'s holds ``wrapped``."""
    cells = getattr(wrapper, "__closure__", None) or ()
    if not isinstance(wrapper, types.FunctionType) or not any(_holds(c, wrapped) for c in cells):
        raise NoMatch(
            "source.class-wrapper",
            f"{where} is wrapped by {getattr(wrapper, '__qualname__', type(wrapper).__name__)} (from "
            f"{getattr(wrapper, '__module__', '?')}), which does not hold the function it wraps in a closure, so it "
            "cannot be put around the rewritten forward.",
        )
    closure = tuple(types.CellType(new) if _holds(c, wrapped) else c for c in cells)
    copy = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, closure)
    copy.__kwdefaults__ = dict(wrapper.__kwdefaults__) if wrapper.__kwdefaults__ else None
    copy.__dict__.update(wrapper.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = wrapper.__qualname__, wrapper.__doc__, wrapper.__module__
    copy.__annotations__ = dict(wrapper.__annotations__)
    copy.__wrapped__ = new
    return copy
