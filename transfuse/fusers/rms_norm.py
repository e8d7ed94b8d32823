"""RMSNorm: ``x * rsqrt(mean(x², -1) + eps)`` [``* w`` | ``* (1 + w)``] → ``transfuse.ops.RMSNorm``.

Found by dataflow in the module's own graph, in every way it is written: ``pow(2)``,
``square``, ``x * x``, ``** 2``; ``rsqrt``, ``pow(-0.5)``, ``** -0.5``; dtype casts
anywhere; with or without a weight; the zero-centred ``1 + weight``; and
``F.rms_norm`` (so ``torch.nn.RMSNorm``). The casts decide the rounding, and the fused
op must round exactly as the model did, so each is recorded in an ``RMSNormSpec``:
Llama normalises in float32 and casts back before the weight multiply; Gemma
multiplies by ``1 + weight`` in float32 and casts last.

The whole module is replaced, so the match must account for every op in the graph,
and the source must have no branch the trace could have hidden (``rewriter.branches``), except
a branch whose test reads only the instance's own attributes (``if self.with_scale``, ``if self.weight is
not None``): it is decided as the traced instance decided it, the attributes it read
become the match's assumptions, an instance whose attributes differ is refused (or, for
the scalars the analyses are specialised on, traced on its own path), and the fused layer
holds them and raises if one changes. Everything else is
refused with its reason: mean subtraction (LayerNorm), a second input that is not a gate
(an output gate ``(norm(x) * act(gate.float())).to(x.dtype)``, or a gate before the norm,
``norm(x.float() * act(gate.float()))`` over the row or over groups of an int attribute's size,
whose ``if gate is not None`` branch, holding only that product, is proved to leave the norm of
the input alone without a gate),
computation after the norm, a reduction over another dimension, an eps that is not a
float attribute (eps is read per instance from that attribute).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

import torch
import torch.fx as fx
from torch import nn

from ..ops import GATE_ACTIVATIONS, RMSNormSpec, layer
from ..ops.layers import Assumption, GatedRMSNorm
from ..rewriter.analysis import ClassAnalysis
from ..rewriter.branches import raises_only, traced_path
from ..rewriter.fusion import Fused, Fuser, Refusal
from ..rewriter.graph import (
    Cast, NoMatch, ancestors, calls_fused_op, cast_of, is_op, op_name, operand, operands, peel_casts, value,
)  # fmt: skip
from ..rewriter.source import EditContext, forward_replaced, method_source
from ..rewriter.syntax import comment_line
from ..rewriter.tracer import unwrapped_forward

__all__ = ["RMSNormFuser", "RMSNormMatch"]


@dataclass(frozen=True)
class RMSNormMatch:
    """What was found in the class: the rounding, the weight parameter's name, the eps attribute,
    and the name of the forward's input."""

    spec: RMSNormSpec
    weight: str | None
    eps_attr: str
    input: str
    gate: str | None = None  # a gated norm's second input ...
    activation: str | None = None  # ... and the activation applied to it (a GATE_ACTIVATIONS name)
    # Attributes the forward's branches read, with the values that chose the traced path.
    assumes: tuple[Assumption, ...] = ()
    gate_first: bool = False  # the gate multiplies the upcast input before the norm (Mamba-2) ...
    group_attr: str | None = None  # ... normalised in groups of this attribute's size (None: whole rows)
    optional_gate: bool = False  # ... and without a gate the norm of the input alone (proved on the source)
    # Globals of the model's module a branch read, None when traced: (module, name); checked per call.
    globals_none: tuple[tuple[str, str], ...] = ()


