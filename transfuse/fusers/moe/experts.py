"""MoE experts by dataflow: ``out.index_add_(0, t, w[t, s] · expert_e(x[t]))`` over the hit experts.

Models compute experts in a loop over the experts that received tokens, with the same
bookkeeping: a one-hot of the ids, permuted so the expert axis comes first; ``nonzero``
of its per-expert counts to find the hit experts; ``where`` of one expert's slice to
find its (slot, token) pairs; the expert applied to those tokens' rows, times their
routing weights, added into a zero tensor. The tracer follows one representative
iteration (``Trace.assumptions`` says where); this module checks that iteration's
dataflow, including which ``where`` output is the token and which the slot (it depends
on the permutation), and that a skipped iteration only skips an id no expert has.

The expert itself is either packed tensors indexed by the expert (``gate_up_proj[e]``,
``down_proj[e]``; ``F.linear`` or ``@``; halves, interleaved, or gpt-oss's clamped SwiGLU)
or a member of an ``nn.ModuleList`` whose own graph is ``down(act(gate(x)) * up(x))``. A member
may be handed the routing weights of its rows and multiply them onto that output as its last
operation (``expert(rows, w[t, s, None])`` returning ``w * down(...)``): the same product as
multiplying outside. Rows and weights may be indexed by the indices as Python lists (``.tolist()``).
In a loop over every expert index, the expert may also be one module shared by all, handed the rows
and expert e's slices of parameters that hold every expert's block (``w1.view(E, I, H).chunk(E)[e]``)
and computing the gated MLP from them (``SlicedMember``): the slices are stacked like members.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import libcst as cst
import libcst.matchers as m
import torch
import torch.fx as fx

from ...ops.moe import ExpertsSpec
from ...rewriter.graph import NoMatch, is_op, op_name, operand, operands, peel_casts, value
from ...rewriter.inline import call_inputs
from ...rewriter.source import method_source
from ...rewriter.tracer import Trace, unwrapped_forward
from .routing import Source, source_of

__all__ = [
    "GLUMember", "Lookup", "LoopMatch", "PackedExpert", "SlicedMember", "activation_of", "gated", "match_glu_member",
    "match_loop", "match_sliced_member", "split_halves",
]

Lookup = Callable[[str], "Trace | None"]


@dataclass(frozen=True)
class PackedExpert:
    """Packed expert tensors (paths in the traced module) and their layout."""

    w13: str
    w2: str
    spec: ExpertsSpec
    b13: str | None = None
    b2: str | None = None
    alpha: Source | None = None
    limit: Source | None = None
    # Quantized experts (a scheme's projection leaf, ``ops.quantized.fp8_experts``): each weight's scales.
    w13_scale: str | None = None
    w2_scale: str | None = None


@dataclass(frozen=True)
class GLUMember:
    """A per-expert module computing ``down(act(gate(x)) * up(x))``: its children's names."""

    gate: str
    up: str
    down: str
    activation: str


@dataclass(frozen=True)
class SlicedMember:
    """One module applying every expert, handed expert e's slices of parameters held as ``[E, ...]``
    (``P.view(E, r, c)[e]``): ``down(act(gate(x)) * up(x))``, each projection by one slice. Each of gate,
    up and down is (the parameter's path below the experts' owner, whether the slice is applied as
    ``F.linear``/``x @ w.t()``, else as ``x @ w``)."""

    gate: tuple[str, bool]
    up: tuple[str, bool]
    down: tuple[str, bool]
    activation: str


@dataclass
class LoopMatch:
    """The loop over hit experts: its inputs, what it returns, and what each expert is."""

    accumulator: fx.Node
    tokens: fx.Node
    ids: fx.Node
    weights: fx.Node
    skip_ids_from: Source | None  # an id the loop skips, when it skips one: it must be no expert's
    packed: PackedExpert | None = None
    member_list: str | None = None  # the ModuleList whose members are the experts
    member_call: fx.Node | None = None
    nodes: set[fx.Node] = field(default_factory=set)
    accumulate_fp32: bool = False  # the outputs are added into float32 zeros (the sum is cast back)
    member_calls: list[fx.Node] = field(default_factory=list)  # every member called (one per unrolled iteration)
    unrolled: int | None = None  # a loop over every expert index, unrolled by tracing: how many iterations
    weights_cast: bool = False  # each routing weight is cast to its expert output's dtype before the product
    member_weight: str | None = None  # the member's parameter its rows' routing weights are passed as, if any
    sliced: tuple[str, ...] | None = None  # the parameters one shared module is handed expert e's slices of
    sliced_experts: set[int] = field(default_factory=set)  # how many experts' blocks those parameters hold


def match_loop(trace: Trace, children: Lookup) -> LoopMatch:
    """The hit-experts loop of ``trace`` (an experts class, or a block that loops itself), or a loop
    over every expert index that tracing unrolled (``_match_unrolled``)."""
    graph = trace.graph
    adds = [n for n in graph.nodes if is_op(n, "index_add_", "index_add")]
    if len(adds) > 1 and len({operand(n, 0) for n in adds}) == 1:
        return _match_unrolled(trace, adds, children)
    if len(adds) != 1:
        raise NoMatch("moe.combine", f"the forward has {len(adds)} index_add calls, not one per expert iteration.")
    found, expert, mask, expert_out = _iteration(adds[0], children)
    _check_loop(trace, expert, mask, found)
    if expert_out.op == "call_module":
        rows = _member(expert_out, found)
    else:
        found.packed, rows = _packed(expert_out, expert, children, found)
    found.tokens = _rows_source(rows, operand(adds[0], 2), found)
    _check_accumulator(found.accumulator, found.tokens, found)
    return found


