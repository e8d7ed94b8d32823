"""Inlining: a parent's graph with some child calls replaced by the children's own graphs.

Each class is traced with its children as leaves, but a pattern can span a parent and a
child: a mixture-of-experts block that scores tokens in its router child and picks the
top-k in its own forward, or the other way round. ``inline_calls`` copies the parent's
graph and, at each chosen ``call_module`` node, splices in that child's traced graph:
the child's placeholders become the call's arguments, its parameters become ``get_attr``
nodes named by their path below the parent (``gate.weight``), its scalar attributes keep
``self_attr`` as a path (``gate.top_k``), and ``out[i]`` of a child that returns a tuple
is the i-th returned node itself. Children of the child are inlined the same way when
the caller asks for them. The result is evidence to match on, never code to run.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import torch.fx as fx

from .tracer import Trace, unwrapped_forward

__all__ = ["Inlined", "call_inputs", "inline_calls"]


class Inlined:
    """The inlined graph, where each of the parent's nodes went (a node, or a tuple of them), and
    for each child call spliced in, the nodes its graph became (``spans``)."""

    def __init__(self, graph: fx.Graph, env: dict[fx.Node, Any], spans: dict[fx.Node, set[fx.Node]] | None = None):
        self.graph = graph
        self.env = env
        self.spans = spans or {}

    def __getitem__(self, node: fx.Node) -> Any:
        return self.env[node]


def call_inputs(trace: Trace, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The traced child's placeholder names mapped to a call's arguments (None if they do not bind)."""
    try:
        bound = inspect.signature(unwrapped_forward(trace.cls)).bind(None, *args, **kwargs)
    except TypeError:
        return None
    values: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            values.update({f"{name}_{i}": v for i, v in enumerate(value)})
        elif param.kind is not inspect.Parameter.VAR_KEYWORD:
            values[name] = value
    return values


def _splice(graph: fx.Graph, trace: Trace, inputs: dict[str, Any], prefix: str, children: Callable) -> Any:
    """Copy ``trace``'s graph into ``graph`` and return what the child returned."""
    env: dict[fx.Node, Any] = {}
    for node in trace.graph.nodes:
        if node.op == "placeholder":
            env[node] = inputs.get(node.target)
        elif node.op == "get_attr":
            copy = graph.create_node("get_attr", prefix + node.target)
            copy.meta = dict(node.meta)
            if "self_attr" in node.meta:
                copy.meta["self_attr"] = prefix + node.meta["self_attr"]
            env[node] = copy
        elif node.op == "output":
            return fx.node.map_arg(node.args[0], lambda n: env[n])
        else:
            env[node] = _copy_or_inline(graph, node, env, prefix, children)
    raise AssertionError("a complete trace ends in an output node")


def _spliceable(trace: Trace, inputs: dict[str, Any] | None) -> bool:
    if trace.partial or trace.output is None or inputs is None:
        return False
    return all(p.target in inputs for p in trace.placeholders())


def _copy_or_inline(graph: fx.Graph, node: fx.Node, env: dict, prefix: str, children: Callable) -> Any:
    """The inlined value of ``node``: a copy, a child's returned node(s), or an element of them."""
    if node.op == "call_function" and node.target is operator.getitem:
        source, index = node.args
        if isinstance(source, fx.Node) and isinstance(env.get(source), (tuple, list)) and isinstance(index, int):
            return env[source][index]
    if node.op == "call_module":
        child = children(prefix + node.target)
        if child is not None:
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            inputs = call_inputs(child, args, kwargs)
            if _spliceable(child, inputs):
                return _splice(graph, child, inputs, prefix + node.target + ".", children)
    copy = graph.node_copy(node, lambda n: env[n])
    if node.op == "call_module":
        copy.target = prefix + node.target
    return copy


def inline_calls(trace: Trace, children: Callable[[str], Trace | None]) -> Inlined:
    """``trace``'s graph with the calls of each child that ``children(path)`` gives a complete trace
    for replaced by that trace (recursively, with dotted paths); other calls stay calls."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    spans: dict[fx.Node, set[fx.Node]] = {}
    for node in trace.graph.nodes:
        if node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
            continue
        if node.op in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        last = next(iter(reversed(graph.nodes)), None)
        env[node] = _copy_or_inline(graph, node, env, "", children)
        if node.op == "call_module":
            spans[node] = _nodes_after(graph, last)
    return Inlined(graph, env, spans)


def _nodes_after(graph: fx.Graph, last: fx.Node | None) -> set[fx.Node]:
    """The nodes of ``graph`` after ``last`` (all of them if None)."""
    made, cursor = set(), (last.next if last is not None else next(iter(graph.nodes), None))
    while cursor is not None and cursor.op != "root":
        made.add(cursor)
        cursor = cursor.next
    return made