class RMSNormFuser(Fuser[RMSNormMatch]):
    kind = "rms_norm"
    replaces_module = True

    def wants(self, module: nn.Module) -> bool:
        return next(module.children(), None) is None and len(module._parameters) <= 1

    def match(self, analysis: ClassAnalysis) -> RMSNormMatch | Refusal | None:
        if calls_fused_op(analysis.trace.graph):
            return None  # already fused (an emitted modeling file's norm)
        try:
            found, product = _match_graph(analysis)
            path = traced_path(analysis, "rms_norm")
            if path.optional:
                found = dataclasses.replace(found, optional_gate=_gate_is_optional(found, product, path.optional))
            _check_assumed(path.assumes.values())
        except NoMatch as refusal:
            if not _looks_like_a_norm(analysis):
                return None
            return Refusal(refusal.tag, refusal.reason, analysis.where(refusal.node))
        globals_none = tuple(sorted(path.globals_none.values()))
        unread = [name for namespace, name in globals_none if _reader(analysis.cls, namespace) is None]
        if unread:
            return Refusal(
                "rms_norm.control-flow",
                f"a helper branches on the global {unread[0]} of a module none of {analysis.cls.__name__}'s "
                "methods is defined in, which the fused layer cannot check per call.",
                analysis.where(),
            )
        if globals_none and found.gate is not None:
            return Refusal(
                "rms_norm.control-flow",
                f"the forward branches on the module global {globals_none[0][1]}; only an ungated norm runs its "
                "original code when such a global changes.",
                analysis.where(),
            )
        assumes = tuple(path.assumes[name] for name in sorted(path.assumes))
        return dataclasses.replace(found, assumes=assumes, globals_none=globals_none)

    def validate(self, module: nn.Module, found: RMSNormMatch) -> Refusal | None:
        if forward_replaced(module):
            # transformers' tensor-parallel plan sums a per-head norm's weight gradient over the ranks from
            # such a wrapper (``replicated_with_grad_allreduce``): the fused module would drop it.
            forward = module.__dict__["forward"]
            return Refusal(
                "rms_norm.wrapped",
                f"the instance's forward is replaced by {getattr(forward, '__qualname__', type(forward).__name__)} "
                "(a parallel plan's wrapper or another library's): the fused norm would not run it.",
            )
        for assumption in found.assumes:
            now = getattr(module, assumption.name, None)
            if not assumption.holds(now):
                return Refusal(
                    "rms_norm.specialised",
                    f"the traced path was taken for {assumption.describe()}, and this instance has "
                    f"{assumption.name} = {type(now).__name__ if isinstance(now, torch.Tensor) else repr(now)}: its "
                    "forward takes another path, which was not traced.",
                )
            if assumption.tensor and assumption.name != found.weight:
                return Refusal(
                    "rms_norm.specialised",
                    f"the forward branches on the tensor {assumption.name!r}, which is not the norm's weight.",
                )
        if found.group_attr is not None:
            size = getattr(module, found.group_attr, None)
            weight = module._parameters.get(found.weight) if found.weight is not None else None
            if type(size) is not int or size <= 0 or (weight is not None and weight.shape[-1] % size):
                return Refusal(
                    "rms_norm.groups", f"the group size {found.group_attr!r} is {size!r}, not a divisor of the width."
                )
        eps = getattr(module, found.eps_attr, None)
        if type(eps) is not float:
            return Refusal("rms_norm.eps-not-float", f"eps attribute {found.eps_attr!r} is {eps!r}, not a float.")
        if found.weight is not None:
            weight = module._parameters.get(found.weight)
            if weight is None or weight.dim() != 1:
                return Refusal("rms_norm.weight-shape", f"{found.weight!r} is not a 1-D parameter of this instance.")
        return None

    def emitted_forward(self, found: RMSNormMatch, context: EditContext) -> cst.FunctionDef:
        """``return rms_norm(x, self.weight, self.eps, RMSNormSpec(...))``, docstring kept."""
        spec_cls = context.require("transfuse.ops", "RMSNormSpec")
        flags = ", ".join(f"{f.name}={getattr(found.spec, f.name)}" for f in dataclasses.fields(found.spec))
        weight = f"self.{found.weight}" if found.weight is not None else "None"
        if found.gate_first:
            op = context.require("transfuse.ops.rms_norm", "input_gated_rms_norm")
            groups = f"self.{found.group_attr}" if found.group_attr is not None else "None"
            call = (
                f"{op}({found.input}, {found.gate}, {weight}, self.{found.eps_attr}, {spec_cls}({flags}), "
                f"{found.activation!r}, {groups})"
            )
        elif found.gate is not None:
            op = context.require("transfuse.ops", "gated_rms_norm")
            call = f"{op}({found.input}, {found.gate}, {weight}, self.{found.eps_attr}, {spec_cls}({flags}), {found.activation!r})"
        else:
            op = context.require("transfuse.ops", "rms_norm")
            call = f"{op}({found.input}, {weight}, self.{found.eps_attr}, {spec_cls}({flags}))"
            if not found.assumes and not found.globals_none:
                # What ``ops.add_rms_norm`` needs to run this norm fused with the add before it.
                described = cst.parse_statement(
                    f"_transfuse_rms_norm = ({found.weight!r}, {found.eps_attr!r}, {spec_cls}({flags}))"
                ).with_changes(
                    leading_lines=[
                        cst.EmptyLine(indent=False),
                        comment_line("transfuse: this norm's weight, epsilon and rounding (for add_rms_norm)"),
                    ]
                )
                context.class_statements.append(described)
        body = [cst.parse_statement(f"return {call}")]
        comment = comment_line(f"transfuse: one fused op ({found.spec.describe()})")
        if found.assumes:
            check = context.require("transfuse.ops.layers", "check_assumptions")
            assumed = ", ".join(repr(tuple(a)) for a in found.assumes)
            body.insert(0, cst.parse_statement(f"{check}(self, ({assumed},))"))
            comment = comment_line(
                f"transfuse: one fused op ({found.spec.describe()}), for {', '.join(a.describe() for a in found.assumes)}"
            )
        body[0] = body[0].with_changes(leading_lines=[comment])
        node = context.source.node
        first = node.body.body[0] if node.body.body else None
        docstring = [first] if first is not None and m.matches(first, m.SimpleStatementLine([m.Expr(m.SimpleString())])) else []
        if found.globals_none:
            # The fused op for the path traced (those globals None); the original body otherwise.
            test = " and ".join(f"{name} is None" for _, name in found.globals_none)
            guarded = cst.If(test=cst.parse_expression(test), body=cst.IndentedBlock(body=body))
            rest = [s for s in node.body.body if s not in docstring]
            return node.with_changes(body=node.body.with_changes(body=[*docstring, guarded, *rest]))
        return node.with_changes(body=node.body.with_changes(body=[*docstring, *body]))

    def fuse(self, module: nn.Module, found: RMSNormMatch) -> Fused:
        weight = module._parameters[found.weight] if found.weight is not None else None
        eps, name = getattr(module, found.eps_attr), found.weight or "weight"
        assumes = found.assumes
        if found.gate is not None:
            group_size = getattr(module, found.group_attr) if found.group_attr is not None else None
            fused = layer("GatedRMSNorm")(
                weight, eps, found.spec, weight_name=name, activation=found.activation, assumes=assumes,
                gate_first=found.gate_first, group_size=group_size, optional_gate=found.optional_gate,
                eps_name=found.eps_attr,
            )  # fmt: skip
        else:
            fused = layer("RMSNorm")(weight, eps, found.spec, weight_name=name, assumes=assumes, eps_name=found.eps_attr)
        into = type(fused).__name__
        if found.globals_none:
            readers = tuple((_reader(type(module), namespace), name) for namespace, name in found.globals_none)
            fused.run_original_unless_none(readers, module)
            names = ", ".join(f"{mod}.{glob}" for mod, glob in found.globals_none)
            into += f" (branch taken for {names} None; the original forward runs if that changes)"
        _keep_scalars(module, fused)
        return Fused(replaced=("",), into=into, replacement=fused)


