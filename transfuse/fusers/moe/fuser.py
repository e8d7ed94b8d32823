"""The mixture-of-experts fuser: the class-level match and the per-instance fusion."""

from __future__ import annotations

import ast
import functools
import inspect
import math
from dataclasses import dataclass, replace
from typing import Any

import libcst as cst
import libcst.matchers as m
import torch
import torch.fx as fx
from torch import nn

from ...ops import layer
from ...ops.hooks import hooked
from ...ops.moe import ExpertsSpec
from ...ops.quantized.fp8_experts import BLOCK_ATTRIBUTE, check_fp8_experts
from ...ops.moe_layer import (
    HIDDEN, IDS, LOGITS, WEIGHTS, ExpertNumbers, ExpertsPlan, MoEPlan, RouterPlan, RoutingNumbers, SharedPlan,
    StackedExperts, expert_sharding, router_output,
)  # fmt: skip
from ...ops.sharding import is_sharded
from ...rewriter.analysis import ClassAnalysis
from ...rewriter.fusion import Fused, Fuser, Refusal
from ...rewriter.graph import NoMatch, calls_fused_op, is_op, operand, operands, peel_casts, value
from ...rewriter.inline import call_inputs, inline_calls
from ...rewriter.source import EditContext, forward_replaced, method_source, rewrite_of
from ...rewriter.syntax import comment_line, dataclass_literal
from ...rewriter.tracer import Trace, unwrapped_forward
from .dense import match_dense_experts, match_expert_sum, match_scaled_rows
from .experts import GLUMember, LoopMatch, SlicedMember, match_glu_member, match_loop, match_sliced_member
from .routing import RoutingMatch, Source, match_masked_scores, match_routing, peel_reshapes, source_of
from .sorted_rows import match_sorted_experts, match_sorted_rows, split_linear_experts

__all__ = ["MoEEmission", "MoEFuser", "MoEMatch"]


@dataclass(frozen=True)
class MoEMatch:
    """What was found in the block class: the plan, and where each instance's numbers are read."""

    plan: MoEPlan
    experts_child: str  # the child holding the experts: packed tensors, or the list of per-expert modules
    member: GLUMember | SlicedMember | None  # per-expert modules or slices: their roles (stacked into a packed layout)
    routing: RoutingMatch | None  # None: the router is called as is
    alpha: Source | None
    limit: Source | None
    skip_ids_from: Source | None  # an expert id the loop skips, when it skips one
    training_branches: tuple[tuple[str, type], ...]  # (child path or "", class) whose forward reads self.training
    input: str = "hidden_states"  # the forward's parameter the block reads
    routed_scale: Source | None = None  # the number the routed output is multiplied by, when it is
    unrolled: int | None = None  # the experts loop ran over every expert index, unrolled: how many there were
    more_experts: tuple[str, ...] = ()  # further children holding expert tensors (w2 held apart from w13)
    experts_traced: int | None = None  # how many experts the traced experts' forward applied


@dataclass(frozen=True)
class MoEEmission:
    """What an emitted forward needs of a fused block: no graph nodes, so it copies and pickles.

    plan: the fused layer's plan (a class attribute of the emitted block).
    numbers: (``moe_block`` keyword, where the block's attribute is) for each number read per instance.
    """

    plan: MoEPlan
    input: str
    numbers: tuple[tuple[str, Source], ...]


class MoEFuser(Fuser[MoEMatch]):
    kind = "moe"

    def wants(self, module: nn.Module) -> bool:
        """A child holding 3-D parameters (packed experts) or a list of small modules (per-expert MLPs),
        or a child whose forward adds rows into a tensor (``index_add``) beside a ``topk`` in the block
        or another child (experts held in another shape, found by the match; a module holding a whole
        mixture, routing and experts in one child, is not one)."""
        adding = [c for c in module.children() if _calls(type(c), "index_add_", "index_add")]
        if adding and any(_calls(type(c), "topk") for c in (module, *module.children()) if c not in adding):
            return True
        routers = {c.out_features for c in module.children() if isinstance(c, nn.Linear)}
        for child in module.children():
            # Packed experts are [E, in, out]; a convolution's weight has 3 or more dimensions too.
            if _packed(child):
                return True
            # Or held by the child's children (aria's grouped GEMMs) beside a router of as many outputs.
            if any(_packed(c) & routers for c in child.children()):
                return True
            if isinstance(child, nn.ModuleList) and len(child) >= 2 and _small_members(child):
                return True
        return False

    def claimed_children(self, found: MoEMatch) -> tuple[str, ...]:
        """The router and the experts become the fused layer's; shared experts stay open to other fusions."""
        return (found.plan.router.module, found.experts_child, *found.more_experts)

    def rebuilt_children(self, found: MoEMatch) -> tuple[str, ...]:
        """The block's place; per-expert modules are also stacked into new tensors."""
        return ("", found.experts_child) if found.member is not None else ("",)

    def match(self, analysis: ClassAnalysis) -> MoEMatch | Refusal | None:
        raising = _forward_only_raises(analysis)
        if raising is not None:
            return raising
        try:
            loop, call = _find_experts(analysis)
            return _match_block(analysis, loop, call)
        except _NotMoE:
            return _dense_experts(analysis) or _members_without_loop(analysis) or _packed_experts_unfollowed(analysis)
        except NoMatch as refusal:
            if refusal.tag == "moe.sorted-rows":
                try:
                    return _match_sorted_block(analysis)
                except NoMatch as sorted_refusal:
                    refusal = sorted_refusal
            return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node))

    def validate(self, module: nn.Module, found: MoEMatch) -> Refusal | None:
        try:
            _validate(module, found)
        except NoMatch as refusal:
            return Refusal(refusal.tag, refusal.reason)
        if found.member is not None:
            hooked_members = [n for n, m in module.get_submodule(found.experts_child).named_modules() if hooked(m)]
            if hooked_members:
                return Refusal(
                    "moe.hooked",
                    f"{found.experts_child}.{hooked_members[0]} has hooks; stacking the per-expert modules into one "
                    "tensor would leave them uncalled, so the block is left as it is.",
                )
        return None

    def fuse(self, module: nn.Module, found: MoEMatch) -> Fused:
        children = dict(module.named_children())
        if isinstance(found.member, SlicedMember):
            children[found.experts_child] = _stack_sliced(children[found.experts_child], found.member, found.unrolled)
        elif found.member is not None:
            children[found.experts_child] = _stack(children[found.experts_child], found.member)
        # The layer keeps the block's children, not its own attributes: it checks the children's (not those of
        # stacked experts, which replace their module: ``_validate`` checked those on the instance).
        children_assumed = tuple(a for a in found.plan.assumes if "." in a[0] and not _stacked_attribute(found, a[0]))
        plan = replace(found.plan, train_error=_train_error(module, found), assumes=children_assumed)
        experts = ExpertNumbers(
            alpha=_float(found.alpha, module, 1.0),
            limit=_float(found.limit, module, math.inf),
            routed_scale=_float(found.routed_scale, module, 1.0),
        )
        # Tensors the block holds and hands to its router stay the layer's, under their names.
        tensors = dict(_own_tensors(module))
        persistent = {n: n not in module._non_persistent_buffers_set for n in tensors}
        routing = _routing_numbers(module, found.routing)
        fused = layer("MoE")(children, plan, routing, experts, tensors, persistent, kernels=_experts_kernels())
        fused.shared_batch = shared_batch(module)
        if found.member is None:  # stacked per-expert modules are gone: the block could not run as written
            fused.keep_block(module)
        return Fused(replaced=("",), into=type(fused).__name__, replacement=fused)

    def emission(self, found: MoEMatch, fused: Fused) -> MoEEmission | None:
        """None for per-expert modules (an emitted file would have to stack them on every call) and
        for plans that assume values no literal writes."""
        plan = getattr(fused.replacement, "plan", None)
        if found.member is not None or not isinstance(plan, MoEPlan) or plan.experts.w13_scale is not None:
            return None  # (an emitted file's runtime has no FP8 experts op: a quantized block stays as written)
        plan = replace(plan, assumes=found.plan.assumes)  # the emitted block has its own attributes too
        if any(not isinstance(v, (bool, int, float, str, type(None))) for _, v in plan.assumes):
            return None
        numbers = []
        r = found.routing
        if r is not None:
            numbers += [("top_k", r.top_k), ("n_group", r.n_group), ("topk_group", r.topk_group)]
            numbers += [(k, v) for k, v in (("renorm_eps", r.renorm_eps), ("renorm_min", r.renorm_min), ("scale", r.scale))]
        numbers += [("alpha", found.alpha), ("limit", found.limit), ("routed_scale", found.routed_scale)]
        defaults = {"n_group": 1, "topk_group": 1}
        kept = tuple((k, v) for k, v in numbers if v is not None and not (v.path is None and v.literal == defaults.get(k)))
        return MoEEmission(plan, found.input, kept)

    def emitted_forward(self, found: MoEEmission | None, context: EditContext) -> cst.FunctionDef | None:
        """``if moe_block_applies(...): return moe_block(self, hidden_states, self._transfuse_moe,
        top_k=self.gate.top_k, ...)`` before the forward as written (which sharded experts run),
        the plan a class attribute (``_transfuse_moe = MoEPlan(...)``), the docstring kept."""
        if found is None:
            return None
        op = context.require("transfuse.ops", "moe_block")
        plan = dataclass_literal(found.plan, lambda cls: context.require(cls.__module__, cls.__name__))
        attribute = cst.parse_statement(f"_transfuse_moe = {plan}").with_changes(
            leading_lines=[
                cst.EmptyLine(indent=False),
                comment_line("transfuse: what the fused mixture-of-experts ops compute here (moe_block)"),
            ]
        )
        context.class_statements.append(attribute)
        applies = context.require("transfuse.ops", "moe_block_applies")
        numbers = "".join(f", {k}={_expression(v)}" for k, v in found.numbers)
        fused = cst.parse_statement(
            f"if {applies}(self, self._transfuse_moe):\n"
            f"    return {op}(self, {found.input}, self._transfuse_moe{numbers})\n"
        )
        fused = fused.with_changes(
            leading_lines=[
                comment_line(f"transfuse: fused routing and experts ({found.plan.describe()}); sharded experts"),
                comment_line("(tensor or expert parallelism) run the forward as written below"),
            ]
        )
        node = context.source.node
        body = list(node.body.body)
        docstring = body[:1] if body and m.matches(body[0], m.SimpleStatementLine([m.Expr(m.SimpleString())])) else []
        rest = body[len(docstring) :]
        return node.with_changes(body=node.body.with_changes(body=[*docstring, fused, *rest]))