def _iteration(add: fx.Node, children: Lookup) -> tuple[LoopMatch, Any, fx.Node | None, fx.Node]:
    """One iteration's ``index_add_``: (its match so far, the expert index, the mask, the expert's output)."""
    accumulator, dim, token_idx, source = (operand(add, i) for i in range(4))
    if dim != 0:
        raise NoMatch("moe.combine", f"expert outputs are added along dimension {dim}, not over tokens.", add)
    found = LoopMatch(accumulator, None, None, None, None, nodes={add})
    contribution, casts = peel_casts(source)
    _chain(found.nodes, source, contribution)
    weighted = _weighted_call(contribution, children) if len(casts) <= 1 else None
    if weighted is not None:  # expert(rows, w[t, s, None]), which returns w * its output
        found.member_weight, passed = weighted
        selection, expert_out = _weight_selection(passed, found), contribution
        if selection is None:
            raise NoMatch(
                "moe.combine", "the expert multiplies its output by an argument that is not its rows' routing weights "
                "weights[token, slot].", contribution,
            )  # fmt: skip
    elif len(casts) > 1 or not is_op(contribution, "mul"):
        raise NoMatch("moe.combine", "what is added per expert is not its output times a routing weight.", source)
    else:
        found.nodes.add(contribution)
        selection, expert_out = _split_weight(contribution, found)
    where, token_axis_output = _token_index(token_idx, selection, found)
    expert, mask = _expert_index(where, token_axis_output, found)
    ids_shape, weights_shape = (getattr(value(n), "shape", None) for n in (found.ids, found.weights))
    if ids_shape is None or ids_shape != weights_shape:
        raise NoMatch("moe.combine", f"the routing weights {weights_shape} are not laid out like the ids {ids_shape}.", add)
    return found, expert, mask, expert_out


def _match_unrolled(trace: Trace, adds: list[fx.Node], children: Lookup) -> LoopMatch:
    """``for e in range(E)``, unrolled by tracing into one ``index_add_`` per expert: iteration ``i``
    must read expert ``i`` (``mask[i]`` or ``ids == i``), call member ``i`` of one module list on the
    rows routed to it, and read the same tokens, ids and weights as the others, for ``i`` in
    ``0..E-1`` (the instance check makes sure its list has E members). The sum over every expert of
    its rows' weighted outputs is the routed mixture; only its order per token may differ."""
    first = None
    for i, add in enumerate(adds):
        found, expert, mask, expert_out = _iteration(add, children)
        if isinstance(expert, fx.Node) or expert != i:
            raise NoMatch(
                "moe.unrolled-loop",
                f"iteration {i} of the unrolled experts loop reads expert {getattr(expert, 'name', expert)!r}, not {i}.",
                add,
            )
        if expert_out.op != "call_module":
            raise NoMatch(
                "moe.unrolled-loop", "an unrolled experts loop computes experts from packed tensors; only a loop over "
                "the experts that received tokens is followed for those.", add,
            )  # fmt: skip
        rows = _member(expert_out, found, index=str(i))
        found.tokens = _rows_source(rows, operand(add, 2), found)
        _check_accumulator(found.accumulator, found.tokens, found)
        if first is None:
            first = found
            continue
        same = (
            found.tokens, found.ids, found.weights, found.member_list, found.accumulate_fp32, found.member_weight,
            found.sliced, found.member_call.target if found.sliced else None,
        ) == (
            first.tokens, first.ids, first.weights, first.member_list, first.accumulate_fp32, first.member_weight,
            first.sliced, first.member_call.target if first.sliced else None,
        )  # fmt: skip
        if not same:
            raise NoMatch(
                "moe.unrolled-loop", f"iteration {i} of the unrolled experts loop reads other tokens, routing or "
                "experts than the first.", add,
            )  # fmt: skip
        first.nodes |= found.nodes
        first.member_calls += found.member_calls
    source = method_source(unwrapped_forward(trace.cls))
    indices = {operand(add, 2) for add in adds}
    for assumption in trace.assumptions:
        if assumption.kind == "size" and assumption.node in indices and _skips_empty(source, assumption.location):
            continue
        raise NoMatch(
            "moe.loop-form",
            f"the loop reads data-dependent values in a way transfuse does not follow ({assumption.describe()}).",
            assumption.node,
        )
    if first.sliced is not None and first.sliced_experts != {len(adds)}:
        raise NoMatch(
            "moe.unrolled-loop", f"the unrolled experts loop runs {len(adds)} times over slices of "
            f"{', '.join(first.sliced)}, which hold {sorted(first.sliced_experts)} experts' blocks.", adds[0],
        )  # fmt: skip
    first.unrolled = len(adds)
    return first


def _skips_empty(source, location) -> bool:
    """``if rows.numel() == 0: continue`` (``shape[0]``, ``size(0)``, ``len(rows)`` too): an expert
    no token chose is skipped, which adds nothing."""
    if source is None or location is None or location[0] != source.filename or not _continue_only_if(
        source, location[1]
    ):
        return False
    node = next(n for n in m.findall(source.node, m.If()) if source.line(n) == location[1])
    size = m.Call(func=m.Attribute(attr=m.Name("numel")), args=[]) | m.Call(
        func=m.Attribute(attr=m.Name("size")), args=[m.Arg(m.Integer("0"))]
    ) | m.Subscript(value=m.Attribute(attr=m.Name("shape")), slice=[m.SubscriptElement(m.Index(m.Integer("0")))]) | m.Call(
        func=m.Name("len"), args=[m.Arg()]
    )  # fmt: skip
    empty = m.Comparison(left=size, comparisons=[m.ComparisonTarget(m.Equal(), m.Integer("0"))])
    return m.matches(node.test, empty | m.UnaryOperation(operator=m.Not(), expression=size))


def _chain(nodes: set[fx.Node], top: fx.Node, bottom: fx.Node) -> None:
    walk = top
    while walk is not bottom:
        nodes.add(walk)
        walk = operand(walk, 0)