def _reader(cls: type, namespace: str):
    """A function of ``cls`` (or a base) whose globals are those of the module ``namespace``, or None:
    the fused layer reads the globals it checks through it."""
    for klass in cls.__mro__:
        for attr in vars(klass).values():
            function = inspect.unwrap(attr) if callable(attr) else None
            if getattr(function, "__globals__", {}).get("__name__") == namespace:
                return function
    return None


def _keep_scalars(module: nn.Module, fused: nn.Module) -> None:
    """The replaced module's public numbers, flags and names (``hidden_size``, ``norm_before_gate``)
    on the fused layer where it has no attribute of that name: code outside the module may read them
    (the ones its own forward read are the layer's: the epsilon, the group size, the assumptions)."""
    for key, number in vars(module).items():
        if key.startswith("_") or type(number) not in (int, float, bool, str) or hasattr(fused, key):
            continue
        setattr(fused, key, number)


@functools.cache
def _layer_own() -> frozenset[str]:
    """Attributes the fused layers hold themselves: an assumption cannot be kept under these names."""
    return frozenset(vars(GatedRMSNorm(None, 1e-6))) | frozenset(dir(GatedRMSNorm))


def _check_assumed(assumes) -> None:
    """The fused layer holds each assumed scalar attribute under its name and checks it per call."""
    for assumption in assumes:
        if assumption.name == "training":
            raise NoMatch(
                "rms_norm.control-flow",
                "the forward branches on self.training; the fused layer would compute one mode's path in both.",
            )
        if not assumption.tensor and assumption.name in _layer_own():
            raise NoMatch(
                "rms_norm.control-flow",
                f"the forward branches on self.{assumption.name}, a name the fused layer uses for its own state.",
            )


def _raises_only(cls: type, location: tuple[str, int] | None) -> bool:
    """The forward's ``if`` at ``location`` (a test of the input's shape) has no ``else`` and only
    raises: a check of the input, whose other arm is the traced path; every input it accepts takes
    that path."""
    source = method_source(unwrapped_forward(cls))
    if source is None or location is None or location[0] != source.filename:
        return False
    return any(source.line(node) == location[1] and raises_only(node) for node in m.findall(source.node, m.If()))


def _looks_like_a_norm(analysis: ClassAnalysis) -> bool:
    """Refusals are reported for classes named like a norm, that compute an inverse root, or the
    square root of a mean (``x / sqrt(mean(x²) + eps)``)."""
    if analysis.cls.__name__.endswith("RMSNorm"):
        return True
    for node in analysis.trace.graph.nodes:
        if is_op(node, "rsqrt", "rms_norm") or (is_op(node, "pow") and operand(node, 1) == -0.5):
            return True
        if is_op(node, "sqrt") and any(is_op(a, "mean") for a in ancestors(node)):
            return True
    return False