def _forward_only_raises(analysis: ClassAnalysis) -> Refusal | None:
    """A module whose forward does nothing but raise holds experts the model uses through other
    methods, each computing a part of the mixture around its caller's code (jetmoe's attention
    experts: query projections in one method, output projections and the weighted sum in another,
    attention between); no fused layer can take the place of a forward that is never run."""
    source = method_source(unwrapped_forward(analysis.cls))
    if source is None:
        return None
    body = list(source.node.body.body)
    if body and m.matches(body[0], m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())])):
        body = body[1:]
    if not (len(body) == 1 and m.matches(body[0], m.SimpleStatementLine([m.Raise()]))):
        return None
    raised = cst.Module(body=[]).code_for_node(body[0]).strip()
    children = set(analysis.children)
    methods = sorted(
        name for name, fn in vars(analysis.cls).items()
        if inspect.isfunction(fn) and not name.startswith("__") and name != "forward"
        and not children.isdisjoint(fn.__code__.co_names)
    )  # fmt: skip
    used = f"the model uses its experts through {', '.join(f'{n}()' for n in methods)}" if methods else (
        "the model uses its experts through other code"
    )  # fmt: skip
    return Refusal(
        "moe.forward-raises",
        f"the block's forward only raises (`{raised}`): {used}, each computing a part of the mixture for its "
        "caller, which no fused layer taking the place of the forward computes.",
        analysis.where(),
    )