def weighted_output(trace: Trace | None) -> tuple[fx.Node, fx.Node] | None:
    """A forward whose last operation multiplies one of its inputs onto what it computed
    (``return weight * h``), that input read nowhere else: (the input's placeholder, h); else None."""
    if trace is None or trace.partial or trace.output is None:
        return None
    out = trace.output.args[0]
    if not (is_op(out, "mul") and len(out.users) == 1):
        return None
    for weight, h in (operands(out)[:2], operands(out)[1::-1]):
        if isinstance(weight, fx.Node) and weight.op == "placeholder" and len(weight.users) == 1:
            if isinstance(h, fx.Node) and h.op != "placeholder":
                return weight, h
    return None


def _weighted_call(call: fx.Node, children: Lookup) -> tuple[str, Any] | None:
    """``member(rows, w)`` whose forward returns ``w * output``: (the parameter's name, the argument w)."""
    if call.op != "call_module":
        return None
    trace = children(call.target)
    weighted = weighted_output(trace)
    inputs = call_inputs(trace, call.args, call.kwargs) if weighted is not None else None
    if inputs is None or weighted[0].target not in inputs:
        return None
    return weighted[0].target, inputs[weighted[0].target]


def _untolist(node: Any, found: LoopMatch) -> Any:
    """``t.tolist()`` → t: indexing by the list of a tensor's values selects what the tensor does."""
    if is_op(node, "tolist") and len(node.args) == 1 and not node.kwargs:
        found.nodes.add(node)
        return operand(node, 0)
    return node


def _weight_selection(selection: Any, found: LoopMatch) -> fx.Node | None:
    """``weights[t, s, None]`` or ``weights[t, s].unsqueeze(-1)`` → the ``weights[t, s...]`` node (and
    ``found.weights``); None for anything else."""
    base = selection
    if is_op(base, "unsqueeze") and operand(base, 1, "dim") in (-1, 1):
        base = operand(base, 0)
    if is_op(base, "getitem") and isinstance(operand(base, 1), tuple):
        index = operand(base, 1)
        if len(index) == 3 and index[2] is None and base is selection or len(index) == 2 and base is not selection:
            found.nodes.update({selection, base})
            found.weights = operand(base, 0)
            return base
    return None


def _split_weight(mul: fx.Node, found: LoopMatch) -> tuple[fx.Node, fx.Node]:
    """``expert_out * weights[t, s, None]`` (either order; ``[t, s].unsqueeze(-1)`` too; the weight may be
    cast to the expert output's dtype, as block-FP8 experts write it, which ``moe_experts_fp8`` computes:
    ``weights_cast`` records it, and ``_packed`` refuses it for other experts)."""
    for selection, other in (operands(mul)[:2], operands(mul)[1::-1]):
        peeled, casts = peel_casts(selection)
        if len(casts) == 1 and casts[0].like is other:
            found.nodes.add(selection)
            found.weights_cast = True
            selection = peeled
        base = _weight_selection(selection, found)
        if base is not None:
            return base, other
    for gates in operands(mul)[:2]:
        if is_op(gates, "getitem") and operand(gates, 1) == (slice(None), None):
            raise NoMatch(
                "moe.sorted-rows",
                "the rows of every (token, expert) pair are computed in one pass, weighted by one flat gate per row "
                "(gates[:, None]) and added back with one index_add, where the experts matcher follows a loop adding "
                "weight · expert(rows) per expert.",
                mul,
            )  # fmt: skip
    raise NoMatch("moe.combine", "the expert output is not multiplied by its routing weight weights[token, slot].", mul)


def _token_index(token_idx: fx.Node, selection: fx.Node, found: LoopMatch) -> tuple[fx.Node, tuple[int, int]]:
    """The ``where`` both indices come from, and which of its outputs are the token and the slot."""
    tok, slot = (_untolist(i, found) for i in operand(selection, 1)[:2])
    if tok is not token_idx:
        raise NoMatch("moe.combine", "the routing weight is not read at the token its output is added to.", selection)
    if not (is_op(tok, "getitem") and is_op(slot, "getitem") and operand(tok, 0) is operand(slot, 0)):
        raise NoMatch("moe.combine", "the token and slot indices do not come from one where().", selection)
    where = operand(tok, 0)
    if not is_op(where, "where") or len(where.args) != 1 or where.kwargs:
        raise NoMatch("moe.combine", "the token and slot indices do not come from where(mask).", where)
    found.nodes.update({tok, slot, where})
    return where, (operand(tok, 1), operand(slot, 1))


def _expert_index(where: fx.Node, outputs: tuple[int, int], found: LoopMatch) -> tuple[Any, fx.Node | None]:
    """``where(mask[e])`` with ``mask = one_hot(ids).permute(p)``, or ``where(ids == e)``; checks
    which output is which axis. (expert index, mask or None)."""
    sliced = operand(where, 0)
    if is_op(sliced, "eq") and not isinstance(operand(sliced, 1), fx.Node):
        if outputs != (0, 1):
            raise NoMatch("moe.combine", "the token and slot indices are swapped relative to where(ids == e).", where)
        found.ids = operand(sliced, 0)
        found.nodes.add(sliced)
        return operand(sliced, 1), None
    if is_op(sliced, "squeeze") and operand(sliced, 1, "dim") == 0:
        found.nodes.add(sliced)
        sliced = operand(sliced, 0)
    if not is_op(sliced, "getitem"):
        raise NoMatch("moe.combine", "where() is not applied to one expert's slice of the mask.", sliced)
    mask, expert = operand(sliced, 0), operand(sliced, 1)
    if not is_op(mask, "permute"):
        raise NoMatch("moe.combine", "the expert mask is not a permuted one-hot of the ids.", mask)
    order = operands(mask)[1:]
    order = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list)) else tuple(order)
    one_hot = operand(mask, 0)
    if not is_op(one_hot, "one_hot") or sorted(order) != [0, 1, 2] or order[0] != 2:
        raise NoMatch("moe.combine", "the mask is not one_hot(ids) with the expert axis moved first.", mask)
    token_output, slot_output = outputs
    # After mask[e], where()'s output i runs over axis order[i + 1] of one_hot(ids): 0 tokens, 1 slots.
    if (order[1 + token_output], order[1 + slot_output]) != (0, 1):
        raise NoMatch("moe.combine", "the token and slot indices are swapped relative to the mask's axes.", where)
    found.ids = operand(one_hot, 0)
    found.nodes.update({sliced, mask, one_hot, *[n for n in one_hot.all_input_nodes if n is not found.ids]})
    return expert, mask