def _match_graph(analysis: ClassAnalysis) -> tuple[RMSNormMatch, fx.Node | None]:
    """What the graph shows, and for a norm gated before it, the node of the gate's product."""
    trace = analysis.trace
    if trace.partial:
        raise NoMatch("rms_norm.partial-trace", f"the forward could not be traced to the end ({trace.describe_stop()}).")
    guards = [g for g in trace.shape_guards if not _raises_only(analysis.cls, g.location)]
    if guards:
        guard = guards[0]
        raise NoMatch(
            "rms_norm.control-flow",
            f"the forward's control flow depends on the input's shape ({guard.describe()}); the fused op "
            "computes the traced path for every shape.",
            guard.node,
        )
    on_input = [g for g in trace.guards if _depends_on_input(g)]
    if on_input:
        guard = on_input[0]
        raise NoMatch(
            "rms_norm.value-branch",
            f"the forward branches on the traced value {guard.name}; another input (another dtype) may take "
            "another path, which the module replacement would not follow.",
            guard,
        )
    used = [p for p in trace.placeholders() if p.users]
    names = ", ".join(p.name for p in used) or "none"
    if len(used) not in (1, 2):
        raise NoMatch(
            "rms_norm.inputs",
            f"the forward reads {len(used)} tensor inputs ({names}); a norm takes one (a gated norm two).",
            used[1] if len(used) > 1 else None,
        )
    x = used[0]
    result = trace.output.args[0]
    if not isinstance(result, fx.Node):
        raise NoMatch("rms_norm.output", "the forward does not return a single tensor.")
    matched: set[fx.Node] = set()
    product = None
    if len(used) == 2:
        try:
            found = _match_gated(result, x, used[1], matched)
        except NoMatch as after:
            try:
                matched = set()
                found, product = _match_input_gated(result, x, used[1], matched)
            except NoMatch as before:
                raise NoMatch(
                    "rms_norm.inputs",
                    f"the forward reads two tensor inputs ({names}), and is not a gated norm: not "
                    f"rms_norm(x) * act({used[1].name}) in float32, cast back ({after.reason}), nor gated before "
                    f"the norm, rms_norm(x.float() * act({used[1].name}.float())) ({before.reason})",
                    before.node or after.node,
                ) from None
    else:
        found = _match_result(result, x, matched)
    extra = [
        n
        for n in trace.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
        and n not in matched
        and not _is_dtype_read(n)
        and not _is_attribute_arithmetic(n)
    ]
    if extra:
        raise NoMatch(
            "rms_norm.extra-compute",
            f"the forward computes more than the norm ({op_name(extra[0]) or extra[0].op} at {extra[0].name}).",
            extra[0],
        )
    return found, product


def _depends_on_input(node: fx.Node) -> bool:
    """Whether a node was computed from the forward's inputs (not only from ``self``'s attributes,
    on which analyses are specialised, and which the source check covers)."""
    seen, pending = set(), [node]
    while pending:
        current = pending.pop()
        if current.op == "placeholder" and current.name != "self":
            return True
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                pending.append(parent)
    return False


def _is_attribute_arithmetic(node: fx.Node) -> bool:
    """A Python scalar computed from ``self``'s attributes alone (a branch's test, ``self.k == 2``):
    no tensor; where such a value reaches the norm, the op that reads it is what is matched."""
    return not isinstance(value(node), torch.Tensor) and not _depends_on_input(node)


def _is_dtype_read(node: fx.Node) -> bool:
    return is_op(node, "getattr") and node.args[1] == "dtype"


def _match_result(result: fx.Node, x: fx.Node, matched: set[fx.Node]) -> RMSNormMatch:
    core, outer = _peel(result, matched)
    cast_output = _casts_to_input(outer, x, "the result")
    if is_op(core, "rms_norm"):
        return _match_builtin(core, x, matched, cast_output)
    weight, normed = _split_weight(core, matched)
    normed, middle = _peel(normed, matched)
    if not _is_norm_product(normed) and any(_is_inverse_root(n) for n in x.graph.nodes):
        raise NoMatch(
            "rms_norm.trailing-compute",
            f"the forward computes {op_name(normed) or normed.op} on the normalised value before returning it.",
            normed,
        )
    cast_before_weight = _casts_to_input(middle, x, "the normalised value")
    if weight is None and cast_before_weight:
        cast_output, cast_before_weight = True, False  # one cast at the end either way
    form, eps_attr = _match_normalisation(normed, x, matched)
    name, offset, weight_fp32 = weight or (None, False, False)
    spec = RMSNormSpec(form.upcast, cast_before_weight, offset, weight_fp32, cast_output, form.promote, form.divide)
    return RMSNormMatch(spec, name, eps_attr, x.target)


# The gated form's parameters, as the fused layer's forward names them (callers may pass keywords).
_GATED_SIGNATURE = ("hidden_states", "gate")


