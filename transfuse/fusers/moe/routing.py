"""MoE routing by dataflow: ``weights, ids = topk(score(linear(x, W)))`` → a ``RoutingSpec``.

The match walks back from the weights and ids the experts consume, in a graph where the
router child is inlined into its block (routing is split between the two differently
from one model to the next). Every spelling of each step is one node kind here:

* scores: ``softmax(logits, dtype=float32)`` or ``softmax(logits.float())``, ``sigmoid``,
  or none, when the top-k is taken of the logits and the softmax is over the k chosen;
* choice: the scores, plus a correction bias (a parameter or buffer, however reshaped),
  then optionally group-limited (groups ranked by the sum of their two best choices);
* weights: the top-k values, or the scores gathered at the chosen ids;
* then optionally ``/ (sum [+ eps])`` or ``/ clamp(sum, min=m)``, ``* scale``, one cast.

Experts run on every token (llama4's) read dense scores ``[T, E]`` instead: the sigmoid (or a
softmax) of the logits' top-k scattered into ``-inf``, zero at every expert not chosen
(``match_masked_scores``).

Numbers (k, groups, eps, scale) are kept as ``Source``s: the attribute that supplied
each, read per instance, or the literal. The casts decide the rounding and are kept in
the spec and the ``LogitsPlan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...ops.moe import RoutingSpec
from ...ops.moe_layer import INPUT, LOGITS, LogitsPlan
from ...rewriter.graph import NoMatch, is_op, op_name, operand, operands, peel_casts, value

__all__ = ["RoutingMatch", "Source", "match_masked_scores", "match_routing", "peel_reshapes", "source_of"]


@dataclass(frozen=True)
class Source:
    """Where a number comes from: an attribute (dotted path below the block) or a literal."""

    path: str | None = None
    literal: Any = None

    def read(self, module: torch.nn.Module) -> Any:
        if self.path is None:
            return self.literal
        owner, _, name = self.path.rpartition(".")
        return getattr(module.get_submodule(owner) if owner else module, name)

    def describe(self) -> str:
        return f"self.{self.path}" if self.path is not None else repr(self.literal)


def source_of(node: Any, what: str, kinds: tuple[type, ...]) -> Source:
    """The source of a number operand: a scalar attribute of self, or a literal of one of ``kinds``."""
    if isinstance(node, fx.Node):
        path = node.meta.get("self_attr")
        if path is not None and isinstance(value(node), kinds):
            return Source(path=path)
        raise NoMatch(
            "moe.number-source", f"{what} is computed ({op_name(node) or node.op}), not read from an attribute.", node
        )
    if isinstance(node, kinds) and not isinstance(node, bool):
        return Source(literal=node)
    raise NoMatch("moe.number-source", f"{what} is {node!r}, not a number.")


@dataclass
class RoutingMatch:
    """What the routing computes, the logits node, the router input, and the nodes it covers."""

    spec: RoutingSpec
    logits: fx.Node
    logits_plan: LogitsPlan
    tokens: fx.Node
    top_k: Source
    weights_dtype: str | None = None
    correction_bias: str | None = None
    n_group: Source = Source(literal=1)
    topk_group: Source = Source(literal=1)
    renorm_eps: Source | None = None
    renorm_min: Source | None = None
    scale: Source | None = None
    nodes: set[fx.Node] = field(default_factory=set)


_RESHAPES = ("view", "reshape", "view_as", "reshape_as", "squeeze", "unsqueeze", "flatten")


def peel_reshapes(node: Any) -> Any:
    """Follow view/reshape(_as)/squeeze/unsqueeze/flatten down to the value they reshape."""
    while isinstance(node, fx.Node) and is_op(node, *_RESHAPES):
        node = operand(node, 0)
    return node


def _is_last_dim(node: fx.Node, index: int = 1, name: str = "dim", default: Any = None) -> bool:
    dim = operand(node, index, name, default)
    ndim = getattr(value(operand(node, 0)), "ndim", None)
    return dim == -1 or (ndim is not None and dim == ndim - 1)


def _param(node: Any) -> str | None:
    """The path of a parameter or buffer read as is or reshaped (``bias.squeeze()``)."""
    node = peel_reshapes(node)
    if isinstance(node, fx.Node) and node.op == "get_attr" and "self_attr" not in node.meta:
        if isinstance(value(node), torch.Tensor) and not node.meta.get("constant"):
            return node.target
    return None


def _mark(nodes: set[fx.Node], top: fx.Node, bottom: Any) -> None:
    """Add ``top`` and the single-input chain from it down to ``bottom``."""
    walk = top
    while isinstance(walk, fx.Node) and walk is not bottom:
        nodes.add(walk)
        walk = operand(walk, 0)


class _Walk:
    def __init__(self):
        self.nodes: set[fx.Node] = set()

    def peel(self, node: fx.Node) -> tuple[fx.Node, list]:
        inner, casts = peel_casts(node)
        _mark(self.nodes, node, inner)
        return inner, casts

    def topk(self, node: fx.Node, index: int) -> fx.Node:
        """``node`` is ``topk(...)[index]`` (or ``.values``/``.indices``); returns the topk node."""
        field = "indices" if index else "values"
        picked = is_op(node, "getitem") and operand(node, 1) == index
        picked = picked or (is_op(node, "getattr") and operand(node, 1) == field)
        if not (picked and is_op(operand(node, 0), "topk")):
            what = "values" if index == 0 else "indices"
            raise NoMatch(
                "moe.routing-form",
                f"the routing reads {op_name(node) or node.op} ({node.name}) where the {what} of a top-k were expected.",
                node,
            )
        topk = operand(node, 0)
        if not _is_last_dim(topk, 2, "dim", -1):
            raise NoMatch("moe.routing-form", "the top-k is not taken over the experts (the last dimension).", topk)
        if operand(topk, 3, "largest", True) is not True:
            raise NoMatch("moe.routing-form", "the top-k takes the smallest values.", topk)
        self.nodes.update({node, topk})
        return topk


def match_routing(ids: fx.Node, weights: fx.Node) -> RoutingMatch:
    """The routing that produced the experts' ``ids`` and ``weights``."""
    walk = _Walk()
    core, casts = walk.peel(weights)
    if len(casts) > 1:
        raise NoMatch("moe.routing-cast", "the routing weights are cast more than once.", weights)
    scale = renorm = None
    if is_op(core, "mul"):
        core, scale = _split_scale(core, walk)
    if is_op(core, "div"):
        core, renorm = _split_renorm(core, walk)
    ids_core, _ = walk.peel(ids)
    found = _match_base(core, ids_core, walk)
    if renorm is not None:
        found.renorm_eps, found.renorm_min = renorm
    found.scale = scale
    found.spec = RoutingSpec(
        scoring=found.spec.scoring,
        float32=found.spec.float32,
        correction_bias=found.correction_bias is not None,
        grouped=found.spec.grouped,
        renormalize=renorm is not None,
        scaled=scale is not None,
    )
    found.weights_dtype = _weights_dtype(casts, found)
    found.nodes |= walk.nodes
    return found