def _check_loop(trace: Trace, expert: fx.Node, mask: fx.Node, found: LoopMatch) -> None:
    """The expert index is the element of a loop over ``nonzero(mask.sum(...) > 0)``, and every place
    the trace assumed something is that loop, a skip of the sentinel id, or the member lookup."""
    def flattened(node) -> bool:  # nonzero().view(-1): the loop runs over its elements
        return is_op(node, "view", "reshape") and tuple(operands(node)[1:]) in ((-1,), ((-1,),))

    element = expert
    while is_op(element, "getitem") and operand(element, 1) == 0 and not is_op(operand(element, 0), "nonzero"):
        if flattened(operand(element, 0)):
            break
        found.nodes.add(element)
        element = operand(element, 0)
    looped = operand(element, 0) if is_op(element, "getitem") else None
    flat = None
    if flattened(looped):
        flat, looped = looped, operand(looped, 0)
    if not is_op(looped, "nonzero"):
        raise NoMatch("moe.loop-form", "the expert index is not an element of nonzero() over the hit experts.", expert)
    nonzero = looped
    hit = operand(nonzero, 0)
    counts = operand(hit, 0)
    if not (
        is_op(hit, "greater", "gt", "ne")
        and operand(hit, 1) == 0
        and is_op(counts, "sum")
        and operand(counts, 0) is mask
    ):
        raise NoMatch("moe.loop-form", "the loop does not run over exactly the experts that received tokens.", nonzero)
    found.nodes.update({element, nonzero, hit, counts, *([flat] if flat is not None else [])})
    source = method_source(unwrapped_forward(trace.cls))
    for assumption in trace.assumptions:
        node = assumption.node
        if assumption.kind == "loop" and node in (nonzero, flat):
            continue
        if assumption.kind == "index" and node in (expert, element):
            continue  # the member lookup self.experts[e]: checked where the member is called
        if assumption.kind == "branch" and _skips_sentinel(node, expert, source, assumption.location, found):
            continue
        raise NoMatch(
            "moe.loop-form",
            f"the loop reads data-dependent values in a way transfuse does not follow ({assumption.describe()}).",
            node,
        )


def _skips_sentinel(node: fx.Node, expert: fx.Node, source, location, found: LoopMatch) -> bool:
    """``if e == n: continue`` (or ``>=``): skips one id; the instance check makes sure no expert has it."""
    if not (is_op(node, "eq", "ge") and operand(node, 0) is expert) or source is None or location is None:
        return False
    if location[0] != source.filename or not _continue_only_if(source, location[1]):
        return False
    found.skip_ids_from = source_of(operand(node, 1), "the skipped expert id", (int,))
    return True


def _continue_only_if(source, line: int) -> bool:
    for node in m.findall(source.node, m.If()):
        if source.line(node) == line:
            body = node.body.body
            simple = len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1
            return node.orelse is None and simple and isinstance(body[0].body[0], cst.Continue)
    return False


def _rows_source(rows: fx.Node, token_idx: fx.Node, found: LoopMatch) -> fx.Node:
    """``tokens[t]`` or ``tokens[None, t].reshape(-1, H)`` → tokens."""
    gathered = operand(rows, 0) if is_op(rows, "reshape", "view") else rows
    index = operand(gathered, 1) if is_op(gathered, "getitem") else None
    index = tuple(_untolist(i, found) for i in index) if isinstance(index, tuple) else _untolist(index, found)
    if index is token_idx or (
        isinstance(index, tuple) and len(index) == 2 and index[0] is None and index[1] is token_idx
    ):
        found.nodes.update({rows, gathered})
        return operand(gathered, 0)
    raise NoMatch("moe.combine", "the expert is not applied to the rows of the tokens routed to it.", rows)


def _check_accumulator(accumulator: fx.Node, tokens: fx.Node, found: LoopMatch) -> None:
    if is_op(accumulator, "zeros_like") and operand(accumulator, 0) is tokens:
        dtype = accumulator.kwargs.get("dtype")
        read = is_op(dtype, "getattr") and operand(dtype, 0) is tokens and operand(dtype, 1) == "dtype"
        tokens_dtype = dtype is None or read  # zeros_like(x, dtype=x.dtype)
        if set(accumulator.kwargs) <= {"dtype", "device"} and len(accumulator.args) == 1 and (
            tokens_dtype or dtype is torch.float32
        ):
            found.accumulate_fp32 = dtype is torch.float32
            found.nodes.add(accumulator)
            return
    if is_op(accumulator, "zeros") and getattr(value(accumulator), "shape", None) == getattr(
        value(tokens), "shape", None
    ):
        found.nodes.add(accumulator)
        return
    raise NoMatch("moe.combine", "the expert outputs are not added into zeros shaped like the tokens.", accumulator)


def _member(call: fx.Node, found: LoopMatch, index: str | None = None) -> fx.Node:
    """``self.experts[e](rows)``: the representative member ``<list>.0`` (of an unrolled loop, member
    ``index``) called on the rows alone; in an unrolled loop, also one module handed expert ``index``'s
    slices (``_sliced_call``)."""
    unrolled, index = index is not None, index or "0"
    owner, _, called = call.target.rpartition(".")
    expected = 1 if found.member_weight is None else 2  # the rows, and the routing weights when passed in
    passed = [a for a in (*call.args[expected:], *call.kwargs.values()) if isinstance(value(a), torch.Tensor)]
    if passed and (called != index or not owner):
        slices = [_expert_slice(a) for a in passed]
        if unrolled and _sliced_call(call, slices, index, found):
            return call.args[0]
        what = f"{len(passed)} more tensors"
        if all(slices):
            what += f", this expert's slices of {', '.join(_describe_slice(s) for s in slices)}"
        raise NoMatch(
            "moe.expert-arguments",
            f"each expert is {call.target} called on the rows and {what}; the experts matcher stacks the members "
            "of a module list or reads packed tensors indexed by the expert, and does not take weights handed to "
            "one shared module apart into the packed gate/up and down tensors the fused layer computes with.",
            call,
        )  # fmt: skip
    if called != index or not owner or len(call.args) != expected or call.kwargs:
        raise NoMatch(
            "moe.expert-form", f"the expert call {call.target} is not a member of a module list on the rows.", call
        )
    found.member_list = owner
    found.member_call = call
    found.member_calls = [call]
    found.nodes.add(call)
    return call.args[0]