def _activation_factor(product: fx.Node, gate: fx.Node) -> tuple[str | None, fx.Node | None, fx.Node | None]:
    """(activation, its factor, the other factor) of a product one of whose factors is an activation
    of the gate in float32 (the second factor tried first); (None, None, None) otherwise."""
    a, b = operands(product)[:2] if is_op(product, "mul") else (None, None)
    for act, other in ((b, a), (a, b)):
        activation = _gate_activation(act, gate)
        if activation is not None:
            return activation, act, other
    return None, None, None


def _match_gated(result: fx.Node, x: fx.Node, gate: fx.Node, matched: set[fx.Node]) -> RMSNormMatch:
    """``(norm(x) * act(gate.float())).to(x.dtype)``, the norm any form ``_match_result`` knows."""
    core, outer = _peel(result, matched)
    activation, act, normed = _activation_factor(core, gate)
    if activation is None:
        raise NoMatch(
            "rms_norm.gate-form",
            f"neither factor of the last product is an activation ({', '.join(GATE_ACTIVATIONS)}) of the gate in "
            "float32 (a gate multiplied in before the norm, or grouped, is another form).",
            core,
        )
    if not _casts_to_input(outer, x, "the gated product"):
        raise NoMatch("rms_norm.gate-rounding", "the gated product is not cast back to the input dtype.", result)
    if (x.target, gate.target) != _GATED_SIGNATURE:
        raise NoMatch(
            "rms_norm.signature",
            f"the inputs are named ({x.target}, {gate.target}), not {_GATED_SIGNATURE}; callers passing them by "
            "keyword would not reach the fused layer.",
        )
    matched.add(core)
    _mark_chain(act, gate, matched)
    found = _match_result(normed, x, matched)  # its own casts are its spec's: the gate reads its output
    return dataclasses.replace(found, gate=gate.target, activation=activation)


def _match_input_gated(
    result: fx.Node, x: fx.Node, gate: fx.Node, matched: set[fx.Node]
) -> tuple[RMSNormMatch, fx.Node]:
    """``w * norm(x.float() * act(gate.float()))`` with the norm over the last dimension or over groups
    of it (``view(..., G, size)``, normalised, viewed back), the weight with any rounding
    ``_match_result`` knows → (the match, the gate's product)."""
    core, outer = _peel(result, matched)
    cast_output = _casts_to_input(outer, x, "the result")
    weight, normed = _split_weight(core, matched)
    normed, middle = _peel(normed, matched)
    cast_before_weight = _casts_to_input(middle, x, "the normalised value")
    if weight is None and cast_before_weight:
        cast_output, cast_before_weight = True, False  # one cast at the end either way
    normed, grouped = _ungroup(normed, matched)
    value_normed, eps_attr, form = _normalised_value(normed, matched)
    if form.promote or form.divide:
        raise NoMatch(
            "rms_norm.gate-form",
            "a norm gated before it is normalised as v * rsqrt(mean(v²) + eps), with v squared as it is multiplied.",
            normed,
        )
    group_attr = None
    if grouped:
        value_normed, group_attr = _grouped_view(value_normed, matched)
    product = value_normed
    activation, act, xc = _activation_factor(product, gate)
    if activation is None:
        raise NoMatch(
            "rms_norm.gate-form",
            f"the value normalised is not the input times an activation ({', '.join(GATE_ACTIVATIONS)}) of the "
            "gate in float32.",
            product,
        )
    base, casts = peel_casts(xc) if isinstance(xc, fx.Node) else (None, [])
    if base is not x or len(casts) != 1 or casts[0].dtype != torch.float32:
        raise NoMatch("rms_norm.gate-rounding", "the input is not cast to float32 (once) before the gate multiplies it.", xc)
    if (x.target, gate.target) != _GATED_SIGNATURE:
        raise NoMatch(
            "rms_norm.signature",
            f"the inputs are named ({x.target}, {gate.target}), not {_GATED_SIGNATURE}; callers passing them by "
            "keyword would not reach the fused layer.",
        )
    matched.add(product)
    _mark_chain(act, gate, matched)
    _mark_chain(xc, base, matched)
    name, offset, weight_fp32 = weight or (None, False, False)
    spec = RMSNormSpec(True, cast_before_weight, offset, weight_fp32, cast_output)
    found = RMSNormMatch(
        spec, name, eps_attr, x.target, gate=gate.target, activation=activation, gate_first=True, group_attr=group_attr
    )
    return found, product


def _is_view(node) -> bool:
    return is_op(node, "view", "reshape")


def _ungroup(node: fx.Node, matched: set[fx.Node]) -> tuple[fx.Node, bool]:
    """``v.view(shape)`` merging v's last two dimensions back into one → (v, True); else (node, False)."""
    if not _is_view(node):
        return node, False
    inner = node.args[0]
    before, after = getattr(value(inner), "shape", None), getattr(value(node), "shape", None)
    if before is None or after is None or len(before) < 2 or tuple(after) != (*before[:-2], before[-2] * before[-1]):
        raise NoMatch("rms_norm.groups", "the normalised value is reshaped other than back from groups.", node)
    matched.add(node)
    return inner, True


