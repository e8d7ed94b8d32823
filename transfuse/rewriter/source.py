"""The libcst source layer: find a class's methods in its real source file and reason about them.

A traced graph is evidence of what ran for one input. What it cannot show (a branch
not taken, a loop, a name rebound) is proved here on the syntax tree, before any
fusion that depends on it is made.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

__all__ = ["MethodSource", "control_flow", "method_source", "self_method_calls"]


@dataclass(frozen=True)
class ParsedFile:
    filename: str
    text: str
    module: cst.Module
    positions: dict  # node -> CodeRange


@functools.lru_cache(maxsize=64)
def _parse_file(filename: str) -> ParsedFile | None:
    try:
        with open(filename, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    return ParsedFile(filename, text, wrapper.module, positions)


@dataclass(frozen=True)
class MethodSource:
    """A method's syntax tree in its real file, and the line it starts on."""

    file: ParsedFile
    node: cst.FunctionDef

    @property
    def filename(self) -> str:
        return self.file.filename

    def line(self, node: cst.CSTNode | None = None) -> int:
        return self.file.positions[node if node is not None else self.node].start.line


def method_source(fn: Callable) -> MethodSource | None:
    """The FunctionDef of ``fn`` (unwrapped) in its source file, or None without a source file."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    filename = inspect.getsourcefile(fn) if code is not None else None
    parsed = _parse_file(filename) if filename else None
    if parsed is None:
        return None
    first = code.co_firstlineno
    for node in m.findall(parsed.module, m.FunctionDef(name=m.Name(fn.__name__))):
        def_line = parsed.positions[node].start.line  # libcst's range starts at `def`, after decorators
        top = parsed.positions[node.decorators[0]].start.line if node.decorators else def_line
        if top <= first <= def_line:
            return MethodSource(parsed, node)
    return None


_CONTROL_FLOW = m.If() | m.For() | m.While() | m.Try() | m.With() | m.IfExp() | m.Match() | m.Return()


def control_flow(source: MethodSource) -> list[tuple[str, int]]:
    """Branches, loops, ``with`` and ``try`` blocks in a method, and returns before its last statement."""
    body = source.node.body.body
    found = []
    for node in m.findall(source.node, _CONTROL_FLOW):
        if isinstance(node, cst.Return) and body and _is_last_return(node, body[-1]):
            continue
        found.append((type(node).__name__.lower(), source.line(node)))
    return found


def _is_last_return(node: cst.Return, last: cst.BaseStatement) -> bool:
    return isinstance(last, cst.SimpleStatementLine) and node in last.body


def self_method_calls(source: MethodSource) -> set[str]:
    """Names ``n`` of calls written ``self.n(...)`` in a method."""
    calls = m.findall(source.node, m.Call(func=m.Attribute(value=m.Name("self"))))
    return {c.func.attr.value for c in calls}