def _packed(module: nn.Module) -> set[int]:
    """The leading sizes of the 3-D parameters ``module`` holds itself (none for a convolution)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return set()
    return {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}


class _NotMoE(Exception):
    """The module has no experts loop: not a mixture of experts, unless a child holding packed
    per-expert tensors computes them on every token (``_dense_experts``)."""


def _dense_experts(analysis: ClassAnalysis) -> MoEMatch | Refusal | None:
    """A block with a router (a linear child with one output per expert) and a child holding two or
    more 3-D tensors with that leading size (packed experts), but no experts loop: the experts run
    on every token (llama4's batched matmuls over all of them). Fused when the scores that scale
    their rows are zero at every expert not chosen (``dense``); else refused with the reason."""
    if calls_fused_op(analysis.trace.graph):
        return None  # an emitted block, which calls the fused op itself
    holder = _packed_holder(analysis)
    if holder is None:
        return None
    name, shapes = holder
    calls = [n for n in analysis.trace.graph.nodes if n.op == "call_module" and n.target == name]
    try:
        if len(calls) != 1:
            raise NoMatch(
                "moe.dense-experts", f"{name} holds per-expert tensors ({shapes}) and is called {len(calls)} times, "
                "not once on the routed rows.",
            )  # fmt: skip
        return _match_dense_block(analysis, calls[0])
    except NoMatch as refusal:
        return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node))


def _members_without_loop(analysis: ClassAnalysis) -> Refusal | None:
    """A block that calls two or more members of a list of per-expert modules but adds their outputs
    by no ``index_add``: a mixture of experts in a form the experts matcher does not follow, refused
    with what it does instead (never passed over: each member's MLP would be fused on its own)."""
    graph = analysis.trace.graph
    lists: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        owner, _, index = node.target.rpartition(".") if node.op == "call_module" else ("", "", "")
        if index.isdigit() and isinstance(analysis.children.get(owner), type) and issubclass(
            analysis.children[owner], nn.ModuleList
        ):
            lists.setdefault(owner, []).append(node)
    calls = max(lists.values(), key=len, default=[])
    if len(calls) < 2:
        return None
    # A list of layers called in turn (norms, attentions) is no mixture: only a block that chooses
    # among its members (a top-k, an arg-max or a sort of scores) is.
    if not any(is_op(n, name) for n in graph.nodes for name in ("topk", "argmax", "sort", "argsort")):
        return None
    owner = calls[0].target.rpartition(".")[0]
    if any(is_op(n, "repeat_interleave") for n in graph.nodes):
        return Refusal(
            "moe.repeated-tokens",
            f"the block repeats each token once per chosen expert (repeat_interleave), writes {owner}'s {len(calls)} "
            "outputs into the copies by mask and sums the weighted copies; the experts matcher follows a loop that "
            "adds weight · expert(rows) into zeros with index_add.",
            analysis.where(calls[0]),
        )
    return Refusal(
        "moe.loop-form",
        f"the block calls {len(calls)} members of {owner} but adds their outputs by no index_add; the experts "
        "matcher follows a loop that adds weight · expert(rows) into zeros with index_add.",
        analysis.where(calls[0]),
    )


def _inlined_node(inlined, node: Any) -> Any:
    """Where a parent's node went in the inlined graph; a node of the inlined graph is itself."""
    return inlined.env.get(node, node) if isinstance(node, fx.Node) else node


def _match_sorted_block(analysis: ClassAnalysis) -> MoEMatch:
    """Every (token, expert) row, sorted by expert, computed by two children holding ``[E, out, in]``
    weights, weighted and added back by one ``index_add`` (``sorted_rows``): the routed mixture."""
    trace = analysis.trace
    x_input = _block_input(trace)
    children = lambda path: _trace_of(analysis.child(path))  # noqa: E731
    found = match_sorted_experts(trace.graph, children)
    first, second = found.first, found.second
    w13, experts = split_linear_experts(children(first.target), "gate/up")
    w2, experts_2 = split_linear_experts(children(second.target), "down")
    if experts != experts_2:
        raise NoMatch("moe.sorted-rows", f"the two projections hold {experts} and {experts_2} experts.", second)
    routers = _router_calls((found.token, found.gates, found.sizes), {first, second})
    router_names = {n.target for n in routers}
    inlined = inline_calls(
        trace, lambda path: _trace_of(analysis.child(path)) if path.split(".")[0] in router_names else None
    )
    x = inlined[x_input]
    token, gates, sizes = (_inlined_node(inlined, n) for n in (found.token, found.gates, found.sizes))
    rows = match_sorted_rows(token, gates, sizes, experts)
    if not _is_tokens(_inlined_node(inlined, found.rows), x):
        raise NoMatch("moe.tokens", "the experts do not read the block's input flattened to [tokens, hidden].", first)
    router, routing = _match_router(analysis, inlined, routers, rows.ids, rows.weights, x)
    if routing is None:
        raise NoMatch("moe.sorted-rows", "the routing of the sorted rows is not one the fused layer computes.", first)
    if isinstance(rows.k, fx.Node) and source_of(rows.k, "k", (int,)) != routing.top_k:
        raise NoMatch("moe.sorted-rows", "the sorted positions are divided by another number than the top-k.", token)
    routed = _inlined_node(inlined, found.add)
    roles = {id(routed): HIDDEN, id(routing.logits): LOGITS}
    items = [u for u in routers[0].users if is_op(u, "getitem") and isinstance(operand(u, 1), int)]
    output = _match_output(inlined, x, routed, roles, {id(inlined[u]): operand(u, 1) for u in items})
    activation = {n for n in found.nodes if n.op == "call_module"}  # an activation child of the GLU
    _account(trace, {first, second, *routers, *activation}, output.shared, output.post)
    block_nodes = {_inlined_node(inlined, n) for n in found.nodes} | rows.nodes
    _check_in_place(inlined.graph, routing.nodes | output.nodes | block_nodes, "block")
    experts_plan = ExpertsPlan(f"{first.target}.{w13}", f"{second.target}.{w2}", found.spec)
    plan, branches = _plan_and_branches(analysis, trace, router, experts_plan, output, sorted(router_names))
    return MoEMatch(
        plan, first.target, None, routing, None, None, None, branches, input=x_input.target,
        routed_scale=output.routed_scale, more_experts=(second.target,), experts_traced=experts,
    )  # fmt: skip


def _router_widths(analysis: ClassAnalysis) -> set[int]:
    """The output widths of the block's linear children (a router may return a tuple: llama4's)."""
    routers = set()
    for n in analysis.trace.graph.nodes:
        if n.op == "call_module" and issubclass(analysis.children.get(n.target, object), nn.Linear):
            out = value(n)
            routers |= {t.shape[-1] for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)}
    return routers


_CHOOSING = ("topk", "argmax", "sort", "argsort")


def _per_expert_tensors(analysis: ClassAnalysis, name: str, routers: set[int], deep: bool) -> tuple[str, list] | None:
    """(shapes, graphs read) where child ``name`` holds two or more 3-D tensors whose one leading size
    (two or more) a router's width counts: packed per-expert tensors. With ``deep``, those the
    modules it calls hold count too, a few levels down. None where it holds none."""
    graphs, tensors, pending = [], [], [name]
    while pending:
        path = pending.pop()
        child = analysis.child(path)
        if child is None or path.count(".") > 3:
            continue
        graphs.append(child.trace.graph)
        for n in child.trace.graph.nodes:
            if n.op == "get_attr" and "." not in n.target and isinstance(value(n), torch.Tensor) and value(n).dim() == 3:
                tensors.append(value(n))
            elif deep and n.op == "call_module":
                pending.append(f"{path}.{n.target}")
    experts = {t.shape[0] for t in tensors}
    if len(tensors) < 2 or len(experts) != 1 or not experts <= routers or min(experts) < 2:
        return None
    return ", ".join(str(tuple(t.shape)) for t in tensors), graphs


def _packed_experts_unfollowed(analysis: ClassAnalysis) -> Refusal | None:
    """A block that chooses among experts (a top-k, an arg-max or a sort, in its forward or under
    the child) whose per-expert tensors a child holds or the modules it calls hold (a few levels
    down), in a form neither the experts loop nor the dense form explains (aria's experts in older
    transformers: tokens sorted by expert, a grouped GEMM over the per-expert counts): refused with
    what it holds, never passed over."""
    if calls_fused_op(analysis.trace.graph):
        return None
    routers = _router_widths(analysis)
    for name in analysis.children:
        found = _per_expert_tensors(analysis, name, routers, deep=True)
        if found is None:
            continue
        shapes, graphs = found
        if not any(is_op(n, *_CHOOSING) for graph in (analysis.trace.graph, *graphs) for n in graph.nodes):
            continue
        calls = [n for n in analysis.trace.graph.nodes if n.op == "call_module" and n.target == name]
        return Refusal(
            "moe.unfollowed",
            f"{name} holds per-expert tensors ({shapes}) of as many experts as the router's width and the block "
            "chooses among them, in a form the experts matcher does not follow: no loop adds weight · expert(rows) "
            "into zeros with index_add, and the experts do not run on every token.",
            analysis.where(calls[0] if calls else None),
        )
    return None


def _packed_holder(analysis: ClassAnalysis) -> tuple[str, str] | None:
    """(name, shapes) of the child holding packed per-expert tensors that a router's width counts."""
    routers = _router_widths(analysis)
    for name in analysis.children:
        found = _per_expert_tensors(analysis, name, routers, deep=False)
        if found is not None:
            return name, found[0]
    return None


def _match_dense_block(analysis: ClassAnalysis, call: fx.Node) -> MoEMatch:
    """Experts run on every token's rows scaled by dense scores (``dense``), the scores zero at the
    experts not chosen: the routed mixture with its weights on the input."""
    trace = analysis.trace
    x_input = _block_input(trace)
    child = analysis.child(call.target)
    if child is None:
        raise NoMatch("moe.dense-experts", f"the experts {call.target!r} were not traced.", call)
    _complete(child.trace, "experts'", call)
    dense = match_dense_experts(child.trace, lambda path: _trace_of(analysis.child(f"{call.target}.{path}")))
    _check_in_place(child.trace.graph, dense.nodes, "experts")
    tokens, scores, row_nodes = match_scaled_rows(call, dense.experts)
    routed, sum_nodes = match_expert_sum(call, dense.experts, dense.hidden)
    routers = _router_calls((scores,), {call})
    router_names = {n.target for n in routers}
    inlined = inline_calls(
        trace, lambda path: _trace_of(analysis.child(path)) if path.split(".")[0] in router_names else None
    )
    x = inlined[x_input]
    if not _is_tokens(inlined[tokens], x):
        raise NoMatch("moe.tokens", "the experts do not read the block's input flattened to [tokens, hidden].", tokens)
    router, routing = _match_router(analysis, inlined, routers, None, None, x, scores=scores)
    roles = {id(inlined[routed]): HIDDEN, id(routing.logits): LOGITS}
    items = [u for u in routers[0].users if is_op(u, "getitem") and isinstance(operand(u, 1), int)]
    output = _match_output(inlined, x, inlined[routed], roles, {id(inlined[u]): operand(u, 1) for u in items})
    _account(trace, {call} | set(routers), output.shared, output.post)
    block_nodes = {inlined[n] for n in row_nodes | sum_nodes if n in inlined.env}
    _check_in_place(inlined.graph, routing.nodes | output.nodes | block_nodes, "block")
    prefix, p = f"{call.target}.", dense.packed
    experts = ExpertsPlan(prefix + p.w13, prefix + p.w2, p.spec, weights_on_input=True)
    plan, branches = _plan_and_branches(analysis, trace, router, experts, output, sorted(router_names) + [call.target])
    return MoEMatch(
        plan, call.target, None, routing, _prefixed(p.alpha, prefix), _prefixed(p.limit, prefix), None, branches,
        input=x_input.target, routed_scale=output.routed_scale,
    )  # fmt: skip


def _plan_and_branches(analysis: ClassAnalysis, trace, router, experts: ExpertsPlan, output, assumed: list[str]):
    """The block's plan from its router, experts and output, and the training branches the match
    decides (the block's own, and the router's where it reads ``training``)."""
    plan = MoEPlan(
        router, experts, output.shared, output.roles, output.returns_tuple, output.flat,
        assumes=_assumptions(analysis, assumed),
        combine_fp32=output.combine_fp32, routed_scaled=output.routed_scale is not None,
        post=output.post, post_flat=output.post_flat, bias=output.bias,
    )  # fmt: skip
    branches = (("", analysis.cls),) if "training" in trace.specialisation else ()
    if not router.train_as_module and _reads_training(analysis, router.module):
        branches += ((router.module, analysis.child(router.module).cls),)
    return plan, branches


@functools.lru_cache(maxsize=4096)
def _calls(cls: type, *names: str) -> bool:
    """Whether the class's own forward names one of ``names`` (an attribute or a global it reads)."""
    code = getattr(inspect.unwrap(unwrapped_forward(cls)), "__code__", None)
    return code is not None and not set(names).isdisjoint(code.co_names)


def _small_members(members: nn.ModuleList) -> bool:
    """Members of one class whose children are all leaves: per-expert MLPs, not decoder layers."""
    classes = {type(m) for m in members}
    return len(classes) == 1 and all(next(c.children(), None) is None for m in members for c in m.children())


def _expression(source: Source) -> str:
    return f"self.{source.path}" if source.path is not None else repr(source.literal)


def _float(source: Source | None, module: nn.Module, default: float | None = None) -> float | None:
    return float(source.read(module)) if source is not None else default


@functools.lru_cache(maxsize=1)
def _experts_kernels() -> frozenset[str]:
    """The experts implementations transformers ships: each computes the function the fused layer
    computes, so a switch among them keeps the layer (``MoE``'s ``kernels``)."""
    names = {"eager", "grouped_mm", "batched_mm"}
    try:
        from transformers.integrations.moe import ExpertsInterface

        names |= set(getattr(ExpertsInterface, "_global_mapping", {}))
    except ImportError:
        pass
    return frozenset(names)


def _routing_numbers(module: nn.Module, routing: RoutingMatch | None) -> RoutingNumbers | None:
    if routing is None:
        return None
    return RoutingNumbers(
        top_k=int(routing.top_k.read(module)),
        n_group=int(routing.n_group.read(module)),
        topk_group=int(routing.topk_group.read(module)),
        renorm_eps=_float(routing.renorm_eps, module),
        renorm_min=_float(routing.renorm_min, module),
        scale=_float(routing.scale, module),
    )


def _trace_of(analysis: ClassAnalysis | None) -> Trace | None:
    return analysis.trace if analysis is not None else None


# ---- finding the experts ---------------------------------------------------------------


def _index_adds(trace: Trace) -> int:
    return sum(1 for n in trace.graph.nodes if is_op(n, "index_add_", "index_add"))


def _complete(trace: Trace, what: str, node: fx.Node | None = None) -> None:
    """The trace reached the end and holds for inputs of any shape (the fused layer computes its
    one path for every number of tokens)."""
    if trace.partial:
        raise NoMatch(
            "moe.partial-trace", f"the {what} forward could not be traced to the end ({trace.describe_stop()}).", node
        )
    _shape_independent(trace, what, node)


def _shape_independent(trace: Trace, what: str, node: fx.Node | None = None) -> None:
    if trace.shape_guards:
        guard = trace.shape_guards[0]
        raise NoMatch(
            "moe.control-flow",
            f"the {what} forward's control flow depends on its input's shape ({guard.describe()}); the fused "
            "layer computes the traced path for every shape.",
            node if node is not None else guard.node,
        )


def _find_experts(analysis: ClassAnalysis) -> tuple[LoopMatch, fx.Node | None]:
    """The experts loop, in the block itself (per-expert modules) or in one child it calls (then
    also that call)."""
    trace = analysis.trace
    if _index_adds(trace):
        _complete(trace, "block's")
        loop = match_loop(trace, lambda path: _trace_of(analysis.child(path)))
        if loop.packed is not None:
            raise NoMatch(
                "moe.block-tensors", "the block computes the experts from tensors of its own.", loop.accumulator
            )
        return loop, None
    candidates = []
    for node in trace.graph.nodes:
        if node.op == "call_module":
            child = analysis.child(node.target)
            if child is not None and _index_adds(child.trace):
                candidates.append((node, child))
    if not candidates:
        # A block whose trace stopped early may call its experts after the stop: say so.
        _complete(trace, "block's")
        raise _NotMoE()
    if len(candidates) > 1:
        names = ", ".join(n.target for n, _ in candidates)
        raise NoMatch("moe.experts", f"more than one child computes experts ({names}).", candidates[1][0])
    call, child = candidates[0]
    _complete(child.trace, "experts'", call)
    loop = match_loop(child.trace, lambda path: _trace_of(analysis.child(f"{call.target}.{path}")))
    # The sum may be returned reshaped (to the input's shape): the block's output is judged by its shape.
    returned, casts = peel_casts(peel_reshapes(child.trace.output.args[0]))
    cast_back = len(casts) == 1 and casts[0].like is loop.tokens
    if returned is not loop.accumulator or (casts and not (cast_back and loop.accumulate_fp32)):
        raise NoMatch("moe.experts-output", "the experts' forward does not return the sum of the expert outputs.", call)
    if loop.accumulate_fp32 and not cast_back:
        raise NoMatch(
            "moe.experts-output", "the experts return their float32 sum without casting it back to the tokens' dtype.",
            call,
        )  # fmt: skip
    _cover(loop.nodes, child.trace.output.args[0], returned)
    _check_in_place(child.trace.graph, loop.nodes, "experts")
    return loop, call


def _experts_inputs(analysis: ClassAnalysis, loop: LoopMatch, call: fx.Node | None) -> tuple[Any, Any, Any]:
    """The block's nodes that the experts read as tokens, ids and weights."""
    if call is None:
        return loop.tokens, loop.ids, loop.weights
    inputs = call_inputs(analysis.child(call.target).trace, call.args, call.kwargs)
    mapped = []
    # The experts may flatten their tokens themselves (``x.view(-1, hidden)``): then they read the argument.
    tokens = peel_reshapes(loop.tokens)
    for node in (tokens if _flattened(loop.tokens, tokens) else loop.tokens, loop.ids, loop.weights):
        if node.op != "placeholder" or inputs is None or node.target not in inputs:
            raise NoMatch(
                "moe.experts-inputs", f"the experts read {node.name}, which is not one of their arguments.", call
            )
        mapped.append(inputs[node.target])
    return tuple(mapped)


def _flattened(node: fx.Node, source: Any) -> bool:
    """``node`` is ``source`` reshaped to ``[tokens, hidden]``, its last dimension kept."""
    shape, source_shape = getattr(value(node), "shape", None), getattr(value(source), "shape", None)
    return (
        node is not source and shape is not None and source_shape is not None and len(shape) == 2
        and shape[-1] == source_shape[-1]
    )  # fmt: skip


# ---- the block -------------------------------------------------------------------------


@dataclass
class _Output:
    roles: tuple[str, ...]
    returns_tuple: bool
    shared: tuple[SharedPlan, ...]
    flat: bool
    nodes: set[fx.Node]
    combine_fp32: bool = False  # the routed and shared outputs are added in float32
    routed_scale: Source | None = None  # the routed output is multiplied by this number first
    post: str | None = None  # a child called on the sum
    post_flat: bool = False  # ... on it flattened to [tokens, hidden] (else shaped like the input)
    bias: str | None = None  # a 1-D tensor of the block added to the sum


def _block_input(trace: Trace) -> fx.Node:
    """The block's one tensor input (the hidden states), in a trace that reached the end."""
    _complete(trace, "block's")
    used = [p for p in trace.placeholders() if p.users]
    if len(used) != 1:
        raise NoMatch(
            "moe.inputs", f"the block reads {len(used)} tensor inputs, not only the hidden states.", trace.output
        )
    return used[0]


def _match_block(analysis: ClassAnalysis, loop: LoopMatch, call: fx.Node | None) -> MoEMatch:
    trace = analysis.trace
    used = [_block_input(trace)]
    tokens, ids, weights = _experts_inputs(analysis, loop, call)
    experts_calls = {call} if call is not None else {loop.member_call, *loop.member_calls}
    routers = _router_calls((ids, weights), experts_calls)
    router_names = {n.target for n in routers}
    inlined = inline_calls(
        trace, lambda path: _trace_of(analysis.child(path)) if path.split(".")[0] in router_names else None
    )
    x = inlined[used[0]]
    router, routing = _match_router(analysis, inlined, routers, ids, weights, x)
    quantized = loop.packed is not None and loop.packed.w13_scale is not None  # moe_experts_fp8 sums in float32
    if loop.accumulate_fp32 and not _float32_weights(routing) and not quantized:
        raise NoMatch(
            "moe.combine",
            "the experts add their outputs into float32 zeros, which the fused layer's sum matches only when the "
            "routing weights are float32 (each output times its weight is then float32); the routing does not "
            "prove that.",
            loop.accumulator,
        )
    flat_inside = call is not None and _flattened(loop.tokens, peel_reshapes(loop.tokens))
    if not (_is_tokens(inlined[tokens], x) or flat_inside and peel_reshapes(inlined[tokens]) is x):
        raise NoMatch("moe.tokens", "the experts do not read the block's input flattened to [tokens, hidden].", tokens)
    routed = inlined[call] if call is not None else inlined[loop.accumulator]
    roles = {id(routed): HIDDEN, id(inlined[weights]): WEIGHTS, id(inlined[ids]): IDS}
    if routing is not None:
        roles[id(routing.logits)] = LOGITS
    items = [u for u in routers[0].users if is_op(u, "getitem") and isinstance(operand(u, 1), int)]
    router_items = {id(inlined[u]): operand(u, 1) for u in items}  # the router's outputs, by index
    output = _match_output(inlined, x, routed, roles, router_items)
    if any(r.startswith(router_output("")) for r in output.roles) and router.spec is not None:
        raise NoMatch(
            "moe.output", "the block returns an output of a router whose routing the fused layer computes itself "
            "(the router is then not called).", trace.output,
        )  # fmt: skip
    if any(s.router_outputs for s in output.shared) and router.spec is not None:
        raise NoMatch(
            "moe.shared", "a shared expert reads outputs of a router whose routing the fused layer computes itself "
            "(the router is then not called).", trace.output,
        )  # fmt: skip
    _account(trace, experts_calls | set(routers), output.shared, output.post)
    loop_nodes = {inlined[n] for n in loop.nodes if n in inlined.env} if call is None else set()
    understood = (routing.nodes if routing else _router_own_writes(inlined, routers[0])) | output.nodes | loop_nodes
    _check_in_place(inlined.graph, understood, "block")
    experts, owner, member, alpha, limit, skip = _experts_plan(analysis, loop, call)
    assumes = _assumptions(analysis, sorted(router_names) + ([call.target] if call is not None else []))
    plan = MoEPlan(
        router, experts, output.shared, output.roles, output.returns_tuple, output.flat, assumes=assumes,
        combine_fp32=output.combine_fp32, routed_scaled=output.routed_scale is not None,
        post=output.post, post_flat=output.post_flat, bias=output.bias,
    )  # fmt: skip
    branches = (("", analysis.cls),) if "training" in trace.specialisation else ()
    if routing is not None and not router.train_as_module and _reads_training(analysis, router.module):
        branches += ((router.module, analysis.child(router.module).cls),)
    return MoEMatch(
        plan, owner, member, routing, alpha, limit, skip, branches, input=used[0].target,
        routed_scale=output.routed_scale, unrolled=loop.unrolled,
    )  # fmt: skip


def _float32_weights(routing: RoutingMatch | None) -> bool:
    """The routing weights are float32 whatever the model's dtype: cast to it, or computed from float32
    logits (an input or weight cast to float32 makes ``F.linear`` float32) or a float32 softmax."""
    if routing is None or routing.weights_dtype not in (None, LOGITS, "float32"):
        return False
    if routing.weights_dtype == "float32":
        return True
    plan = routing.logits_plan
    logits_fp32 = plan.input_fp32 or plan.weight_fp32 or plan.output_fp32
    return logits_fp32 or (routing.weights_dtype is None and routing.spec.scoring != "sigmoid" and routing.spec.float32)


def _assumptions(analysis: ClassAnalysis, children: list[str]) -> tuple[tuple[str, Any], ...]:
    """The attributes of the block and of the children traced into its plan that the traces branched
    on, with their values (``self.training`` aside: training mode is judged per instance)."""
    found = {}
    for prefix, child in [("", analysis), *((f"{c}.", analysis.child(c)) for c in children)]:
        if child is None:
            continue
        for name, seen in child.trace.specialisation.items():
            if name != "training":
                found[prefix + name] = seen
    return tuple(sorted(found.items()))


def _experts_plan(analysis: ClassAnalysis, loop: LoopMatch, call: fx.Node | None):
    """(plan, owning child, member roles, alpha, limit, skipped id) of the experts."""
    if call is not None and loop.sliced is not None:
        prefix = f"{call.target}."
        member_trace = _trace_of(analysis.child(prefix + loop.member_call.target))
        if member_trace is None:
            raise NoMatch("moe.expert-form", "the expert module was not traced.", loop.member_call)
        lookup = lambda p: _trace_of(analysis.child(f"{prefix}{loop.member_call.target}.{p}"))  # noqa: E731
        member = match_sliced_member(member_trace, lookup, loop.sliced)
        plan = ExpertsPlan(prefix + "w13", prefix + "w2", ExpertsSpec(member.activation))
        return plan, call.target, member, None, None, _prefixed(loop.skip_ids_from, prefix)
    if call is not None:
        prefix, p = f"{call.target}.", loop.packed
        quantized = p.w13_scale is not None
        plan = ExpertsPlan(
            prefix + p.w13, prefix + p.w2, p.spec,
            prefix + p.b13 if p.b13 else None, prefix + p.b2 if p.b2 else None,
            w13_scale=prefix + p.w13_scale if quantized else None, w2_scale=prefix + p.w2_scale if quantized else None,
            block=prefix + BLOCK_ATTRIBUTE if quantized else None,
        )  # fmt: skip
        return (
            plan,
            call.target,
            None,
            _prefixed(p.alpha, prefix),
            _prefixed(p.limit, prefix),
            _prefixed(loop.skip_ids_from, prefix),
        )
    member_trace = _trace_of(analysis.child(loop.member_call.target))
    if member_trace is None:
        raise NoMatch("moe.expert-form", "the expert module was not traced.", loop.member_call)
    member = match_glu_member(
        member_trace, lambda p: _trace_of(analysis.child(f"{loop.member_call.target}.{p}")), loop.member_weight
    )
    owner = loop.member_list
    plan = ExpertsPlan(f"{owner}.w13", f"{owner}.w2", ExpertsSpec(member.activation))
    return plan, owner, member, None, None, loop.skip_ids_from


def _prefixed(source: Source | None, prefix: str) -> Source | None:
    if source is None or source.path is None:
        return source
    return Source(path=prefix + source.path)


def _reads_training(analysis: ClassAnalysis, child: str) -> bool:
    found = analysis.child(child)
    return found is not None and "training" in found.trace.specialisation


def _router_calls(roots: tuple, excluded: set) -> list[fx.Node]:
    """The children called on the way to the routing ids and weights."""
    seen, pending, calls = set(), [r for r in roots if isinstance(r, fx.Node)], []
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_module" and node not in excluded:
            calls.append(node)
        pending.extend(node.all_input_nodes)
    return calls


def _is_tokens(node: Any, x: fx.Node) -> bool:
    """``node`` is the block input flattened to ``[tokens, hidden]`` (or the input, already 2-D)."""
    if peel_reshapes(node) is not x:
        return False
    shape, x_shape = getattr(value(node), "shape", None), getattr(value(x), "shape", None)
    return shape is not None and x_shape is not None and len(shape) == 2 and shape[-1] == x_shape[-1]


def _match_router(
    analysis, inlined, routers: list[fx.Node], ids, weights, x, scores=None
) -> tuple[RouterPlan, RoutingMatch | None]:
    """The routing, recognised (computed by the layer) or, failing that, the router child called as is;
    of dense ``scores`` instead of ids and weights when given (then recognised, or refused)."""
    if len(routers) != 1:
        names = ", ".join(n.target for n in routers) or "none"
        raise NoMatch(
            "moe.router", f"the routing ids and weights come from {len(routers)} children ({names}), not one router."
        )
    call = routers[0]
    router_input = call.args[0] if call.args and not call.kwargs else None
    as_input = router_input is not None and router_input.op == "placeholder"
    if router_input is None or not (as_input or _is_tokens(inlined[router_input], x)):
        raise NoMatch(
            "moe.router", f"the router {call.target!r} is not called on the block's tokens (and tensors of its own).",
            call,
        )  # fmt: skip
    extra = _block_tensor_arguments(analysis, call)
    if scores is not None:
        routing = match_masked_scores(inlined[scores])
    else:
        try:
            routing = match_routing(_inlined_node(inlined, ids), _inlined_node(inlined, weights))
        except NoMatch as refusal:
            return _opaque_router(call, ids, weights, refusal, extra), None
    router_trace = _trace_of(analysis.child(call.target))
    if router_trace is not None:
        _shape_independent(router_trace, "router's", call)  # its routing is computed by the fused layer
    if not (routing.tokens is x or _is_tokens(routing.tokens, x)):
        raise NoMatch("moe.router", "the router scores something other than the block's tokens.", routing.tokens)
    returned = inlined[call]
    meaning = {id(routing.logits): LOGITS}
    if scores is None:
        meaning |= {id(_inlined_node(inlined, weights)): WEIGHTS, id(_inlined_node(inlined, ids)): IDS}
    returns = tuple(meaning.get(id(r)) for r in (returned if isinstance(returned, (tuple, list)) else (returned,)))
    plan = RouterPlan(
        module=call.target,
        returns=returns,
        input=as_input,
        extra=extra,
        logits=None if returns == (LOGITS,) and routing.logits is returned else routing.logits_plan,
        spec=routing.spec,
        correction_bias=routing.correction_bias,
        weights_dtype=routing.weights_dtype,
        # A router that reads self.training computes its own training path; the layer calls it then.
        train_as_module={WEIGHTS, IDS} <= set(returns) and _reads_training(analysis, call.target),
    )
    return plan, routing


def _block_tensor_arguments(analysis: ClassAnalysis, call: fx.Node) -> tuple[str, ...]:
    """The arguments after the tokens of a router call: each a parameter or buffer of the block itself
    (a correction bias the block holds and hands to its router), which the fused layer keeps."""
    extra = []
    for arg in call.args[1:]:
        tensor = value(arg) if isinstance(arg, fx.Node) else None
        if not (
            arg.op == "get_attr" and "." not in arg.target and "self_attr" not in arg.meta
            and isinstance(tensor, torch.Tensor) and not arg.meta.get("constant")
        ):  # fmt: skip
            raise NoMatch(
                "moe.router",
                f"the router {call.target!r} is called with {getattr(arg, 'name', repr(arg))} besides the tokens, "
                "which is not a tensor the block holds.",
                call,
            )
        extra.append(arg.target)
    return tuple(extra)


def _opaque_router(call: fx.Node, ids, weights, refusal: NoMatch, extra: tuple[str, ...]) -> RouterPlan:
    """A router whose routing is not recognised, but whose outputs the experts read directly."""
    roles = {}
    for node, role in ((ids, IDS), (weights, WEIGHTS)):
        if not (is_op(node, "getitem") and operand(node, 0) is call and isinstance(operand(node, 1), int)):
            raise refusal
        roles[operand(node, 1)] = role
    arity = len(value(call)) if isinstance(value(call), (tuple, list)) else 0
    if arity < 2:
        raise refusal
    return RouterPlan(
        module=call.target,
        returns=tuple(roles.get(i) for i in range(arity)),
        input=call.args[0].op == "placeholder",
        extra=extra,
    )


def _match_output(inlined, x: fx.Node, routed: Any, roles: dict[int, str], router_items: dict[int, int]) -> _Output:
    """Roles of what the block returns; the shared experts added to the routed output."""
    out = next(n for n in reversed(inlined.graph.nodes) if n.op == "output").args[0]
    items = out if isinstance(out, (tuple, list)) else (out,)
    found = _Output((), isinstance(out, (tuple, list)), (), False, set())
    roles_out = []
    for item in items:
        role = roles.get(id(item))
        if role is None and id(item) in router_items:  # an output of a router called as is, returned as is
            role = router_output(router_items[id(item)])
        if role is None or role == HIDDEN:
            found.flat = _output_shape(item, x) != tuple(value(x).shape)
            total, cast_back = _peel_shape_and_dtype(item, x, found.nodes)
            post_input = _post_input(total, routed, x, found)
            if post_input is not None:
                if cast_back:
                    raise NoMatch(
                        "moe.output", f"the output of {found.post!r} is cast to the input's dtype, which the "
                        "fused layer does not do after it.", item,
                    )  # fmt: skip
                total, cast_back = _peel_shape_and_dtype(post_input, x, found.nodes)
            _split_terms(total, routed, x, found, cast_back, router_items)
            role = HIDDEN
        roles_out.append(role)
    if roles_out.count(HIDDEN) != 1:
        raise NoMatch("moe.output", f"the block returns {roles_out.count(HIDDEN)} copies of its output, not one.", out)
    found.roles = tuple(roles_out)
    return found


def _added_in_place(node: Any, covered: set) -> Any:
    """``out.add_(t)``, then ``out`` read: what every later reader of ``out`` sees is ``out + t``, the
    ``add_`` node, returned in its place when no reader comes before the ``add_`` and ``t`` has out's
    dtype (``add_`` rounds to out's dtype where ``+`` would promote); else ``node`` itself."""
    if not isinstance(node, fx.Node):
        return node
    adds = [u for u in node.users if is_op(u, "add_") and operand(u, 0) is node]
    if len(adds) != 1 or adds[0] in covered or len(operands(adds[0])) != 2 or adds[0].kwargs:
        return node
    add = adds[0]
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    if any(order[u] < order[add] for u in node.users if u is not add):
        return node
    dtype = getattr(value(operand(add, 1)), "dtype", None)
    if dtype is None or dtype != getattr(value(node), "dtype", None):
        return node
    covered.add(add)
    return add


def _output_shape(item: Any, x: fx.Node) -> tuple[int, ...]:
    """The shape the block returns its output in, to tell a ``[tokens, hidden]`` output from one
    shaped like the input. Traced when the probe reached the experts; otherwise (a probe that
    stopped inside the block leaves the experts' output, and all that follows, unknown) read from
    a last ``reshape``/``view`` whose sizes Python read from the input's shape."""
    shape = getattr(value(item), "shape", None)
    if shape is None:
        shape = _reshape_sizes(_below_bias(peel_casts(item)[0]), x)
    if shape is None or getattr(value(x), "shape", None) is None:
        raise NoMatch(
            "moe.output",
            "the shape of the block's output is unknown (the probe input did not reach its experts), "
            "so whether it returns [tokens, hidden] or the input's shape is not known.",
            item if isinstance(item, fx.Node) else None,
        )
    return tuple(shape)


def _below_bias(node: Any) -> Any:
    """``t + bias`` (a 1-D tensor of the block, which keeps t's shape) → t; else ``node``."""
    if is_op(node, "add") and len(operands(node)) == 2 and not node.kwargs:
        a, b = operands(node)
        if _block_vector(b) or _block_vector(a):
            return a if _block_vector(b) else b
    return node


def _reshape_sizes(node: Any, x: fx.Node) -> tuple[int, ...] | None:
    """The sizes a ``reshape``/``view`` (or ``*_as`` the input) node gives, where they are known ints."""
    if not isinstance(node, fx.Node):
        return None
    if is_op(node, "reshape_as", "view_as") and operand(node, 1) is x:
        return getattr(value(x), "shape", None)
    if not is_op(node, "reshape", "view"):
        return None
    sizes = node.args[1:] if node.op == "call_method" else node.args[1:2]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = sizes[0]
    sizes = [value(d) for d in sizes]  # an int attribute of self (``self.hidden_dim``) is a node
    if sizes and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in sizes):
        return tuple(sizes)
    return None