def match_masked_scores(scores: fx.Node) -> RoutingMatch:
    """Dense scores ``[T, E]``: ``f(full_like(logits, -inf).scatter(1, ids, top))`` with ``top, ids`` the
    top-k of the logits and ``f`` a sigmoid or a softmax over the experts, [in float32,] cast once: the
    chosen experts' weights where they were chosen, exactly 0 elsewhere (``f(-inf)``). The same
    weights and ids as ``topk_sigmoid`` (``topk_softmax``) routing gives, token by token."""
    walk = _Walk()
    core, casts = walk.peel(scores)
    if len(casts) > 1:
        raise NoMatch("moe.routing-cast", "the dense routing scores are cast more than once.", scores)
    if is_op(core, "sigmoid"):
        scoring = "topk_sigmoid"
    elif is_op(core, "softmax") and _is_last_dim(core, 1, "dim"):
        scoring = "topk_softmax"
    else:
        raise NoMatch(
            "moe.dense-experts",
            f"the experts' rows are scaled by {op_name(core) or core.op} ({core.name}), not by a sigmoid or softmax of "
            "the router's top-k logits, zero at the experts not chosen: every expert contributes to every token.",
            core,
        )
    walk.nodes.add(core)
    masked, inner = walk.peel(operand(core, 0))
    if any(c.dtype != torch.float32 for c in inner):
        raise NoMatch("moe.routing-cast", f"the masked logits are cast to {inner[0].describe()}, not float32.", core)
    float32 = bool(inner) or (scoring == "topk_softmax" and _softmax_dtype(core) == torch.float32)
    base = operand(masked, 0) if is_op(masked, "scatter", "scatter_") else None
    fill = operand(base, 1, "fill_value") if is_op(base, "full_like") else None
    if not (isinstance(fill, float) and fill == -math.inf) or set(base.kwargs) - {"fill_value"} or len(base.users) != 1:
        raise NoMatch(
            "moe.dense-experts",
            "the dense routing scores are not the chosen logits scattered into -inf (so that every expert not "
            "chosen scores exactly 0).",
            masked,
        )
    if not _is_last_dim(masked, 1, "dim") or masked.kwargs.get("reduce") is not None:
        raise NoMatch("moe.dense-experts", "the chosen logits are not scattered over the experts.", masked)
    top = walk.topk(operand(masked, 2, "index"), 1)
    if walk.topk(operand(masked, 3, "src"), 0) is not top or operand(base, 0) is not operand(top, 0):
        raise NoMatch(
            "moe.dense-experts", "the scattered values are not the top-k of the logits at their own experts.", masked
        )
    walk.nodes.update({masked, base})
    logits, plan, tokens = _match_logits(operand(top, 0), walk)
    found = RoutingMatch(
        RoutingSpec(scoring=scoring, float32=float32), logits, plan, tokens, source_of(operand(top, 1, "k"), "k", (int,))
    )
    if casts and casts[0].like is not None and peel_reshapes(casts[0].like) in (masked, base):
        found.weights_dtype = LOGITS  # cast back to the dtype of the masked logits: the logits' own
    else:
        found.weights_dtype = _weights_dtype(casts, found)
    found.nodes |= walk.nodes
    return found