@dataclass(frozen=True)
class _Slice:
    """Expert ``index``'s slice of the parameter at ``path`` (of ``shape``), seen as ``viewed`` ``[E, r, c]``
    (``index`` None: an index Python computed, not a literal of the unrolled loop)."""

    path: str
    index: int | None
    shape: tuple[int, ...]
    viewed: tuple[int, ...] | None


def _describe_slice(found: _Slice) -> str:
    viewed = found.viewed if found.viewed is not None and found.viewed != found.shape else None
    return f"{found.path} {found.shape}" + (f" as {viewed}" if viewed is not None else "")


def _sliced_call(call: fx.Node, slices: list, index: str, found: LoopMatch) -> bool:
    """``module(rows, P1.view(E, r, c)[i], ...)`` in iteration ``i`` of an unrolled loop, each ``P`` a 2-D
    parameter whose rows are the experts' blocks (``[E * r, c]`` viewed ``[E, r, c]``) or a 3-D one indexed
    by the expert: one module applying expert i by its slices. Records it; False for any other call."""
    if call.kwargs or len(call.args) != 1 + len(slices) or not all(slices):
        return False
    experts = set()
    for s in slices:
        whole = len(s.shape) == 3 and s.viewed in (None, s.shape)
        split = len(s.shape) == 2 and s.viewed is not None and len(s.viewed) == 3
        if s.index != int(index) or not (
            whole or split and s.viewed[0] * s.viewed[1] == s.shape[0] and s.viewed[2] == s.shape[1]
        ):
            return False
        experts.add(s.shape[0] if whole else s.viewed[0])
    found.sliced = tuple(s.path for s in slices)
    found.sliced_experts = experts
    found.member_call = call
    found.member_calls = [call]
    found.nodes.add(call)
    return True


def _expert_slice(node: Any) -> _Slice | None:
    """``P.view(E, r, c).chunk(E)[e].squeeze(0)`` (``split(1)`` too), ``P.view(E, r, c).unbind(0)[e]``,
    ``P.view(E, r, c)[e]``, ``P[e]``: expert e's slice of a parameter seen as ``[E, ...]``; else None."""
    walk = node
    pieces = is_op(walk, "squeeze") and operand(walk, 1, "dim") == 0  # a chunk of one expert, [1, r, c]
    if pieces:
        walk = operand(walk, 0)
    index = operand(walk, 1) if is_op(walk, "getitem") else None
    if not isinstance(value(index) if isinstance(index, fx.Node) else index, int):
        return None
    walk = operand(walk, 0)
    if pieces:
        split = walk
        if not (is_op(split, "chunk", "split") and operand(split, 2, "dim") in (0, None)):
            return None
        walk = operand(split, 0)
        shape, count = getattr(value(walk), "shape", None), value(operand(split, 1))
        if shape is None or count != (shape[0] if is_op(split, "chunk") else 1):  # pieces of one expert each
            return None
    elif is_op(walk, "unbind") and operand(walk, 1, "dim") in (0, None):
        walk = operand(walk, 0)
    viewed = None
    if is_op(walk, "view", "reshape"):
        viewed, walk = getattr(value(walk), "shape", None), operand(walk, 0)
    tensor = value(walk) if isinstance(walk, fx.Node) and walk.op == "get_attr" else None
    if not isinstance(tensor, torch.Tensor):
        return None
    if viewed is None and walk.meta.get("view_of") is not None:  # the view computed outside the graph
        path, shape = walk.meta["view_of"]
        return _Slice(path, _literal(index), shape, tuple(tensor.shape))
    if walk.meta.get("constant"):
        return None
    return _Slice(walk.target, _literal(index), tuple(tensor.shape), tuple(viewed) if viewed is not None else None)


def _literal(index: Any) -> int | None:
    """An index Python computed from attributes holds for the traced instance only: it is no literal."""
    return index if not isinstance(index, fx.Node) else None


# ---- packed experts --------------------------------------------------------------------


def _indexed_param(node, expert: fx.Node) -> str | None:
    """``param[e]`` → the parameter's path."""
    if is_op(node, "getitem") and operand(node, 1) is expert:
        base = operand(node, 0)
        if isinstance(base, fx.Node) and base.op == "get_attr" and isinstance(value(base), torch.Tensor):
            return base.target
    return None


def _quantized_projection(node: fx.Node, expert: fx.Node, nodes: set[fx.Node]) -> tuple[fx.Node, str, str] | None:
    """A scheme's projection leaf on this expert's quantized weight and scales (``ExpertProjection``:
    ``linear(h, W[e], S[e])`` with no static activation scale) → (h, W, S); None for other nodes."""
    from ...ops.quantized.fp8_experts import ExpertProjection

    if node.op != "call_function" or not isinstance(node.target, ExpertProjection):
        return None
    weight, scale = _indexed_param(operand(node, 1), expert), _indexed_param(operand(node, 2), expert)
    if weight is None or scale is None:
        what = f"the {node.target.scheme} projection does not read this expert's weight and scales."
        raise NoMatch("moe.expert-form", what, node)
    if len(node.args) > 3 or any(v is not None for v in node.kwargs.values()):
        raise NoMatch("moe.quantized", f"the {node.target.scheme} projection applies a static activation scale.", node)
    nodes.update({node, operand(node, 1), operand(node, 2)})
    return operand(node, 0), weight, scale