def _peel_shape_and_dtype(node: Any, x: fx.Node, covered: set) -> tuple[Any, bool]:
    """The value below reshapes and casts to the input's dtype (in any order), and whether a cast was
    among them (a cast to another dtype is refused: the layer returns the input's dtype)."""
    cast_back = False
    while True:
        reshaped = peel_reshapes(node)
        _cover(covered, node, reshaped)
        reshaped = _added_in_place(reshaped, covered)
        inner, casts = peel_casts(reshaped)
        if not casts:
            return reshaped, cast_back
        for cast in casts:
            if cast.like is None or peel_reshapes(cast.like) is not x:
                raise NoMatch(
                    "moe.output", f"the block's output is cast to {cast.describe()}, not to its input's dtype.", node
                )
        _cover(covered, reshaped, inner)
        cast_back, node = True, inner


def _post_input(node: Any, routed: Any, x: fx.Node, found: _Output) -> Any:
    """``post(sum)``: a child called last, on the sum alone, keeping its shape (a norm after the
    experts); records it and returns its input, or None when the output is not such a call."""
    if node is routed or not (
        isinstance(node, fx.Node) and node.op == "call_module" and len(node.args) == 1 and not node.kwargs
    ):
        return None
    arg = node.args[0]
    shape, arg_shape = getattr(value(node), "shape", None), getattr(value(arg), "shape", None)
    if shape is None or shape != arg_shape:
        raise NoMatch(
            "moe.output", f"the block returns {node.target!r} of its output, which changes its shape (or the shape "
            "is unknown).", node,
        )  # fmt: skip
    found.post, found.post_flat = node.target, tuple(arg_shape) != tuple(value(x).shape)
    found.nodes.add(node)
    return arg