def _split_scale(node: fx.Node, walk: _Walk) -> tuple[fx.Node, Source]:
    a, b = operands(node)[:2]
    for factor, rest in ((b, a), (a, b)):
        if isinstance(rest, fx.Node) and not isinstance(value(factor), torch.Tensor):
            walk.nodes.add(node)
            return rest, source_of(factor, "the routing scale", (float, int))
    raise NoMatch("moe.routing-form", "the routing weights are multiplied by a tensor, not a scaling factor.", node)


def _split_renorm(node: fx.Node, walk: _Walk) -> tuple[fx.Node, tuple[Source | None, Source | None]]:
    """``w / (sum(w) [+ eps])`` or ``w / clamp(sum(w), min=m)``."""
    numerator, total = operands(node)[:2]
    eps = minimum = None
    if is_op(total, "add"):
        a, b = operands(total)[:2]
        total, eps_node = (a, b) if is_op(a, "sum") else (b, a)
        eps = source_of(eps_node, "the renormalisation epsilon", (float, int))
        walk.nodes.add(operands(node)[1])
    elif is_op(total, "clamp", "clamp_min"):
        minimum = source_of(operand(total, 1, "min"), "the renormalisation minimum", (float, int))
        if operand(total, 2, "max") is not None:
            raise NoMatch("moe.routing-form", "the sum of the routing weights is clamped above.", total)
        walk.nodes.add(total)
        total = operand(total, 0)
    if not (is_op(total, "sum") and operand(total, 0) is numerator and _is_last_dim(total)):
        raise NoMatch("moe.routing-form", "the routing weights are divided by something other than their sum.", node)
    if operand(total, 2, "keepdim", False) is not True:
        raise NoMatch("moe.routing-form", "the sum of the routing weights does not keep its dimension.", total)
    walk.nodes.update({node, total})
    return numerator, (eps, minimum)


def _match_base(core: fx.Node, ids: fx.Node, walk: _Walk) -> RoutingMatch:
    if is_op(core, "softmax"):  # top-k of the logits, softmax over the k
        top = walk.topk(operand(core, 0), 0)
        if walk.topk(ids, 1) is not top:
            raise NoMatch("moe.routing-form", "the ids and the weights come from different top-k calls.", ids)
        if not _is_last_dim(core, 1, "dim"):
            raise NoMatch(
                "moe.routing-form", "the softmax over the chosen experts is not over the last dimension.", core
            )
        walk.nodes.add(core)
        logits, plan, tokens = _match_logits(operand(top, 0), walk)
        float32 = _softmax_dtype(core) == torch.float32
        spec = RoutingSpec(scoring="topk_softmax", float32=float32)
        return RoutingMatch(spec, logits, plan, tokens, source_of(operand(top, 1, "k"), "k", (int,)))
    if is_op(core, "gather"):  # scores gathered at the ids chosen from a biased or group-limited choice
        return _match_gathered(core, ids, walk)
    top = walk.topk(core, 0)
    if walk.topk(ids, 1) is not top:
        raise NoMatch("moe.routing-form", "the ids and the weights come from different top-k calls.", ids)
    scoring, float32, logits, plan, tokens = _match_scores(operand(top, 0), walk)
    spec = RoutingSpec(scoring=scoring, float32=float32)
    return RoutingMatch(spec, logits, plan, tokens, source_of(operand(top, 1, "k"), "k", (int,)))


