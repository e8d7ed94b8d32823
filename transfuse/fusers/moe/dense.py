"""MoE experts run on every token by dataflow: ``Σ_e experts_e(x · s[:, e])`` over dense scores ``s``.

Some models (llama4) compute every expert on every token with batched matmuls, each token's
row scaled by its score for that expert; the scores are zero at the experts a token did
not choose (``routing.match_masked_scores``), so those rows are zero and so are their
outputs, as long as the expert has no bias: ``down(act(gate(0)) · up(0)) = 0``. What that
computes is a routed mixture whose weights scale the input (``ExpertsPlan.weights_on_input``):
the fused layer runs each token's k chosen experts only. The three places of the form:

* the block: ``experts(tokens.repeat(E, 1) · s.transpose(0, 1).reshape(-1, 1))``, row
  ``e·T + t`` holding token t scaled by its score for expert e (``match_scaled_rows``);
* the experts: ``view(bmm(act(gate) · up, W2), -1, H)`` of ``bmm(rows.view(E, -1, H), W13)``,
  expert e reading rows ``e·T .. e·T + T - 1`` (``match_dense_experts``);
* the block again: ``out.reshape(E, -1, H).sum(0)``, each token's E outputs added
  (``match_expert_sum``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...ops.moe import ExpertsSpec
from ...rewriter.graph import NoMatch, is_op, op_name, operand, operands, value
from ...rewriter.tracer import Trace
from .experts import Lookup, PackedExpert, gated, split_halves

__all__ = ["DenseExperts", "match_dense_experts", "match_expert_sum", "match_scaled_rows"]

_TAG = "moe.dense-experts"


@dataclass
class DenseExperts:
    """The packed experts a dense forward computes, their number, and the nodes of its graph they cover."""

    packed: PackedExpert
    experts: int
    hidden: int
    nodes: set[fx.Node] = field(default_factory=set)


def _sizes(node: fx.Node) -> tuple[Any, ...]:
    """The sizes a ``view``/``reshape`` is given, as traced values (ints, -1)."""
    sizes = node.args[1:] if node.op == "call_method" else node.args[1:2]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = sizes[0]
    return tuple(value(d) for d in sizes)


def _shape(node: Any) -> tuple[int, ...] | None:
    shape = getattr(value(node), "shape", None)
    return tuple(shape) if shape is not None else None


def _packed_weight(node: Any) -> str | None:
    """A 3-D parameter of the traced module, read as is."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and "self_attr" not in node.meta:
        tensor = value(node)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and not node.meta.get("constant"):
            return node.target
    return None


def _batched_projection(node: fx.Node, nodes: set[fx.Node]) -> tuple[fx.Node, str, bool]:
    """``bmm(h, W)`` / ``h @ W`` with W ``[E, in, out]``, or the same of ``W.transpose(1, 2)`` with W
    ``[E, out, in]`` → (h, W's path, transposed: W is ``[E, in, out]``)."""
    if is_op(node, "bmm", "matmul") and len(operands(node)) == 2 and not node.kwargs:
        h, weight = operands(node)
        path = _packed_weight(weight)
        if path is not None:
            nodes.add(node)
            return h, path, True
        if is_op(weight, "transpose") and {operand(weight, 1), operand(weight, 2)} in ({1, 2}, {-1, -2}):
            path = _packed_weight(operand(weight, 0))
            if path is not None:
                nodes.update({node, weight})
                return h, path, False
    if is_op(node, "add", "sub"):
        raise NoMatch(
            _TAG, f"the experts add a term to a projection ({node.name}, a bias): a row scaled to zero would not "
            "give zero, so the experts a token did not choose would add to it.", node,
        )  # fmt: skip
    raise NoMatch(
        _TAG, f"{op_name(node) or node.op} ({node.name}) is not a batched matmul by one of the experts' tensors.", node
    )