def _cover(covered: set, top: Any, bottom: Any) -> None:
    walk = top
    while isinstance(walk, fx.Node) and walk is not bottom:
        covered.add(walk)
        walk = operand(walk, 0)


def _split_terms(node: Any, routed: Any, x: fx.Node, found: _Output, cast_back: bool, router_items: dict) -> None:
    """``routed [* scale] + shared_1 + ...`` (any order), each shared term ``S(x)`` or ``sigmoid(G(x)) * S(x)``;
    every term cast to float32, or none (then the sum is cast back to the input's dtype)."""
    terms, pending, covered = [], [node], found.nodes
    while pending:
        term = _added_in_place(peel_reshapes(pending.pop(0)), covered)
        in_place = is_op(term, "add_") and term in covered  # one ``_added_in_place`` vouched for
        if (is_op(term, "add") or in_place) and len(operands(term)) == 2 and not term.kwargs:
            covered.add(term)
            pending[:0] = list(operands(term))
            continue
        terms.append(term)
    peeled = [_peel_float32(t, covered) for t in terms]
    found.combine_fp32 = any(t is not p for t, p in zip(terms, peeled))
    if found.combine_fp32 and (not all(t is not p for t, p in zip(terms, peeled)) or not cast_back):
        raise NoMatch(
            "moe.output", "the experts' outputs are added in float32 only in part, or the float32 sum is not cast "
            "back to the input's dtype.", node,
        )  # fmt: skip
    terms = [peel_reshapes(t) for t in peeled]
    biases = [t for t in terms if _block_vector(t)]
    if len(biases) > 1:
        raise NoMatch("moe.output", f"{len(biases)} tensors of the block are added to the experts' output, not one.", node)
    if biases:
        found.bias = biases[0].target
        terms.remove(biases[0])
    found_routed = [t for t in terms if t is routed or _scaled_routed(t, routed, found)]
    if len(found_routed) != 1:
        raise NoMatch("moe.output", "the block's output is not the routed experts' output plus shared experts.", node)
    found.shared = tuple(_shared_term(t, x, covered, router_items) for t in terms if t is not found_routed[0])