def _match_gathered(gather: fx.Node, ids: fx.Node, walk: _Walk) -> RoutingMatch:
    scores, dim, index = operand(gather, 0), operand(gather, 1, "dim"), operand(gather, 2, "index")
    if index is not ids or dim not in (1, -1):
        raise NoMatch(
            "moe.routing-form", "the routing weights are gathered at something other than the chosen ids.", gather
        )
    walk.nodes.add(gather)
    top = walk.topk(ids, 1)
    choice = operand(top, 0)
    grouped = None
    if is_op(choice, "masked_fill"):
        choice, grouped = _match_group_limit(choice, walk)
    bias = None
    if choice is not scores:
        if not is_op(choice, "add"):
            raise NoMatch(
                "moe.routing-form", "the experts are chosen by something other than the scores plus a bias.", choice
            )
        a, b = operands(choice)[:2]
        term = b if a is scores else a if b is scores else None
        bias = _param(term) if term is not None else None
        if bias is None:
            raise NoMatch(
                "moe.routing-form", "the choice adds to the scores something other than a bias parameter.", choice
            )
        _mark(walk.nodes, term, peel_reshapes(term))
        walk.nodes.update({choice, peel_reshapes(term)})
    scoring, float32, logits, plan, tokens = _match_scores(scores, walk)
    n_group, topk_group = grouped or (Source(literal=1), Source(literal=1))
    spec = RoutingSpec(scoring=scoring, float32=float32, grouped=grouped is not None)
    return RoutingMatch(
        spec, logits, plan, tokens, source_of(operand(top, 1, "k"), "k", (int,)),
        correction_bias=bias, n_group=n_group, topk_group=topk_group,
    )  # fmt: skip


def _match_group_limit(masked: fx.Node, walk: _Walk) -> tuple[fx.Node, tuple[Source, Source]]:
    """``choice.masked_fill(~mask.bool(), -inf)`` where the mask keeps the best groups of ``choice``."""
    choice, condition, fill = operand(masked, 0), operand(masked, 1, "mask"), operand(masked, 2, "value")
    if not (isinstance(fill, float) and fill == -math.inf and is_op(condition, "invert")):
        raise NoMatch(
            "moe.group-limit", "experts are masked with something other than -inf outside a kept set.", masked
        )
    mask = operand(condition, 0)
    if is_op(mask, "bool"):
        walk.nodes.add(mask)
        mask = operand(mask, 0)
    expanded = peel_reshapes(mask)
    if is_op(expanded, "expand"):
        walk.nodes.add(expanded)
        expanded = peel_reshapes(operand(expanded, 0))
    _mark(walk.nodes, mask, expanded)
    group_mask = expanded
    scatters = [u for u in group_mask.users if is_op(u, "scatter_")]
    if not (is_op(group_mask, "zeros_like") and len(scatters) == 1):
        raise NoMatch("moe.group-limit", "the expert mask is not built from a per-group mask.", masked)
    scatter = scatters[0]
    if operand(scatter, 1, "dim") != 1 or operand(scatter, 3, "value") != 1:
        raise NoMatch("moe.group-limit", "the group mask is not set to 1 at the chosen groups.", scatter)
    group_top = walk.topk(operand(scatter, 2, "index"), 1)
    group_scores = operand(group_top, 0)
    if operand(group_mask, 0) is not group_scores:
        raise NoMatch("moe.group-limit", "the group mask does not have the group scores' shape.", group_mask)
    n_group = _match_group_scores(group_scores, choice, walk)
    walk.nodes.update({masked, condition, group_mask, scatter, operand(scatter, 2, "index")})
    return choice, (n_group, source_of(operand(group_top, 1, "k"), "the number of groups kept", (int,)))