def match_dense_experts(trace: Trace, children: Lookup) -> DenseExperts:
    """The experts' forward: every expert applied to its own block of rows, with no bias."""
    rows = [p for p in trace.placeholders() if p.users]
    result = trace.output.args[0] if trace.output is not None else None
    if len(rows) != 1 or not isinstance(result, fx.Node):
        raise NoMatch(_TAG, "the experts' forward does not map one tensor of rows to one tensor.", trace.output)
    nodes: set[fx.Node] = set()
    if not (is_op(result, "view", "reshape") and len(_sizes(result)) == 2 and _sizes(result)[0] == -1):
        raise NoMatch(_TAG, "the experts' forward does not return its outputs flattened to rows.", result)
    nodes.add(result)
    h, w2, w2_t = _batched_projection(operand(result, 0), nodes)
    gate, up, activation, alpha, limit = gated(h, children, nodes)
    projection, (interleaved, gate_first) = split_halves(gate, up, nodes)
    grouped, w13, w13_t = _batched_projection(projection, nodes)
    shapes = {n.target: value(n).shape for n in trace.graph.nodes if n.op == "get_attr" and n.target in (w13, w2)}
    experts, hidden = shapes[w13][0], (_shape(result) or (None,))[-1]
    sizes = _sizes(grouped) if is_op(grouped, "view", "reshape") else ()
    if not (
        operand(grouped, 0) is rows[0] and sizes == (experts, -1, hidden) and shapes[w2][0] == experts
    ):  # fmt: skip
        raise NoMatch(
            _TAG, "the experts do not read their rows as [experts, rows per expert, hidden], one block per expert.",
            grouped,
        )  # fmt: skip
    nodes.add(grouped)
    spec = ExpertsSpec(activation, interleaved, gate_first, w13_t, w2_t)
    return DenseExperts(PackedExpert(w13, w2, spec, alpha=alpha, limit=limit), experts, hidden, nodes)


def match_scaled_rows(call: fx.Node, experts: int) -> tuple[fx.Node, fx.Node, set[fx.Node]]:
    """``experts(tokens.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1))`` → (tokens, scores, nodes)."""
    scaled = call.args[0] if len(call.args) == 1 and not call.kwargs else None
    if not (is_op(scaled, "mul") and len(operands(scaled)) == 2 and not scaled.kwargs):
        raise NoMatch(_TAG, f"the experts {call.target!r} are not called on rows scaled by routing scores.", call)
    for repeated, column in (operands(scaled), operands(scaled)[::-1]):
        if not (is_op(repeated, "repeat") and is_op(column, "reshape", "view")):
            continue
        times = operands(repeated)[1:]
        if len(times) == 1 and isinstance(times[0], (tuple, list, torch.Size)):
            times = tuple(times[0])
        tokens, transposed = operand(repeated, 0), operand(column, 0)
        if tuple(value(t) for t in times) != (experts, 1) or len(_shape(tokens) or ()) != 2:
            break
        if _sizes(column) != (-1, 1) or not (
            is_op(transposed, "transpose") and {operand(transposed, 1), operand(transposed, 2)} == {0, 1}
        ):
            break
        scores = operand(transposed, 0)
        if _shape(scores) != (_shape(tokens)[0], experts):
            break
        return tokens, scores, {scaled, repeated, column, transposed}
    raise NoMatch(
        _TAG,
        f"the rows the experts {call.target!r} read are not every token repeated once per expert, each scaled by "
        "its score for that expert.",
        scaled,
    )


def match_expert_sum(call: fx.Node, experts: int, hidden: int) -> tuple[fx.Node, set[fx.Node]]:
    """``experts(...).reshape(E, -1, H).sum(0)``: each token's outputs of all experts added → (sum, nodes)."""
    users = list(call.users)
    grouped = users[0] if len(users) == 1 else None
    sizes = _sizes(grouped) if is_op(grouped, "reshape", "view") else ()
    if len(sizes) == 3 and sizes[0] == experts and sizes[2] == hidden:  # [experts, tokens, hidden]
        sums = list(grouped.users)
        total = sums[0] if len(sums) == 1 else None
        dim = operand(total, 1, "dim") if is_op(total, "sum") else None
        if dim in (0, (0,), [0]) and not operand(total, 2, "keepdim", False) and operand(total, 3, "dtype") is None:
            return total, {grouped, total}
    raise NoMatch(
        _TAG, f"the outputs of the experts {call.target!r} are not added over the experts for each token.", call
    )