def _block_vector(term: Any) -> bool:
    """A 1-D parameter or buffer of the block itself (a bias added after the combine): broadcast over the
    last dimension, it adds the same to the flat ``[tokens, hidden]`` sum as to the input-shaped one."""
    if not (isinstance(term, fx.Node) and term.op == "get_attr" and "." not in term.target):
        return False
    tensor = value(term)
    return not term.meta.get("constant") and isinstance(tensor, torch.Tensor) and tensor.dim() == 1


def _peel_float32(term: Any, covered: set) -> Any:
    inner, casts = peel_casts(term)
    if len(casts) == 1 and casts[0].dtype == torch.float32:
        covered.add(term)
        return inner
    return term


def _scaled_routed(term: Any, routed: Any, found: _Output) -> bool:
    """``routed * scale``, the scale a number (an attribute of the block, or a literal)."""
    if not (is_op(term, "mul") and len(operands(term)) == 2 and not term.kwargs):
        return False
    for out, factor in (operands(term), operands(term)[::-1]):
        if peel_reshapes(out) is routed and not isinstance(value(factor), torch.Tensor):
            found.routed_scale = source_of(factor, "the routed experts' scale", (float, int))
            found.nodes.add(term)
            _cover(found.nodes, out, routed)
            return True
    return False