def _match_group_scores(group_scores: fx.Node, choice: fx.Node, walk: _Walk) -> Source:
    """``choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)``; returns G's source."""
    if not (is_op(group_scores, "sum") and _is_last_dim(group_scores)):
        raise NoMatch("moe.group-limit", "a group's score is not a sum over its experts.", group_scores)
    top = walk.topk(operand(group_scores, 0), 0)
    if operand(top, 1, "k") != 2:
        raise NoMatch("moe.group-limit", f"a group's score sums its {operand(top, 1, 'k')!r} best experts, not 2.", top)
    view = operand(top, 0)
    if not (is_op(view, "view", "reshape") and peel_reshapes(view) is choice):
        raise NoMatch("moe.group-limit", "the group scores are not computed from the expert choice.", view)
    shape = operands(view)[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if len(shape) != 3:
        raise NoMatch(
            "moe.group-limit", "the expert choice is not viewed as [tokens, groups, experts per group].", view
        )
    walk.nodes.update({group_scores, view})
    return source_of(shape[1], "the number of expert groups", (int,))


def _softmax_dtype(node: fx.Node) -> torch.dtype | None:
    dtype = operand(node, 3, "dtype")
    return dtype if isinstance(dtype, torch.dtype) else None


def _match_scores(scores: fx.Node, walk: _Walk) -> tuple[str, bool, fx.Node, LogitsPlan, fx.Node]:
    """``softmax(logits[, float32])`` or ``sigmoid(logits)`` → (scoring, float32, logits, plan, tokens)."""
    if is_op(scores, "softmax"):
        if not _is_last_dim(scores, 1, "dim"):
            raise NoMatch("moe.routing-form", "the softmax over the experts is not over the last dimension.", scores)
        inner, casts = walk.peel(operand(scores, 0))
        float32 = _softmax_dtype(scores) == torch.float32 or any(c.dtype == torch.float32 for c in casts)
        walk.nodes.add(scores)
        logits, plan, tokens = _match_logits(inner, walk)
        return "softmax", float32, logits, plan, tokens
    if is_op(scores, "sigmoid"):
        walk.nodes.add(scores)
        logits, plan, tokens = _match_logits(operand(scores, 0), walk)
        return "sigmoid", False, logits, plan, tokens
    raise NoMatch(
        "moe.routing-form",
        f"the top-k is taken of {op_name(scores) or scores.op}, not of a softmax or sigmoid of the router logits.",
        scores,
    )


def _match_logits(node: fx.Node, walk: _Walk) -> tuple[fx.Node, LogitsPlan, fx.Node]:
    """``linear(x [cast], W [cast], b?) [cast]`` → (logits node, plan, x)."""
    linear, out_casts = walk.peel(node)
    if not is_op(linear, "linear"):
        raise NoMatch(
            "moe.router-logits", f"the router logits are {op_name(linear) or linear.op}, not a linear layer.", linear
        )
    x, in_casts = walk.peel(operand(linear, 0))
    while is_op(x, *_RESHAPES) and peel_casts(peel_reshapes(x))[1]:  # ``x.float().reshape(-1, H)``
        reshaped = peel_reshapes(x)
        _mark(walk.nodes, x, reshaped)
        x, more = walk.peel(reshaped)
        in_casts += more
    weight, w_casts = walk.peel(operand(linear, 1, "weight"))
    bias = operand(linear, 2, "bias")
    weight_path = _param(weight)
    bias_path = _param(bias) if bias is not None else None
    if weight_path is None or (bias is not None and bias_path is None):
        raise NoMatch("moe.router-logits", "the router's weight or bias is not a parameter.", linear)
    # ``x.to(W.dtype)``: the input cast to the router weight's dtype (as the weight is, uncast).
    like_weight = len(in_casts) == 1 and in_casts[0].like is weight and not w_casts
    if like_weight:
        in_casts = []
    for casts, what in ((out_casts, "logits"), (in_casts, "router input"), (w_casts, "router weight")):
        if any(c.dtype != torch.float32 for c in casts):
            raise NoMatch("moe.routing-cast", f"the {what} is cast to {casts[0].describe()}, not float32.", linear)
    walk.nodes.add(linear)
    plan = LogitsPlan(weight_path, bias_path, bool(in_casts), bool(w_casts), bool(out_casts), like_weight)
    return node, plan, x


def _weights_dtype(casts: list, found: RoutingMatch) -> str | None:
    if not casts:
        return None
    cast = casts[0]
    if cast.dtype is not None:
        if cast.dtype != torch.float32:
            raise NoMatch("moe.routing-cast", f"the routing weights are cast to {cast.describe()}.")
        return "float32"
    like = cast.like
    if like is found.logits or peel_casts(found.logits)[0] is like:
        return LOGITS
    if peel_reshapes(like) is peel_reshapes(found.tokens) or like.op == "placeholder":
        return INPUT
    raise NoMatch("moe.routing-cast", f"the routing weights are cast to the dtype of {like.name}.", like)