def _projection(node: fx.Node, expert: fx.Node, nodes: set[fx.Node]) -> tuple[fx.Node, str, str | None, bool]:
    """``linear(h, W[e][, b[e]])`` or ``h @ W[e] [+ b[e]]`` → (h, W, b, transposed)."""
    bias = None
    if is_op(node, "add"):
        a, b = operands(node)[:2]
        for term, other in ((b, a), (a, b)):
            if _indexed_param(term, expert) is not None and is_op(other, "matmul"):
                nodes.update({node, term})
                bias, node = _indexed_param(term, expert), other
                break
    if is_op(node, "matmul"):
        weight = _indexed_param(operand(node, 1), expert)
        if weight is not None:
            nodes.update({node, operand(node, 1)})
            return operand(node, 0), weight, bias, True
    if is_op(node, "linear") and bias is None:
        weight = _indexed_param(operand(node, 1, "weight"), expert)
        b = operand(node, 2, "bias")
        bias = _indexed_param(b, expert) if b is not None else None
        if weight is not None and (b is None or bias is not None):
            nodes.update({node, operand(node, 1, "weight"), *([b] if b is not None else [])})
            return operand(node, 0), weight, bias, False
    raise NoMatch("moe.expert-form", f"{op_name(node) or node.op} is not a projection by this expert's weights.", node)


def _packed(expert_out: fx.Node, expert: fx.Node, children: Lookup, found: LoopMatch) -> tuple[PackedExpert, fx.Node]:
    """The packed expert computing ``expert_out``, and the rows it reads."""
    quantized = _quantized_projection(expert_out, expert, found.nodes)
    if quantized is not None:
        h, w2, s2 = quantized
        b2, w2_t = None, False
    else:
        h, w2, b2, w2_t = _projection(expert_out, expert, found.nodes)
    gate, up, activation, alpha, limit = gated(h, children, found.nodes)
    projection, (interleaved, gate_first) = split_halves(gate, up, found.nodes)
    if quantized is not None:
        second = _quantized_projection(projection, expert, found.nodes)
        if second is None:
            what = "the down projection is quantized and the gate/up projection is not."
            raise NoMatch("moe.quantized", what, projection)
        rows, w13, s13 = second
        spec = ExpertsSpec(activation, interleaved, gate_first)
        return PackedExpert(w13, w2, spec, None, None, alpha, limit, s13, s2), rows
    if found.weights_cast:
        raise NoMatch(
            "moe.combine", "each routing weight is cast to its expert output's dtype before the product, which "
            "moe_experts does not do (it multiplies in the wider dtype).", expert_out,
        )  # fmt: skip
    rows, w13, b13, w13_t = _projection(projection, expert, found.nodes)
    spec = ExpertsSpec(activation, interleaved, gate_first, w13_t, w2_t)
    return PackedExpert(w13, w2, spec, b13, b2, alpha, limit), rows


def split_halves(gate: fx.Node, up: fx.Node, nodes: set[fx.Node]) -> tuple[fx.Node, tuple[bool, bool]]:
    """Gate and up as ``chunk(2, -1)`` halves or ``[..., ::2]``/``[..., 1::2]`` → (projection, (interleaved, gate first))."""
    parts = {}
    for role, node in (("gate", gate), ("up", up)):
        if not is_op(node, "getitem"):
            raise NoMatch("moe.expert-form", f"the {role} is not a part of the gate/up projection.", node)
        source, index = operand(node, 0), operand(node, 1)
        if is_op(source, "chunk") and operand(source, 1, "chunks") == 2 and operand(source, 2, "dim") == -1:
            parts[role] = ("halves", index, operand(source, 0))
            nodes.add(source)
        elif isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice):
            s = index[1]
            if s.step == 2 and s.stop is None and s.start in (None, 0, 1):
                parts[role] = ("interleaved", s.start or 0, source)
        nodes.add(node)
        if role not in parts:
            raise NoMatch(
                "moe.expert-form", f"the {role} is not a half or the alternate features of one projection.", node
            )
    (g_kind, g_at, g_src), (u_kind, u_at, u_src) = parts["gate"], parts["up"]
    if g_kind != u_kind or g_src is not u_src or {g_at, u_at} != {0, 1}:
        raise NoMatch("moe.expert-form", "the gate and up are not the two parts of one projection.", gate)
    return g_src, (g_kind == "interleaved", g_at == 0)


def gated(h: fx.Node, children: Lookup, nodes: set[fx.Node]):
    """``act(gate) * up``, the clamped SwiGLU, or a child computing the softcapped SwiGLU of (gate, up)
    → (gate, up, activation, alpha, limit)."""
    softcapped = _softcapped_swiglu(h, children, nodes)
    if softcapped is not None:
        return softcapped
    if not is_op(h, "mul"):
        raise NoMatch("moe.expert-form", "the expert's hidden value is not a gated product act(gate) * up.", h)
    nodes.add(h)
    clamped = _clamped_swiglu(h, nodes)
    if clamped is not None:
        return clamped
    for act, up in (operands(h)[:2], operands(h)[1::-1]):
        found = activation_of(act, children)
        if found is not None:
            name, gate = found
            nodes.add(act)
            clamped = _clamped_halves(gate, up, nodes)
            if clamped is not None:
                gate, up, limit = clamped
                return gate, up, f"clamped_{name}", None, limit
            return gate, up, name, None, None
    raise NoMatch("moe.expert-form", "neither factor of the gated product is a known activation of the gate.", h)