def _shared_term(term: Any, x: fx.Node, covered: set, router_items: dict[int, int]) -> SharedPlan:
    if isinstance(term, fx.Node) and term.op == "call_module":
        as_input = _module_input(term, x, router_items)
        return SharedPlan(term.target, as_input, router_outputs=_router_outputs(term, router_items))
    if is_op(term, "mul"):
        for gate, expert in (operands(term)[:2], operands(term)[1::-1]):
            inner = operand(gate, 0) if is_op(gate, "sigmoid") else None
            if (
                isinstance(inner, fx.Node)
                and inner.op == "call_module"
                and getattr(expert, "op", None) == "call_module"
            ):
                covered.update({term, gate})
                return SharedPlan(expert.target, _module_input(expert, x), inner.target, _module_input(inner, x))
    raise NoMatch(
        "moe.shared",
        "a term added to the experts' output is not a shared expert (optionally gated by a sigmoid).",
        term,
    )


def _module_input(call: fx.Node, x: fx.Node, router_items: dict[int, int] | None = None) -> bool:
    """True when a child is called on the block's input (or a reshape of it to the input's shape),
    False on the flattened tokens; other arguments only outputs of the router (``router_items``)."""
    rest = [*call.args[1:], *call.kwargs.values()]
    tokens = call.args[0] if call.args else None
    shape, x_shape = getattr(value(tokens), "shape", None), getattr(value(x), "shape", None)
    as_input = tokens is x or (peel_reshapes(tokens) is x and shape is not None and shape == x_shape)
    if not (as_input or _is_tokens(tokens, x)) or any(id(a) not in (router_items or {}) for a in rest):
        raise NoMatch(
            "moe.shared",
            f"{call.target!r} is not called on the block's tokens (and outputs of the router) alone.",
            call,
        )
    return as_input


def _router_outputs(call: fx.Node, router_items: dict[int, int]) -> tuple[tuple[str | None, int], ...]:
    """(keyword, or None for a positional argument, index of the router's output) of a child's
    arguments after the tokens."""
    positional = tuple((None, router_items[id(a)]) for a in call.args[1:])
    return positional + tuple((k, router_items[id(a)]) for k, a in call.kwargs.items())


def _account(trace: Trace, known: set, shared: tuple[SharedPlan, ...], post: str | None) -> None:
    """Every child the block calls has a role."""
    names = {n.target for n in known if n is not None} | {post}
    names |= {s.module for s in shared} | {s.gate for s in shared if s.gate is not None}
    for node in trace.graph.nodes:
        if node.op == "call_module" and node.target not in names:
            raise NoMatch(
                "moe.unaccounted", f"the block calls {node.target!r}, whose role in the block is not understood.", node
            )


# Ops that return a tensor of their own, which nothing else holds.
_ALLOCATES = frozenset({
    "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
    "new_zeros", "new_ones", "new_full", "new_empty", "clone",
})  # fmt: skip


def _router_own_writes(inlined, call: fx.Node) -> set:
    """The in-place writes of a router called as is (its routing not recognised: the fused layer
    calls the module itself, so its code runs as written) into a tensor it allocated itself (a group
    mask filled by ``scatter_``): nothing outside the router holds that tensor."""
    region = inlined.spans.get(call, set())

    def allocated(node: Any) -> bool:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        return node in region and name in _ALLOCATES

    return {
        node for node in region
        if _in_place_name(node) and node.args and isinstance(node.args[0], fx.Node) and allocated(node.args[0])
    }  # fmt: skip


def _in_place_name(node: fx.Node) -> str | None:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name if isinstance(name, str) and name.endswith("_") and not name.startswith("_") else None


def _check_in_place(graph: fx.Graph, covered: set, where: str) -> None:
    """In-place ops write through to values others may read: each must be one the match understands."""
    for node in graph.nodes:
        name = _in_place_name(node)
        if name is not None and node not in covered:
            raise NoMatch("moe.in-place", f"the {where} modifies a value in place ({name} at {node.name}).", node)


# ---- per instance ----------------------------------------------------------------------


def _stacked_attribute(found: MoEMatch, path: str) -> bool:
    """An attribute of the per-expert modules' holder, which stacking replaces."""
    return found.member is not None and path.startswith(found.experts_child + ".")


def _validate(module: nn.Module, found: MoEMatch) -> None:
    for path, seen in found.plan.assumes:
        owner, _, name = path.rpartition(".")
        now = getattr(module.get_submodule(owner), name, None) if _stacked_attribute(found, path) else seen
        if type(now) is not type(seen) or now != seen:
            raise NoMatch(
                "moe.shapes", f"the experts' forward was traced with {path} = {seen!r}, and this block's is {now!r}."
            )
    unread = [name for name, _ in _own_tensors(module) if name not in found.plan.block_tensors()]
    if unread:
        raise NoMatch(
            "moe.block-tensors",
            f"the block holds tensors of its own ({', '.join(unread)}) that its routing does not read, which the "
            "fused layer would not keep.",
        )
    e = found.plan.experts
    # Packed experts the plan shards are judged below; per-expert modules (stacked when fused) never are.
    packed = found.member is None
    expert_paths = [path for path in (e.w13, e.w2, e.b13, e.b2) if path is not None and packed]
    sharded = next((n for n, p in module.named_parameters() if is_sharded(p) and n not in expert_paths), None)
    if sharded is not None:
        raise NoMatch(
            "moe.sharded",
            f"{sharded} is a DTensor (tensor parallelism): the fused layer computes the block's other modules whole "
            "on each rank, not shards of them.",
        )
    try:
        shards = expert_sharding(module, found.plan, shared_batch(module)) if packed else None
    except ValueError as exc:
        raise NoMatch("moe.sharded", f"{exc} (the experts are DTensors)") from None
    # Under expert parallelism the experts' module has the plan's dispatch as its forward: the fused layer,
    # which never calls that module, routes and combines the tokens itself (``ExpertShards``).
    dispatched = e.w13.rpartition(".")[0] if shards is not None else None
    wrapped = next((n for n, m in module.named_modules() if forward_replaced(m) and n != dispatched), None)
    if wrapped is not None:
        forward = module.get_submodule(wrapped).__dict__["forward"]
        raise NoMatch(
            "moe.wrapped",
            f"{wrapped or 'the block'}.forward is replaced on the instance by "
            f"{getattr(forward, '__qualname__', type(forward).__name__)} (a parallel plan's dispatch, a hook or another "
            "wrapper): the fused layer would compute around it, not through it.",
        )
    if isinstance(found.member, SlicedMember):
        experts = len(_sliced_views(module.get_submodule(found.experts_child), found.member, found.unrolled)[0])
    elif found.member is not None:
        experts = _check_members(module.get_submodule(found.experts_child), found.member)
    else:
        experts = _check_packed(module, found)
    if e.w13_scale is not None:
        if shards is not None:
            raise NoMatch(
                "moe.quantized", "the block-FP8 experts are shared out over ranks, which moe_experts_fp8 does not compute."
            )
        owner = module.get_submodule(e.w13.rpartition(".")[0])
        tensors = (_tensor(module, p) for p in (e.w13, e.w2, e.w13_scale, e.w2_scale))
        reason = check_fp8_experts(owner, *tensors)
        if reason is not None:
            raise NoMatch("moe.quantized", f"{e.w13.rpartition('.')[0]} ({type(owner).__name__}): {reason}")
    if found.more_experts and shards is not None:
        raise NoMatch("moe.sharded", "experts whose gate/up and down tensors two children hold are not sharded here.")
    if found.experts_traced is not None and experts != found.experts_traced:
        raise NoMatch(
            "moe.shapes", f"the experts' forward was traced applying {found.experts_traced} experts, and this block "
            f"holds {experts}.",
        )  # fmt: skip
    if found.routing is not None:
        _check_routing(module, found, experts)
    if found.unrolled is not None and found.unrolled != experts:
        raise NoMatch(
            "moe.unrolled-loop",
            f"the experts loop was traced over {found.unrolled} expert indices, and this block has {experts} experts.",
        )
    if found.skip_ids_from is not None:
        skipped = found.skip_ids_from.read(module)
        # Under expert parallelism the loop runs over this rank's experts, by local ids.
        held = experts if shards is None else shards.local_experts
        if not isinstance(skipped, int) or skipped < held:
            raise NoMatch(
                "moe.loop-form", f"the experts loop skips expert id {skipped!r}, which is a real expert of {experts}."
            )