def _grouped_view(node: fx.Node, matched: set[fx.Node]) -> tuple[fx.Node, str]:
    """``v.view(*v.shape[:-1], G, size)``, ``size`` an int attribute of the module → (v, its name)."""
    if not _is_view(node):
        raise NoMatch("rms_norm.groups", "the value viewed back from groups is not a view of the gated input.", node)
    inner = node.args[0]
    sizes = node.args[1:] if len(node.args) > 2 else tuple(node.args[1])
    before, after = getattr(value(inner), "shape", None), getattr(value(node), "shape", None)
    if before is None or after is None or tuple(after) != (*before[:-1], after[-2], after[-1]):
        raise NoMatch("rms_norm.groups", "the view into groups does not split the last dimension alone.", node)
    size = sizes[-1] if sizes else None
    attr = size.meta.get("self_attr") if isinstance(size, fx.Node) else None
    if attr is None or type(size.meta.get("val")) is not int:
        raise NoMatch(
            "rms_norm.groups",
            "the group size is not read from an int attribute of the module, so it cannot be read per instance.",
            node,
        )
    matched.add(node)
    return inner, attr


def _gate_is_optional(found: RMSNormMatch, product: fx.Node | None, optional) -> bool:
    """Whether the forward's one test of an optional input is ``if gate is not None: v = v * <...>``
    guarding exactly the gate's product: then without a gate the norm of the input alone runs."""
    param, branch, source = optional[0]
    where = f"{source.node.name.value} branches on whether {param} is None at line {source.line(branch)}"
    if len(optional) > 1 or not found.gate_first or param != found.gate:
        raise NoMatch("rms_norm.control-flow", f"{where}; the trace shows the path with it only.")
    body = branch.body.body if isinstance(branch.body, cst.IndentedBlock) else ()
    statement = body[0] if len(body) == 1 else None
    assign = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1 else None
    proved = (
        branch.orelse is None
        and m.matches(branch.test, m.Comparison(comparisons=[m.ComparisonTarget(operator=m.IsNot())]))
        and isinstance(assign, cst.Assign)
        and len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
        and m.matches(assign.value, m.BinaryOperation(left=m.Name(assign.targets[0].target.value), operator=m.Multiply()))
        and product.meta.get("location") == (source.filename, source.line(statement))
    )
    if not proved:
        raise NoMatch(
            "rms_norm.control-flow",
            f"{where}, and its body is not only the gate's product (v = v * act(gate)); the trace shows the path "
            "with it only.",
        )
    return True


def _gate_activation(node, gate: fx.Node) -> str | None:
    """The GATE_ACTIVATIONS name of ``act(gate.to(float32))``, else None."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    inner, casts = peel_casts(node.args[0]) if isinstance(node.args[0], fx.Node) else (None, [])
    if inner is not gate or len(casts) != 1 or casts[0].dtype != torch.float32:
        return None
    name = op_name(node)
    if name == "gelu":
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(operand(node, 1, "approximate", "none"))
    if name in ("silu", "sigmoid") and len(node.args) == 1 and not node.kwargs.get("inplace", False):
        return name
    return None


def _peel(node: fx.Node, matched: set[fx.Node]) -> tuple[fx.Node, list[Cast]]:
    inner, casts = peel_casts(node)
    walk = node
    while walk is not inner:
        matched.add(walk)
        walk = walk.args[0]
    return inner, casts


def _casts_to_input(casts: list[Cast], x: fx.Node, what: str) -> bool:
    """True for one cast back to the input's dtype, False for none; anything else is refused."""
    if not casts:
        return False
    if len(casts) == 1 and casts[0].like is x:
        return True
    raise NoMatch("rms_norm.cast", f"{what} is cast to {', '.join(c.describe() for c in casts)}, not to the input dtype.")


def _split_weight(node: fx.Node, matched: set[fx.Node]) -> tuple[tuple[str, bool, bool] | None, fx.Node]:
    """``w * n`` or ``(1 + w) * n`` → ((weight name, offset, weight_fp32), n); else (None, node)."""
    if is_op(node, "mul"):
        a, b = operands(node)[:2]
        for w_side, other in ((a, b), (b, a)):
            weight = _weight_term(w_side, matched)
            if weight is not None:
                matched.add(node)
                return weight, other
    return None, node


def _param_name(node) -> str | None:
    if isinstance(node, fx.Node) and node.op == "get_attr" and "." not in node.target:
        if isinstance(value(node), torch.Tensor) and "self_attr" not in node.meta:
            return node.target
    return None