def _clamped_halves(gate: fx.Node, up: fx.Node, nodes: set[fx.Node]):
    """``act(clamp(gate, max=L)) * clamp(up, -L, L)`` → (gate, up, L's source); None for other forms."""
    if not (is_op(gate, "clamp") and is_op(up, "clamp")):
        return None
    limit = operand(gate, 2, "max")
    if operand(gate, 1, "min") is not None or limit is None or operand(up, 2, "max") is not limit:
        return None
    low = operand(up, 1, "min")
    if not (is_op(low, "neg") and operand(low, 0) is limit):
        return None
    nodes.update({gate, up, low})
    return operand(gate, 0), operand(up, 0), source_of(limit, "the GLU's clamp limit", (float, int))


def _clamped_swiglu(h: fx.Node, nodes: set[fx.Node]):
    """``(clamp(up, -L, L) + 1) * (g * sigmoid(g * alpha))`` with ``g = clamp(gate, max=L)``."""
    plus_one, glu = operands(h)[:2]
    if not is_op(plus_one, "add"):
        plus_one, glu = glu, plus_one
    if not (is_op(plus_one, "add") and operand(plus_one, 1) == 1 and is_op(glu, "mul")):
        return None
    up_clamp = operand(plus_one, 0)
    g, sig = operands(glu)[:2]
    if not is_op(sig, "sigmoid"):
        g, sig = sig, g
    scaled = operand(sig, 0) if is_op(sig, "sigmoid") else None
    if not (is_op(scaled, "mul") and operand(scaled, 0) is g and is_op(g, "clamp") and is_op(up_clamp, "clamp")):
        return None
    limit = operand(g, 2, "max")
    if operand(g, 1, "min") is not None or operand(up_clamp, 2, "max") is not limit:
        return None
    low = operand(up_clamp, 1, "min")
    if not (is_op(low, "neg") and operand(low, 0) is limit):
        return None
    nodes.update({plus_one, glu, sig, scaled, g, up_clamp, low})
    alpha = source_of(operand(scaled, 1), "the SwiGLU alpha", (float, int))
    return (
        operand(g, 0),
        operand(up_clamp, 0),
        "clamped_swiglu",
        alpha,
        source_of(limit, "the SwiGLU limit", (float, int)),
    )


def _softcapped_swiglu(call: fx.Node, children: Lookup, nodes: set[fx.Node]):
    """``act(gate, up)``, a child computing ``(cap_a(g) * sigmoid(g) * cap_l(u)).to(gate.dtype)`` with
    ``g, u = gate.float(), up.float()`` and ``cap_c(v) = tanh(v / c) * c`` (children, c an attribute)
    → (gate, up, "softcapped_swiglu", a, l); None for any other call."""
    if call.op != "call_module" or len(call.args) != 2 or call.kwargs:
        return None
    trace = children(call.target)
    if trace is None or trace.partial or trace.output is None:
        return None
    gate, up = (p for p in trace.placeholders()) if len(trace.placeholders()) == 2 else (None, None)
    product, casts = peel_casts(trace.output.args[0])
    if gate is None or len(casts) != 1 or casts[0].like is not gate or not is_op(product, "mul"):
        return None
    first, third = operands(product)[:2]
    if not is_op(first, "mul"):
        first, third = third, first
    if not is_op(first, "mul"):
        return None
    a, b = operands(first)[:2]
    capped, sigmoid = (a, b) if is_op(b, "sigmoid") else (b, a)
    g = operand(sigmoid, 0) if is_op(sigmoid, "sigmoid") else None
    gate_cap = _softcap(capped, g, gate, children, call.target)
    up_cap = _softcap(third, operand(third, 0) if isinstance(third, fx.Node) else None, up, children, call.target)
    if gate_cap is None or up_cap is None:
        return None
    nodes.add(call)
    return call.args[0], call.args[1], "softcapped_swiglu", gate_cap, up_cap


def _softcap(call: fx.Node, inner: fx.Node | None, placeholder: fx.Node, children: Lookup, owner: str) -> Source | None:
    """``cap(inner)`` with ``inner = placeholder.float()`` and cap a child computing ``tanh(v / c) * c``:
    the source of c (a path below the experts), else None."""
    if not (isinstance(call, fx.Node) and call.op == "call_module" and call.args == (inner,) and not call.kwargs):
        return None
    base, casts = peel_casts(inner)
    if base is not placeholder or len(casts) != 1 or casts[0].dtype != torch.float32:
        return None
    trace = children(f"{owner}.{call.target}")
    if trace is None or trace.partial or trace.output is None or len(trace.placeholders()) != 1:
        return None
    out = trace.output.args[0]
    tanh = operand(out, 0) if is_op(out, "mul") else None
    cap = operand(out, 1) if tanh is not None else None
    divided = operand(tanh, 0) if is_op(tanh, "tanh") else None
    if not (is_op(divided, "truediv", "div") and operand(divided, 0) is trace.placeholders()[0]):
        return None
    if operand(divided, 1) is not cap or not isinstance(cap, fx.Node) or cap.meta.get("self_attr") is None:
        return None
    if len([n for n in trace.graph.nodes if n.op in ("call_function", "call_method", "call_module")]) != 3:
        return None
    return Source(path=f"{owner}.{call.target}.{source_of(cap, 'the softcap', (float, int)).path}")


_GELU = {"none": "gelu", "tanh": "gelu_tanh"}


def activation_of(node: fx.Node, children: Lookup) -> tuple[str, fx.Node] | None:
    """(activation name, its input) when ``node`` applies silu, gelu or relu to one input."""
    if node.op == "call_module":
        child = children(node.target)
        if child is None or child.partial or len(node.args) != 1 or node.kwargs:
            return None
        inner = _elementwise(child)
        return (inner, node.args[0]) if inner is not None else None
    name = _function_activation(node)
    return (name, operand(node, 0)) if name is not None else None


def _function_activation(node: fx.Node) -> str | None:
    if is_op(node, "silu"):
        return "silu"
    if is_op(node, "relu"):
        return "relu"
    if is_op(node, "gelu"):
        return _GELU.get(operand(node, 1, "approximate", "none"))
    if is_op(node, "mul"):  # x * sigmoid(x)
        a, b = operands(node)[:2]
        for x, sig in ((a, b), (b, a)):
            if is_op(sig, "sigmoid") and operand(sig, 0) is x:
                return "silu"
    return None