def shared_batch(module: nn.Module) -> bool | None:
    """Whether the ranks that share out the block's experts hold the same tokens: transformers'
    ``distributed_config`` on a configuration the block's modules hold, with as many expert-parallel
    ranks as tensor-parallel ones (the expert group is then the tensor-parallel group); None when no
    module holds one."""
    for child in module.modules():
        config = getattr(getattr(child, "config", None), "distributed_config", None)
        if config is not None and getattr(config, "ep_size", None) is not None:
            return config.ep_size == config.tp_size
    return None


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _tensor(module: nn.Module, path: str) -> torch.Tensor:
    owner, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _check_packed(module: nn.Module, found: MoEMatch) -> int:
    e = found.plan.experts
    w13, w2 = _tensor(module, e.w13), _tensor(module, e.w2)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dim() == 3 and w2.dim() == 3):
        raise NoMatch("moe.shapes", "the packed expert weights are not 3-D tensors.")
    experts = w13.shape[0]
    hidden, double = (w13.shape[1], w13.shape[2]) if e.spec.w13_transposed else (w13.shape[2], w13.shape[1])
    expect_w2 = (experts, double // 2, hidden) if e.spec.w2_transposed else (experts, hidden, double // 2)
    if double % 2 or tuple(w2.shape) != expect_w2:
        raise NoMatch(
            "moe.shapes",
            f"gate/up {tuple(w13.shape)} and down {tuple(w2.shape)} do not fit one layout (expected down {expect_w2}).",
        )
    for path, rows in ((e.b13, double), (e.b2, hidden)):
        if path is not None and tuple(_tensor(module, path).shape) != (experts, rows):
            raise NoMatch(
                "moe.shapes", f"the bias {path} has shape {tuple(_tensor(module, path).shape)}, not {(experts, rows)}."
            )
    return experts


def _check_members(members: nn.Module, glu: GLUMember) -> int:
    if not isinstance(members, nn.ModuleList) or len({type(m) for m in members}) != 1:
        raise NoMatch("moe.experts", "the per-expert modules are not one list of modules of one class.")
    shapes = set()
    for member in members:
        parts = [member.get_submodule(n) for n in (glu.gate, glu.up, glu.down)]
        shapes.add(tuple((tuple(p.weight.shape), p.bias is not None) for p in parts))
    if len(shapes) != 1:
        raise NoMatch("moe.shapes", "the per-expert modules differ in shape or bias.")
    (gate, gate_bias), (up, up_bias), (down, down_bias) = next(iter(shapes))
    if gate != up or down != (gate[1], gate[0]):
        raise NoMatch("moe.shapes", f"gate {gate}, up {up} and down {down} are not one gated MLP.")
    if gate_bias or up_bias or down_bias:
        raise NoMatch("moe.expert-bias", "the per-expert modules have biases, which stacking does not carry yet.")
    return len(members)


def _check_routing(module: nn.Module, found: MoEMatch, experts: int) -> None:
    r, routing = found.plan.router, found.routing
    top_k = routing.top_k.read(module)
    router_weight = _tensor(module, r.logits.weight) if r.logits is not None else None
    if router_weight is not None and router_weight.shape[0] != experts:
        raise NoMatch("moe.shapes", f"the router scores {router_weight.shape[0]} experts but there are {experts}.")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise NoMatch("moe.top-k", f"top-k is {top_k!r}, not a number of experts between 1 and {experts}.")
    if r.spec.grouped:
        groups, kept = routing.n_group.read(module), routing.topk_group.read(module)
        if not (isinstance(groups, int) and groups > 0 and experts % groups == 0 and 1 <= kept <= groups):
            raise NoMatch(
                "moe.group-limit", f"{experts} experts in {groups!r} groups, keeping {kept!r}, is not a valid grouping."
            )
    if r.correction_bias is not None and _tensor(module, r.correction_bias).numel() != experts:
        raise NoMatch("moe.shapes", f"the correction bias {r.correction_bias} does not have one value per expert.")


def _sliced_views(owner: nn.Module, member: SlicedMember, experts: int | None) -> tuple[torch.Tensor, ...]:
    """Gate ``[E, I, H]``, up ``[E, I, H]`` and down ``[E, H, I]`` of every expert: views of the parameters
    whose slices the loop hands the shared module, in the layout ``F.linear`` applies."""
    views = []
    for path, linear in (member.gate, member.up, member.down):
        p = owner.get_parameter(path)
        if experts is not None and p.dim() == 2 and p.shape[0] % experts == 0:
            view = p.view(experts, p.shape[0] // experts, p.shape[1])
        elif experts is not None and p.dim() == 3 and p.shape[0] == experts:
            view = p
        else:
            raise NoMatch("moe.shapes", f"{path} {tuple(p.shape)} does not hold {experts} experts' blocks.")
        views.append(view if linear else view.transpose(1, 2))
    gate, up, down = views
    if gate.shape != up.shape or down.shape != (experts, gate.shape[2], gate.shape[1]):
        raise NoMatch(
            "moe.shapes", f"gate {tuple(gate.shape)}, up {tuple(up.shape)} and down {tuple(down.shape)} are not "
            "one gated MLP per expert.",
        )  # fmt: skip
    return gate, up, down


def _stack_sliced(owner: nn.Module, member: SlicedMember, experts: int) -> StackedExperts:
    gate, up, down = (v.detach() for v in _sliced_views(owner, member, experts))
    tensors = {"w13": torch.cat([gate, up], dim=1), "w2": down.contiguous().clone()}
    for name, path in (("w13", member.gate[0]), ("w2", member.down[0])):
        tensors[name].requires_grad_(owner.get_parameter(path).requires_grad)
    keys = {"w13": (member.gate[0], member.up[0]), "w2": (member.down[0],)}
    whole = {p: (tuple(owner.get_parameter(p).shape), not linear) for p, linear in (member.gate, member.up, member.down)}
    return StackedExperts(tensors, keys, whole)


def _stack(members: nn.ModuleList, glu: GLUMember) -> StackedExperts:
    parts = [[m.get_submodule(n).weight for m in members] for n in (glu.gate, glu.up, glu.down)]
    gate, up, down = (torch.stack([w.detach() for w in ws]) for ws in parts)
    tensors = {"w13": torch.cat([gate, up], dim=1), "w2": down}
    for t, ws in zip(tensors.values(), (parts[0], parts[2])):
        t.requires_grad_(ws[0].requires_grad)
    keys = {"w13": (f"{{}}.{glu.gate}.weight", f"{{}}.{glu.up}.weight"), "w2": (f"{{}}.{glu.down}.weight",)}
    return StackedExperts(tensors, keys)


# ---- training mode ---------------------------------------------------------------------


def _train_error(module: nn.Module, found: MoEMatch) -> str | None:
    """None when training mode computes what was traced; else why the fused layer is inference-only."""
    for path, cls in found.training_branches:
        owner = module.get_submodule(path) if path else module
        for line, test in _training_tests(cls):
            taken = _evaluate(test, owner)
            if taken is None or taken != _evaluate(test, owner, training=False):
                where = f"{cls.__name__}.forward line {line}"
                return (
                    f"This fused mixture-of-experts layer reproduces {type(module).__name__} in inference only: "
                    f"in training mode its forward takes another path ({where}: `{test}`). "
                    "Rewrite the model without the 'moe' fusion to train it."
                )
    return None


def _training_tests(cls: type) -> list[tuple[int, str]]:
    """The conditions of the branches in ``cls.forward`` that read ``self.training``."""
    source = method_source(unwrapped_forward(cls))
    if source is None:
        return [(0, "<no source>")]
    tests = []
    for node in m.findall(source.node, m.If() | m.IfExp() | m.While()):
        code = cst.Module(body=[]).code_for_node(node.test)
        if "self.training" in code:
            tests.append((source.line(node), code))
    return tests


_ALLOWED = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.Compare, ast.Attribute, ast.Name,
            ast.Load, ast.Constant, ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.Eq, ast.NotEq, ast.Is, ast.IsNot)  # fmt: skip


def _evaluate(test: str, module: nn.Module, training: bool = True) -> Any:
    """The value of a condition that reads only attributes of ``self``, as ``module`` would see it in
    the given mode; None when the condition reads anything else."""
    try:
        tree = ast.parse(test, mode="eval")
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED) or (isinstance(node, ast.Name) and node.id != "self"):
            return None
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            return None

    class _View:
        def __getattr__(self, name):
            return training if name == "training" else getattr(module, name)

    try:
        return bool(eval(compile(tree, "<condition>", "eval"), {"__builtins__": {}}, {"self": _View()}))
    except Exception:  # an attribute the instance lacks: the condition cannot be decided
        return None