def _peel_weight(node: fx.Node) -> tuple[fx.Node, list[Cast]]:
    """The value under the casts and device moves of ``node`` (``self.weight.to(x.device)``: a move
    to the input's device, which the fused layer's weight is on already), and the casts."""
    inner, casts = peel_casts(node)
    while _moves_to_a_device(inner):
        inner, more = peel_casts(inner.args[0])
        casts += more
    return inner, casts


def _moves_to_a_device(node) -> bool:
    """``t.to(device)``: a copy to a device (the tracer reads ``x.device`` as a constant), no cast."""
    return (
        op_name(node) == "to" and len(node.args) == 2 and isinstance(node.args[1], torch.device)
        and set(node.kwargs) <= {"non_blocking"}
    )  # fmt: skip


def _weight_term(node, matched: set[fx.Node]) -> tuple[str, bool, bool] | None:
    if not isinstance(node, fx.Node):
        return None
    inner, casts = _peel_weight(node)
    name = _param_name(inner)
    if name is not None:
        _require_fp32_casts(casts, node)
        _mark_chain(node, inner, matched)
        return name, False, bool(casts)
    if is_op(inner, "add"):
        a, b = operands(inner)[:2]
        for one, w in ((a, b), (b, a)):
            if isinstance(one, (int, float)) and one == 1 and isinstance(w, fx.Node):
                w_inner, w_casts = _peel_weight(w)
                if _param_name(w_inner) is None:
                    continue
                if casts:
                    raise NoMatch("rms_norm.weight-form", "(1 + weight) is cast after the offset is added.", node)
                _require_fp32_casts(w_casts, w)
                _mark_chain(w, w_inner, matched)
                matched.add(inner)
                return _param_name(w_inner), True, bool(w_casts)
    return None


def _require_fp32_casts(casts: list[Cast], node: fx.Node) -> None:
    if any(c.dtype != torch.float32 for c in casts):
        raise NoMatch("rms_norm.cast", f"the weight is cast to {casts[0].describe()}, not float32.", node)


def _mark_chain(top: fx.Node, bottom: fx.Node, matched: set[fx.Node]) -> None:
    walk = top
    while walk is not bottom:
        matched.add(walk)
        walk = walk.args[0]
    matched.add(bottom)


@dataclass(frozen=True)
class _Form:
    """How the value is normalised: in float32 (``upcast``); the uncast input times the float32
    inverse root (``promote``); divided by the square root (``divide``)."""

    upcast: bool
    promote: bool = False
    divide: bool = False


def _match_normalisation(node: fx.Node, x: fx.Node, matched: set[fx.Node]) -> tuple[_Form, str]:
    """``xc * rsqrt(mean(xc², -1, keepdim=True) + eps)`` (or ``xc / sqrt(...)``) with ``xc`` the (cast)
    input, or the uncast input times the inverse root of its float32 copy's mean square → (form, eps attr)."""
    xc, eps_attr, form = _normalised_value(node, matched)
    base, casts = peel_casts(xc)
    if base is not x:
        raise NoMatch("rms_norm.form", "the normalised value is not the module's input.", xc)
    if any(c.dtype != torch.float32 for c in casts):
        raise NoMatch("rms_norm.cast", f"the input is cast to {casts[0].describe()} before normalising.", xc)
    _mark_chain(xc, base, matched)
    promote = form.promote and not casts  # squared in float32 and multiplied as float32 already: plain upcast
    return dataclasses.replace(form, upcast=bool(casts) or form.promote, promote=promote), eps_attr


def _normalised_value(node: fx.Node, matched: set[fx.Node]) -> tuple[fx.Node, str, _Form]:
    """``v * rsqrt(mean(s², -1, keepdim=True) + eps)`` or ``v / sqrt(...)``, ``s`` either ``v`` or ``v``
    cast to float32 → (v, eps attr, the form)."""
    divide = is_op(node, "div") and _is_root(operand(node, 1))
    if is_op(node, "sub") or (is_op(node, "div") and not divide):
        raise NoMatch("rms_norm.form", f"the norm is computed with {op_name(node)}, not as x * rsqrt(...).", node)
    if not is_op(node, "mul") and not divide:
        raise NoMatch("rms_norm.form", f"the result is {op_name(node) or node.op}, not x * rsqrt(mean(x²) + eps).", node)
    a, b = operands(node)[:2]
    inv, xc = (b, a) if divide or _is_inverse_root(b) else (a, b)
    if not divide and not _is_inverse_root(inv):
        raise NoMatch("rms_norm.form", "neither factor of the final product is rsqrt(...) or (...) ** -0.5.", node)
    total = operand(inv, 0)
    eps_attr, mean = _split_eps(total)
    square_of = _match_mean_square(mean, xc)
    if is_op(xc, "sub") or is_op(square_of, "sub"):
        raise NoMatch("rms_norm.mean-subtracted", "the input has its mean subtracted: this is LayerNorm, not RMSNorm.", xc)
    promote = _is_float32_copy(square_of, xc)
    if square_of is not xc and not promote:
        raise NoMatch("rms_norm.form", "the value squared is not the value normalised, nor its float32 copy.", node)
    if promote:
        _mark_chain(square_of, xc, matched)
    matched.update({node, inv, total, mean})
    matched.add(mean.args[0])
    return xc, eps_attr, _Form(upcast=False, promote=promote, divide=divide)