def _elementwise(trace: Trace) -> str | None:
    """The activation an activation module's graph applies to its single input."""
    inputs = [p for p in trace.placeholders() if p.users]
    result = trace.output.args[0] if trace.output is not None else None
    if len(inputs) != 1 or not isinstance(result, fx.Node):
        return None
    name = _function_activation(result)
    return name if name is not None and operand(result, 0) is inputs[0] else None


# ---- module-list members ---------------------------------------------------------------


def _linear_child(trace: Trace | None) -> bool:
    """A child whose forward is ``F.linear(x, self.weight, self.bias)``."""
    if trace is None or trace.partial or trace.output is None:
        return False
    result = trace.output.args[0]
    return (
        is_op(result, "linear")
        and operand(result, 0) in trace.placeholders()
        and len([n for n in trace.graph.nodes if n.op in ("call_function", "call_method", "call_module")]) == 1
    )


def match_glu_member(trace: Trace, children: Lookup, weight: str | None = None) -> GLUMember:
    """``down(act(gate(x)) * up(x))`` in a ModuleList member's own graph (children by dataflow); with
    ``weight``, the member returns ``weight * down(...)``, that parameter read nowhere else."""
    if trace.partial or trace.output is None:
        raise NoMatch("moe.expert-form", f"the expert module's forward could not be traced ({trace.describe_stop()}).")
    if trace.shape_guards:
        raise NoMatch(
            "moe.control-flow",
            f"the expert module's control flow depends on its input's shape ({trace.shape_guards[0].describe()}).",
        )
    out = trace.output.args[0]
    own = 5
    if weight is not None:
        weighted = weighted_output(trace)
        if weighted is None or weighted[0].target != weight:
            raise NoMatch(
                "moe.combine", f"the expert module does not multiply its output by {weight} as its last operation.", out
            )  # fmt: skip
        out, own = weighted[1], own + 1
    x = [p for p in trace.placeholders() if p.users and p.target != weight]
    if len(x) != 1 or not (isinstance(out, fx.Node) and out.op == "call_module" and is_op(operand(out, 0), "mul")):
        raise NoMatch("moe.expert-form", "the expert module does not compute down(act(gate(x)) * up(x)).", out)
    for act, up in (operands(operand(out, 0))[:2], operands(operand(out, 0))[1::-1]):
        found = activation_of(act, children)
        if found is None:
            continue
        name, gate = found
        calls = (gate, up, out)
        if all(c.op == "call_module" and _linear_child(children(c.target)) for c in calls) and all(
            operand(c, 0) is x[0] for c in (gate, up)
        ):
            extra = [n for n in trace.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
            if len(extra) != own:
                raise NoMatch("moe.expert-form", "the expert module computes more than a gated MLP.", out)
            return GLUMember(gate.target, up.target, out.target, name)
    raise NoMatch("moe.expert-form", "the expert module is not a gated MLP of three linear layers.", out)


# ---- one module handed each expert's slices ------------------------------------------------


def _sliced_projection(node: Any, weights: dict, nodes: set) -> tuple[Any, str, bool] | None:
    """``F.linear(h, w)``, ``h @ w.t()`` (``.T``, ``transpose(0, 1)``) or ``h @ w`` by one of the slices
    ``weights`` (placeholder → parameter) → (h, parameter, applied as linear); None for anything else."""
    if is_op(node, "linear") and operand(node, 2, "bias") is None and operand(node, 1, "weight") in weights:
        nodes.add(node)
        return operand(node, 0), weights[operand(node, 1, "weight")], True
    if not is_op(node, "matmul"):
        return None
    h, w = operands(node)[:2]
    if w in weights:
        nodes.add(node)
        return h, weights[w], False
    flipped = is_op(w, "t") or is_op(w, "transpose") and {operand(w, 1), operand(w, 2)} in ({0, 1}, {-1, -2})
    if flipped and operand(w, 0) in weights:
        nodes.update({node, w})
        return h, weights[operand(w, 0)], True
    return None


def match_sliced_member(trace: Trace, children: Lookup, params: tuple[str, ...]) -> SlicedMember:
    """``down(act(gate(x)) * up(x))`` in the graph of one module handed the rows and expert e's slices of
    ``params`` (in call order), each projection by one slice, and nothing else computed."""
    if trace.partial or trace.output is None or trace.shape_guards:
        raise NoMatch("moe.expert-form", f"the expert module's forward was not traced for every shape ({trace.describe_stop()}).")
    inputs = trace.placeholders()
    if len(inputs) != 1 + len(params):
        raise NoMatch("moe.expert-form", "the expert module is not called on its rows and the slices alone.")
    x, weights = inputs[0], dict(zip(inputs[1:], params))
    nodes: set = set()
    out = trace.output.args[0]
    down = _sliced_projection(out, weights, nodes)
    h = down[0] if down is not None else None
    if down is None or not is_op(h, "mul"):
        raise NoMatch("moe.expert-form", "the expert module does not end in a projection of a gated product.", out)
    nodes.add(h)
    for act, up in (operands(h)[:2], operands(h)[1::-1]):
        found = activation_of(act, children) if isinstance(act, fx.Node) else None
        gate = _sliced_projection(found[1], weights, nodes) if found is not None else None
        up = _sliced_projection(up, weights, nodes) if gate is not None else None
        if gate is None or up is None or gate[0] is not x or up[0] is not x or gate[2] != up[2]:
            continue
        nodes.add(act)
        computed = [n for n in trace.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        if any(n not in nodes for n in computed) or len({gate[1], up[1], down[1]}) != 3:
            raise NoMatch("moe.expert-form", "the expert module computes more than a gated MLP of its slices.", out)
        return SlicedMember((gate[1], gate[2]), (up[1], up[2]), (down[1], down[2]), found[0])
    raise NoMatch("moe.expert-form", "the expert module is not a gated MLP of the slices it is handed.", out)
