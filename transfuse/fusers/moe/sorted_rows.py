"""MoE experts over rows sorted by expert: every (token, expert) pair's row computed in one pass.

``order = argsort(ids.flatten())`` puts the rows of each expert together, in expert order;
``token = order // k`` is the token of each sorted row, ``gate = weights.flatten()[order]`` its
routing weight, and ``sizes`` (the number of rows of each expert: a one-hot of the ids summed over
tokens) splits the sorted rows by expert. Two children apply ``[E, out, in]`` weights to the rows of
each expert (``rows.split(sizes)``, ``F.linear(part_e, W[e])``, concatenated in expert order), the
GLU between them; the outputs times their gates are added back by one ``index_add`` over ``token``.
That is the routed mixture as a grouped product over sorted rows, which the fused layer computes
(only the order of each token's sum may differ).

The children's traces take the sizes as the list recorded in the probe call (the tracer reads a
list of numbers as its value), so that the split reads the sizes argument is checked in the
children's source: their one ``split`` is by that parameter, which the forward never assigns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
import torch
import torch.fx as fx

from ...ops.moe import ExpertsSpec
from ...rewriter.graph import NoMatch, is_op, operand, operands, peel_casts, value
from ...rewriter.source import method_source
from ...rewriter.tracer import Trace, unwrapped_forward
from .experts import Lookup, gated, split_halves

__all__ = ["SortedExperts", "SortedRows", "match_sorted_experts", "match_sorted_rows"]

_TAG = "moe.sorted-rows"


@dataclass
class SortedExperts:
    """The block-side half (the block's own graph): the experts' calls and what they read."""

    add: fx.Node
    token: fx.Node
    gates: fx.Node
    sizes: fx.Node
    rows: fx.Node
    first: fx.Node  # the call computing gate/up of every row
    second: fx.Node  # the call computing down
    spec: ExpertsSpec
    nodes: set[fx.Node] = field(default_factory=set)


@dataclass
class SortedRows:
    """The routing half (in the graph with the router inlined): the ids and weights sorted."""

    ids: fx.Node
    weights: fx.Node
    k: Any  # what the sorted positions are divided by
    nodes: set[fx.Node] = field(default_factory=set)


def _untolist(node: Any, nodes: set) -> Any:
    if is_op(node, "tolist") and len(node.args) == 1 and not node.kwargs:
        nodes.add(node)
        return operand(node, 0)
    return node


def match_sorted_experts(graph: fx.Graph, children: Lookup) -> SortedExperts:
    """``zeros.index_add(0, token, second(act(first(x[token], sizes)) halves, sizes) * gates[:, None])``."""
    adds = [n for n in graph.nodes if is_op(n, "index_add_", "index_add")]
    if len(adds) != 1:
        raise NoMatch(_TAG, f"the forward has {len(adds)} index_add calls, not one adding every sorted row back.")
    add = adds[0]
    _, dim, token, source = (operand(add, i) for i in range(4))
    nodes = {add}
    if dim != 0:
        raise NoMatch(_TAG, f"the sorted rows are added along dimension {dim}, not over tokens.", add)
    contribution, casts = peel_casts(source)
    walk = source
    while walk is not contribution:
        nodes.add(walk)
        walk = operand(walk, 0)
    if len(casts) > 1 or not is_op(contribution, "mul"):
        raise NoMatch(_TAG, "what is added back is not the experts' rows times their gates.", source)
    nodes.add(contribution)
    for gates, out in (operands(contribution)[:2], operands(contribution)[1::-1]):
        flat = None
        if is_op(gates, "getitem") and operand(gates, 1) == (slice(None), None):
            flat = operand(gates, 0)
        elif is_op(gates, "unsqueeze") and operand(gates, 1, "dim") in (-1, 1):
            flat = operand(gates, 0)
        if flat is not None and isinstance(out, fx.Node) and out.op == "call_module":
            nodes.add(gates)
            break
    else:
        raise NoMatch(_TAG, "the sorted rows' outputs are not multiplied by one gate per row (gates[:, None]).", add)
    if len(out.args) != 2 or out.kwargs:
        raise NoMatch(_TAG, f"{out.target} is not called on the rows and the per-expert sizes.", out)
    hidden, sizes = out.args
    gate, up, activation, alpha, limit = gated(hidden, children, nodes)
    if alpha is not None or limit is not None:
        raise NoMatch(_TAG, "the sorted rows' GLU is not a plain gated activation.", hidden)
    projection, (interleaved, gate_first) = split_halves(gate, up, nodes)
    if not (isinstance(projection, fx.Node) and projection.op == "call_module" and len(projection.args) == 2):
        raise NoMatch(_TAG, "the gate and up of the sorted rows are not one child's output.", projection)
    rows, first_sizes = projection.args
    if first_sizes is not sizes or projection.kwargs or projection.target == out.target:
        raise NoMatch(_TAG, "the two expert projections are not split by the same per-expert sizes.", projection)
    index = operand(rows, 1) if is_op(rows, "getitem") else None
    if _untolist(index, nodes) is not token:
        raise NoMatch(_TAG, "the experts are not applied to the rows of the tokens added back to.", rows)
    nodes.add(rows)
    return SortedExperts(
        add, token, flat, sizes, operand(rows, 0), projection, out,
        ExpertsSpec(activation, interleaved, gate_first, False, False), nodes,
    )  # fmt: skip


def _splits_by_sizes_parameter(trace: Trace) -> bool:
    """The forward's one ``.split(...)`` is by its second parameter (after the rows), never assigned."""
    source = method_source(unwrapped_forward(trace.cls))
    if source is None:
        return False
    fn = source.node
    params = [p.name.value for p in fn.params.params]
    if len(params) != 3 or isinstance(fn.params.star_arg, cst.Param) or fn.params.kwonly_params:
        return False
    name = m.Name(params[2])
    written = m.AssignTarget(target=name) | m.AugAssign(target=name) | m.AnnAssign(target=name) | m.For(
        target=name
    ) | m.NamedExpr(target=name) | m.Del()  # fmt: skip
    if m.findall(fn, written):
        return False
    splits = m.findall(fn, m.Call(func=m.Attribute(attr=m.Name("split"))))
    by_sizes = m.Call(func=m.Attribute(attr=m.Name("split")), args=[m.Arg(name, keyword=None), m.ZeroOrMore()])
    return len(splits) == 1 and m.matches(splits[0], by_sizes)


def split_linear_experts(trace: Trace | None, what: str) -> tuple[str, int]:
    """A child computing ``cat([F.linear(part_e, W[e]) for e, part_e in enumerate(rows.split(sizes))])``
    for every expert e of a 3-D ``W``: (W's name, the number of experts)."""
    if trace is None or trace.partial or trace.output is None or trace.shape_guards:
        raise NoMatch(_TAG, f"the {what} projection's forward was not traced to the end for every shape.")
    rows = [p for p in trace.placeholders() if p.users]
    cat = trace.output.args[0]
    if len(rows) != 1 or not is_op(cat, "cat") or operand(cat, 1, "dim") not in (0, -2):
        raise NoMatch(_TAG, f"the {what} projection does not concatenate per-expert outputs of its rows.", cat)
    parts = list(operand(cat, 0))
    split, weight = None, None
    for e, linear in enumerate(parts):
        part = operand(linear, 0) if is_op(linear, "linear") else None
        w = operand(linear, 1, "weight") if part is not None else None
        if part is None or operand(linear, 2, "bias") is not None or not (is_op(part, "getitem") and is_op(w, "getitem")):
            raise NoMatch(_TAG, f"the {what} projection's part {e} is not a linear map by one expert's weight.", linear)
        split = operand(part, 0) if split is None else split
        weight = operand(w, 0) if weight is None else weight
        if operand(part, 0) is not split or operand(part, 1) != e or operand(w, 0) is not weight or operand(w, 1) != e:
            raise NoMatch(_TAG, f"the {what} projection's part {e} is not expert {e}'s rows times its weight.", linear)
    w_value = value(weight) if isinstance(weight, fx.Node) else None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and isinstance(w_value, torch.Tensor)):
        raise NoMatch(_TAG, f"the {what} projection's weights are not a tensor of its own.", cat)
    if not (is_op(split, "split") and operand(split, 0) is rows[0] and operand(split, 2, "dim") == 0):
        raise NoMatch(_TAG, f"the {what} projection does not split its rows over dimension 0.", split)
    split_sizes = operand(split, 1, "split_size")
    if not isinstance(split_sizes, (list, tuple)) or not _splits_by_sizes_parameter(trace):
        raise NoMatch(_TAG, f"the {what} projection's rows are not split by the per-expert sizes it is given.", split)
    experts = len(parts)
    if w_value.dim() != 3 or w_value.shape[0] != experts or len(split_sizes) != experts:
        raise NoMatch(_TAG, f"the {what} projection reads {experts} of the {w_value.shape[0]} experts' weights.", cat)
    computed = [n for n in trace.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if len(computed) != 2 + 3 * experts:
        raise NoMatch(_TAG, f"the {what} projection computes more than its experts' linear maps.", cat)
    return weight.target, experts


def _flat(node: Any, nodes: set) -> Any:
    """``t.flatten()``, ``t.view(-1)``, ``t.reshape(-1)`` → t (else None)."""
    if is_op(node, "flatten") and len(node.args) == 1 and not node.kwargs:
        nodes.add(node)
        return operand(node, 0)
    if is_op(node, "view", "reshape") and node.op == "call_method" and node.args[1:] in ((-1,), ((-1,),)):
        nodes.add(node)
        return operand(node, 0)
    return None


def match_sorted_rows(token: fx.Node, gates: fx.Node, sizes: Any, experts: int) -> SortedRows:
    """``token = order // k``, ``gates = weights.flatten()[order]`` with ``order = ids.flatten().sort()[1]``
    (or ``argsort``), ``sizes`` the one-hot of ``ids`` summed over tokens; ``ids``, ``weights`` ``[T, k]``."""
    nodes: set[fx.Node] = set()
    if not (is_op(token, "div", "floordiv") and len(operands(token)) >= 2):
        raise NoMatch(_TAG, "the token of each sorted row is not its position divided by k.", token)
    rounding = token.kwargs.get("rounding_mode") if is_op(token, "div") else "floor"
    if rounding not in ("trunc", "floor"):
        raise NoMatch(_TAG, "the sorted positions are divided by k without rounding down.", token)
    order, k = operands(token)[:2]
    nodes.add(token)
    if not (is_op(gates, "getitem") and operand(gates, 1) is order):
        raise NoMatch(_TAG, "the gate of each sorted row is not read at its sorted position.", gates)
    weights = _flat(operand(gates, 0), nodes)
    nodes.add(gates)
    if is_op(order, "getitem") and operand(order, 1) == 1 and is_op(operand(order, 0), "sort"):
        sort = operand(order, 0)
        if operand(sort, 1, "dim") not in (0, -1) or operand(sort, 2, "descending"):
            raise NoMatch(_TAG, "the rows are not sorted by expert in ascending order.", sort)
        nodes.update({order, sort})
        flat_ids = operand(sort, 0)
    elif is_op(order, "argsort") and operand(order, 1, "dim") in (0, -1) and not operand(order, 2, "descending"):
        nodes.add(order)
        flat_ids = operand(order, 0)
    else:
        raise NoMatch(_TAG, "the rows are not ordered by sorting the flattened expert ids.", order)
    ids = _flat(flat_ids, nodes)
    shape, w_shape = getattr(value(ids), "shape", None), getattr(value(weights), "shape", None)
    if ids is None or weights is None or shape is None or len(shape) != 2 or shape != w_shape:
        raise NoMatch(_TAG, "the sorted ids and gates are not the flattened [tokens, k] ids and weights.", order)
    if value(k) != shape[1]:
        raise NoMatch(_TAG, f"the sorted positions are divided by {value(k)}, not by k = {shape[1]}.", token)
    _check_sizes(sizes, ids, flat_ids, experts, nodes)
    return SortedRows(ids, weights, k, nodes)


def _peel_counts_casts(node: Any, nodes: set) -> Any:
    """Below ``.long()``, ``.int()``, ``.to(dtype)`` and other casts: counts are the same in any dtype
    that holds them."""
    while is_op(node, "long", "int", "float", "to", "type") and node.op == "call_method":
        nodes.add(node)
        node = operand(node, 0)
    return peel_casts(node)[0]


def _check_sizes(sizes: Any, ids: fx.Node, flat_ids: fx.Node, experts: int, nodes: set) -> None:
    """``zeros([T, E]).scatter(1, ids, 1).long().sum(0).tolist()`` or ``bincount(ids.flatten(), minlength=E)``."""
    counts = _peel_counts_casts(_untolist(sizes, nodes), nodes)
    counts_base = counts
    if is_op(counts, "sum") and operand(counts, 1, "dim") in (0, (0,), [0]) and not operand(counts, 2, "keepdim"):
        nodes.add(counts)
        hot = _peel_counts_casts(operand(counts, 0), nodes)
        if is_op(hot, "scatter") and operand(hot, 1, "dim") == 1 and operand(hot, 2, "index") is ids:
            base, src = operand(hot, 0), operand(hot, 3, "value")
            if is_op(base, "zeros") and src == 1 and tuple(getattr(value(base), "shape", ())) == (
                value(ids).shape[0], experts,
            ):  # fmt: skip
                nodes.update({hot, base})
                return
    if is_op(counts_base, "bincount") and operand(counts_base, 0) is flat_ids:
        if operand(counts_base, 2, "minlength") == experts:
            nodes.add(counts_base)
            return
    raise NoMatch(_TAG, "the per-expert sizes are not the number of rows routed to each expert.", counts_base)