def _is_float32_copy(node, of: fx.Node) -> bool:
    """``of`` cast to float32 (``of.to(torch.float32)``, ``of.float()``), once or more."""
    walk, casts = node, 0
    while isinstance(walk, fx.Node) and walk is not of:
        cast = cast_of(walk)
        if cast is None or cast.dtype != torch.float32:
            return False
        walk, casts = walk.args[0], casts + 1
    return walk is of and casts > 0


def _is_root(node) -> bool:
    return is_op(node, "sqrt") or (is_op(node, "pow") and operand(node, 1, "exponent") == 0.5)


def _is_norm_product(node) -> bool:
    return is_op(node, "mul") and any(_is_inverse_root(o) for o in operands(node)[:2])


def _is_inverse_root(node) -> bool:
    return is_op(node, "rsqrt") or (is_op(node, "pow") and operand(node, 1, "exponent") == -0.5)


def _split_eps(node) -> tuple[str, fx.Node]:
    if not is_op(node, "add"):
        raise NoMatch("rms_norm.eps-source", "eps is not added to the mean of squares.", node)
    a, b = operands(node)[:2]
    for eps, mean in ((b, a), (a, b)):
        if isinstance(mean, fx.Node) and is_op(mean, "mean", "sum"):
            attr = eps.meta.get("self_attr") if isinstance(eps, fx.Node) else None
            if attr is None:
                raise NoMatch(
                    "rms_norm.eps-source",
                    f"eps ({eps if not isinstance(eps, fx.Node) else eps.name}) is not read from a float attribute "
                    "of the module, so it cannot be read per instance.",
                    node,
                )
            return attr, mean
    raise NoMatch("rms_norm.form", "the inverse root is not taken of mean(x²) + eps.", node)


def _match_mean_square(mean: fx.Node, x: fx.Node) -> fx.Node:
    """The value whose square is averaged over the last dimension."""
    if not is_op(mean, "mean"):
        raise NoMatch("rms_norm.reduction", f"the squares are reduced with {op_name(mean)}, not mean.", mean)
    dim = operand(mean, 1, "dim")
    keepdim = operand(mean, 2, "keepdim", False)
    squared = operand(mean, 0)
    ndim = getattr(value(x), "ndim", None)
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    if len(dims) != 1 or not (dims[0] == -1 or (ndim is not None and dims[0] == ndim - 1)):
        raise NoMatch("rms_norm.reduce-dim", f"the mean is taken over dim={dim}, not the last dimension.", mean)
    if keepdim is not True:
        raise NoMatch("rms_norm.reduce-dim", "the mean does not keep its dimension (keepdim=True).", mean)
    if is_op(squared, "pow") and operand(squared, 1, "exponent") == 2:
        return operand(squared, 0)
    if is_op(squared, "square"):
        return operand(squared, 0)
    if is_op(squared, "mul") and operand(squared, 0) is operand(squared, 1):
        return operand(squared, 0)
    if is_op(squared, "sub"):
        return squared
    raise NoMatch("rms_norm.form", "the mean is not of a square.", mean)


def _match_builtin(node: fx.Node, x: fx.Node, matched: set[fx.Node], cast_output: bool) -> RMSNormMatch:
    """``F.rms_norm(x, (hidden,), weight, eps)``: float32 inside, weight multiply in float32, cast last."""
    shape = operand(node, 1, "normalized_shape")
    weight = operand(node, 2, "weight")
    eps = operand(node, 3, "eps")
    if operand(node, 0) is not x:
        raise NoMatch("rms_norm.form", "F.rms_norm is not applied to the module's input.", node)
    ndim_shape = len(shape) if isinstance(shape, (tuple, list)) else 1
    if ndim_shape != 1:
        raise NoMatch("rms_norm.reduce-dim", f"F.rms_norm normalises over {ndim_shape} dimensions, not the last one.", node)
    attr = eps.meta.get("self_attr") if isinstance(eps, fx.Node) else None
    if attr is None:
        raise NoMatch("rms_norm.eps-source", f"eps ({eps!r}) is not a float attribute of the module.", node)
    name = _param_name(weight) if weight is not None else None
    if weight is not None and name is None:
        raise NoMatch("rms_norm.weight-form", "the weight of F.rms_norm is not a parameter of the module.", node)
    matched.add(node)
    if weight is not None:
        matched.add(weight)
    spec = RMSNormSpec(upcast=True, cast_before_weight=False, offset=False, weight_fp32=True, cast_output=True)
    return RMSNormMatch(spec, name, attr, x.target)
