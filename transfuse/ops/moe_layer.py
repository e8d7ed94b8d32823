"""The fused mixture-of-experts layer: ``route(linear(x)) → experts(x) [+ Σ σ(g(x))·shared(x)] [+ b]`` in two ops.

``MoE`` takes the place of a model's block and keeps the block's children (the router,
the experts' holder, the shared experts and their gates) as its own, under their own
names: ``state_dict`` keys do not change and the parameters are the same objects. A
``MoEPlan`` says what each child and tensor is for; the layer knows nothing about where
the plan came from.

Routing is computed here (``F.linear`` with the router's own weight and casts, then
``moe_route``) when the plan has a ``RoutingSpec``; otherwise, or when hooks observe the
router (transformers records router logits with forward hooks), the router child is
called as is and its outputs are used. ``StackedExperts`` holds per-expert GLU weights
stacked into the packed layout, saved and loaded under the original per-expert keys.

Where the experts' child has hooks (its own or global ones), the layer runs the block's forward as
written instead, on its own children, so that the hooks run as in the original.

``moe_block(module, x, plan, top_k=...)`` computes the same for any module holding those
children: an emitted modeling file's block calls it from its own forward. A plan's ``assumes``
are attribute values the traced code branched on; a layer whose attributes differ raises.

Where its caller asked for it (``graph_small_batches``: ``transfuse.decode_steps`` and
``transfuse.compile`` do), the layer called eagerly on a GPU, in eval mode, with up to
``DECODE_GRAPH_TOKENS`` tokens replays a CUDA graph of its own forward (``transfuse.ops.graphs``),
where the host cost of issuing the routing and expert kernels from Python would otherwise exceed
their GPU time. The layer never captures one unasked.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .graphs import SmallBatchGraphs
from .hooks import watched
from .moe import ExpertsSpec, RoutingSpec, moe_experts, moe_experts_fp8, moe_route
from .sharding import ExpertShards, expert_shards, is_sharded, local_tensor

__all__ = [
    "ExpertNumbers", "ExpertsPlan", "LogitsPlan", "MoE", "MoEPlan", "RouterPlan", "RoutingNumbers", "SharedPlan",
    "StackedExperts", "moe_block", "moe_block_applies",
]  # fmt: skip

# Roles of the values a block reads or returns.
TOKENS, INPUT, HIDDEN, LOGITS, WEIGHTS, IDS = "tokens", "input", "hidden", "logits", "weights", "ids"


def router_output(index) -> str:
    """The role of output ``index`` of a router called as is (``RouterPlan.spec`` None), returned as is."""
    return f"router output {index}"


@dataclass(frozen=True)
class LogitsPlan:
    """``F.linear`` of the tokens with the router weight (and bias), with the casts the model makes
    (``input_like_weight``: the tokens cast to the weight's dtype)."""

    weight: str
    bias: str | None = None
    input_fp32: bool = False
    weight_fp32: bool = False
    output_fp32: bool = False
    input_like_weight: bool = False

    def logits(self, layer: nn.Module, tokens: Tensor) -> Tensor:
        weight = _tensor(layer, self.weight)
        bias = _tensor(layer, self.bias) if self.bias is not None else None
        if self.input_fp32:
            tokens = tokens.float()
        if self.input_like_weight:
            tokens = tokens.to(weight.dtype)
        if self.weight_fp32:
            weight = weight.float()
        out = F.linear(tokens, weight, bias)
        return out.float() if self.output_fp32 else out


@dataclass(frozen=True)
class RouterPlan:
    """Where the routing weights and expert ids come from.

    module: the router child; called with the tokens (``input`` False) or the block's input.
    extra: tensors of the layer itself passed to the router after the tokens (a correction bias).
    returns: roles of the module's outputs in order (a single role: it returns one tensor).
    logits: how to compute the logits here (None: they are the module's "logits" output).
    spec: how logits become weights and ids (None: the module's "weights" and "ids" outputs).
    weights_dtype: the weights are cast to the dtype of "logits" or "input", to "float32", or not (None).
    train_as_module: in training mode the module is called (its forward differs there).
    """

    module: str
    returns: tuple[str | None, ...]
    input: bool = False
    extra: tuple[str, ...] = ()
    logits: LogitsPlan | None = None
    spec: RoutingSpec | None = None
    correction_bias: str | None = None
    weights_dtype: str | None = None
    train_as_module: bool = False


@dataclass(frozen=True)
class ExpertsPlan:
    """The packed expert tensors (paths below the layer) and their layout.

    weights_on_input: each routing weight scales its token's row before the expert, whose output
        is then added unweighted (llama4's experts run on rows scaled by their scores).
    w13_scale, w2_scale, block: block-FP8 experts: w13 and w2 are e4m3 with these per-block scales, the
        block size read from the attribute at ``block`` on each call (``moe_experts_fp8``).
    """

    w13: str
    w2: str
    spec: ExpertsSpec
    b13: str | None = None
    b2: str | None = None
    weights_on_input: bool = False
    # Block-FP8 experts (``moe_experts_fp8``): the scales of w13 and w2, and the attribute holding the block.
    w13_scale: str | None = None
    w2_scale: str | None = None
    block: str | None = None


@dataclass(frozen=True)
class SharedPlan:
    """A shared expert added to the routed output, optionally scaled by ``sigmoid(gate(x))``.

    router_outputs: (keyword, or None for the next positional argument; index of the router's output)
        of what the module is called with after the tokens (a weight the router computes for it).
    """

    module: str
    input: bool = False
    gate: str | None = None
    gate_input: bool = False
    router_outputs: tuple[tuple[str | None, int], ...] = ()


@dataclass(frozen=True)
class MoEPlan:
    """What the layer computes; ``outputs`` are the roles of what it returns, in order."""

    router: RouterPlan
    experts: ExpertsPlan
    shared: tuple[SharedPlan, ...] = ()
    outputs: tuple[str, ...] = (HIDDEN,)
    returns_tuple: bool = False
    flat_output: bool = False
    train_error: str | None = None
    # (dotted path below the layer, value): attributes the plan was made for (the traced code
    # branched on them); a layer whose attributes now differ raises instead of computing another path.
    assumes: tuple[tuple[str, bool | int | float | str | None], ...] = ()
    # The routed output times a number (``ExpertNumbers.routed_scale``) before the shared experts are added.
    routed_scaled: bool = False
    # The routed and shared outputs added in float32, the sum cast back to the input's dtype.
    combine_fp32: bool = False
    # A child called on the sum last (a norm), on it flattened to [tokens, hidden] when ``post_flat``,
    # else shaped like the input.
    post: str | None = None
    post_flat: bool = False
    # A 1-D tensor of the layer added to the sum (after the shared experts, before ``post``).
    bias: str | None = None

    def block_tensors(self) -> set[str]:
        """The tensors the layer holds itself (not below a child) that it reads."""
        r = self.router
        return {p for p in (*r.extra, r.correction_bias, self.bias) if p is not None and "." not in p}

    def describe(self) -> str:
        routing = (
            self.router.spec.describe() if self.router.spec is not None else f"router {self.router.module!r} as is"
        )
        parts = [routing, self.experts.spec.describe()]
        if self.experts.weights_on_input:
            parts.append("weights on the input")
        if self.routed_scaled:
            parts.append("routed output scaled")
        if self.shared:
            parts.append(f"{len(self.shared)} shared{' added in float32' if self.combine_fp32 else ''}")
        if self.bias is not None:
            parts.append(f"plus {self.bias}")
        if self.post is not None:
            parts.append(f"then {self.post}")
        return "; ".join(parts)


def _split(path: str) -> tuple[str, ...]:
    # Not memoised: compiled code traces this, and Dynamo warns of every cache wrapper it meets.
    return tuple(path.split("."))


# Up to this many tokens an eager call on a GPU replays a CUDA graph of the layer (``graphs.py``): at
# one token the Qwen3-MoE block's host work is ~3x its GPU time, 163 against 48 us, and a replay's
# 32 us (benchmarks/results/h200_decode_graphs_2026-11-30.txt).
DECODE_GRAPH_TOKENS = 16
# Graphs per layer, outside the module so that copying or pickling a model never copies them.
_LAYER_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensor(layer: nn.Module, path: str) -> Tensor:
    """The tensor at a dotted path under ``layer``, resolved on every call (weights may be replaced),
    through the module dicts directly: ``get_submodule`` costs microseconds a call in a decode step."""
    *owners, name = _split(path)
    module = layer
    try:
        for part in owners:
            module = module._modules[part]
        found = module._parameters.get(name)
        if found is None:
            found = module._buffers.get(name)
        return found if found is not None else getattr(module, name)
    except (KeyError, AttributeError):
        raise TypeError(
            f"The fused mixture-of-experts layer reads {path}, but {'.'.join(owners) or 'the layer'} is now a "
            f"{type(module).__name__}: something replaced its modules after the rewrite (PEFT's adapters on packed "
            "experts, say), which the fused layer does not compute. Rewrite the model without the 'moe' fusion "
            "to use them."
        ) from None


@dataclass
class RoutingNumbers:
    """The instance's routing numbers (read from its attributes by whoever builds the layer)."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renorm_eps: float | None = None
    renorm_min: float | None = None
    scale: float | None = None


@dataclass
class ExpertNumbers:
    alpha: float = 1.0
    limit: float = math.inf
    routed_scale: float = 1.0


class MoE(nn.Module):
    """A mixture-of-experts block computed with ``moe_route`` and ``moe_experts``.

    children: the block's children under their own names (their parameters are not copied).
    routing: the numbers of a plan with a ``RoutingSpec`` (None when the router is called as is).
    tensors: the block's own parameters and buffers that the plan reads, kept under their names;
        ``persistent`` says which buffers are in the state dict (all, when not given).
    kernels: the names of the model's experts implementations that compute the function this layer
        computes (its builder knows them): a switch to one of them keeps the layer.
    graph_small_batches: whether eager calls with a few tokens on a GPU replay CUDA graphs; off until
        the caller turns it on.
    """

    __transfuse_layer__ = True

    def __init__(
        self,
        children: dict[str, nn.Module],
        plan: MoEPlan,
        routing: RoutingNumbers | None,
        experts: ExpertNumbers | None = None,
        tensors: dict[str, Tensor] | None = None,
        persistent: dict[str, bool] | None = None,
        *,
        kernels: frozenset[str] = frozenset(),
    ):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name, tensor in (tensors or {}).items():
            if isinstance(tensor, nn.Parameter):
                self.register_parameter(name, tensor)
            else:
                self.register_buffer(name, tensor, persistent=(persistent or {}).get(name, True))
        self.plan = plan
        self.routing = routing
        self.expert_numbers = experts or ExpertNumbers()
        # transformers' experts implementation (config._experts_implementation) when the layer was
        # made. transformers' own implementations are kernels for one function, and the layer is
        # another (moe_experts): a switch between them (generate itself switches grouped_mm to
        # batched_mm for decoding on GPUs) keeps the layer's. One registered from outside
        # transformers may compute something else, and the layer refuses to run under it.
        self._experts_config = None
        self.experts_implementation = None
        self._kernels = kernels
        self.graph_small_batches = False
        # Whether the ranks sharing out the experts hold the same tokens (expert parallelism), as the fuser
        # read it from the model's distributed configuration; None: unknown (``ExpertShards``).
        self.shared_batch: bool | None = None
        self.__dict__["_block"] = None  # the block this layer took the place of (``keep_block``)
        for child in children.values():
            implementation = getattr(getattr(child, "config", None), "_experts_implementation", None)
            if implementation is not None:
                self._experts_config, self.experts_implementation = child.config, implementation
                break

    def forward(self, hidden_states: Tensor, *unused, **unused_kwargs):
        config = self._experts_config
        if config is not None:
            current = config._experts_implementation
            if current != self.experts_implementation and current not in self._kernels:
                raise RuntimeError(
                    f"The experts implementation is now {current!r} (set_experts_implementation), which is "
                    f"not one of transformers' own, but this fused mixture-of-experts layer computes the "
                    f"experts with transfuse's moe_experts, which took the place of "
                    f"{self.experts_implementation!r} when the model was rewritten. Set it back, or rewrite "
                    "the model without the 'moe' fusion to choose the experts implementation."
                )
        if experts_watched(self, self.plan) or not _computable(self, self.plan):
            return self._as_written(hidden_states, *unused, **unused_kwargs)
        return _block_forward(self, hidden_states, self.plan, self.routing, self.expert_numbers)

    def keep_block(self, block: nn.Module) -> None:
        """Keep the block this layer took the place of (it shares the layer's children and tensors), to
        run its forward as written while the experts' module has hooks (``experts_watched``)."""
        self.__dict__["_block"] = block

    def _as_written(self, hidden_states: Tensor, *args, **kwargs):
        """The block's own forward, on this layer's children, tensors and mode: the experts' module is
        called as the original called it, and its hooks run."""
        block = self._block
        if block is None:
            experts = self.plan.experts.w13.rpartition(".")[0]
            raise RuntimeError(
                f"A hook on {experts} (or one registered for every module) would not run: this fused "
                "mixture-of-experts layer computes per-expert modules stacked into one tensor and never calls "
                "them. Remove the hook, or rewrite the model without the 'moe' fusion to hook its experts."
            )
        block._modules.update(self._modules)
        block._parameters.update(self._parameters)
        block._buffers.update(self._buffers)
        block.training = self.training
        return block.forward(hidden_states, *args, **kwargs)

    def _forward(self, hidden_states: Tensor):
        """The layer's computation, never through a CUDA graph."""
        return _block_compute(self, hidden_states, plan=self.plan, routing=self.routing, numbers=self.expert_numbers)

    def _route(self, hidden_states: Tensor, tokens: Tensor):
        return _block_route(self, self.plan.router, self.routing, hidden_states, tokens)[:3]

    def extra_repr(self) -> str:
        top_k = f"top_k={self.routing.top_k}, " if self.routing is not None else ""
        return top_k + self.plan.describe()


def moe_block(
    layer: nn.Module,
    hidden_states: Tensor,
    plan: MoEPlan,
    *,
    top_k: int | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renorm_eps: float | None = None,
    renorm_min: float | None = None,
    scale: float | None = None,
    alpha: float = 1.0,
    limit: float = math.inf,
    routed_scale: float = 1.0,
):
    """What ``MoE`` computes, for a module that keeps the block's own children: the forward an
    emitted modeling file gives a fused block (``self`` as ``layer``, its plan a class attribute,
    the numbers read from its attributes). ``top_k`` is needed when the plan routes (``spec``)."""
    routing = None
    if plan.router.spec is not None:
        if top_k is None:
            raise TypeError("moe_block: a plan that routes needs top_k.")
        routing = RoutingNumbers(top_k, n_group, topk_group, renorm_eps, renorm_min, scale)
    return _block_forward(layer, hidden_states, plan, routing, ExpertNumbers(alpha, limit, routed_scale))


def moe_block_applies(layer: nn.Module, plan: MoEPlan) -> bool:
    """Whether ``moe_block`` computes this block: its experts are whole tensors, not the DTensor
    shards of tensor or expert parallelism, and their module has no hooks (an emitted block then
    runs its forward as written)."""
    e = plan.experts
    return not any(is_sharded(_tensor(layer, path)) for path in (e.w13, e.w2)) and not experts_watched(layer, plan)


def expert_sharding(module: nn.Module, plan: MoEPlan, shared_batch: bool | None) -> ExpertShards | None:
    """How the experts that ``plan`` finds in ``module`` are shared out over ranks (None: whole on each);
    raises ValueError where a fused layer cannot compute them (``sharding.expert_shards``)."""
    e = plan.experts
    w13, w2, b13, b2 = (_tensor(module, path) if path is not None else None for path in (e.w13, e.w2, e.b13, e.b2))
    s = e.spec
    return expert_shards(
        w13, w2, b13, b2, interleaved=s.interleaved, w13_transposed=s.w13_transposed,
        w2_transposed=s.w2_transposed, shared_batch=shared_batch,
    )  # fmt: skip


def layer_expert_shards(layer: nn.Module, plan: MoEPlan) -> ExpertShards | None:
    """``expert_sharding`` of a fused layer (a cheap answer while its experts are whole)."""
    if not is_sharded(_tensor(layer, plan.experts.w13)) and not is_sharded(_tensor(layer, plan.experts.w2)):
        return None
    return expert_sharding(layer, plan, layer.__dict__.get("shared_batch"))


def _computable(layer: nn.Module, plan: MoEPlan) -> bool:
    """Whether the layer computes its block: its experts whole, or shared out over the ranks as
    ``sharding.expert_shards`` computes them. Otherwise (a model rewritten and then distributed with its
    experts sharded another way) the block runs as written, through the plan's own dispatch."""
    try:
        layer_expert_shards(layer, plan)
    except ValueError:
        return False
    return True


def experts_watched(layer: nn.Module, plan: MoEPlan) -> bool:
    """Whether a child holding the packed experts, which the fused layer does not call, has hooks
    (its own or global ones) that the block's forward as written would run."""
    for path in dict.fromkeys((plan.experts.w13, plan.experts.w2)):  # one child, or two holding each
        *owners, _ = _split(path)
        if not owners:
            continue  # the block holds the experts itself: its own hooks run around the layer's call
        module = layer
        for part in owners:
            module = module._modules[part]
        if watched(module):
            return True
    return False


def _block_forward(layer: nn.Module, hidden_states: Tensor, plan: MoEPlan, routing, numbers: ExpertNumbers):
    if plan.assumes:
        _check_assumptions(layer, plan.assumes)
    # Sharded experts sum the ranks' outputs, which the layer's own graphs do not capture.
    sharded = is_sharded(_tensor(layer, plan.experts.w13))
    graphs = None if sharded else _decode_graphs(layer, hidden_states, plan, routing, numbers)
    if graphs is not None:
        return graphs(hidden_states)
    return _block_compute(layer, hidden_states, plan=plan, routing=routing, numbers=numbers)


def _decode_graphs(layer: nn.Module, hidden_states: Tensor, plan: MoEPlan, routing, numbers: ExpertNumbers):
    """The layer's CUDA graphs where this call replays one (asked for by the caller, eager, in eval
    mode, on a GPU, few enough tokens), else None."""
    if not layer.__dict__.get("graph_small_batches", False):  # the caller's choice (an emitted block has none)
        return None
    if not hidden_states.is_cuda or layer.training or torch.compiler.is_compiling():
        return None
    graphs = _LAYER_GRAPHS.get(layer)
    if graphs is None:
        # The graphs are kept in a table weakly keyed by the layer: they must not hold it.
        compute = functools.partial(_weakly, weakref.ref(layer), plan=plan, routing=routing, numbers=numbers)
        graphs = _LAYER_GRAPHS[layer] = SmallBatchGraphs(layer, compute, DECODE_GRAPH_TOKENS)
    return graphs if graphs.graphable(hidden_states) else None


def _weakly(layer: weakref.ref, hidden_states: Tensor, **plan):
    return _block_compute(layer(), hidden_states, **plan)


def _check_assumptions(layer: nn.Module, assumes) -> None:
    for path, expected in assumes:
        *owners, name = _split(path)
        module = layer
        for part in owners:
            module = module._modules[part]
        now = getattr(module, name, None)
        if type(now) is not type(expected) or now != expected:
            raise ValueError(
                f"This fused mixture-of-experts layer was made for {path} = {expected!r}, and it is now {now!r}: "
                "the block's code takes another path for that value. Rewrite the model again (or emit it again) "
                "after changing it."
            )


def _block_compute(layer: nn.Module, hidden_states: Tensor, *, plan: MoEPlan, routing, numbers: ExpertNumbers):
    if layer.training and plan.train_error is not None:
        raise RuntimeError(plan.train_error)
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits, weights, ids, router_out = _block_route(layer, plan.router, routing, hidden_states, tokens)
    e = plan.experts
    rows, row_weights, row_ids = tokens, weights, ids
    if e.weights_on_input:
        # Each (token, slot) pair is a row of its own, the token scaled by its weight, and its expert's
        # output counts once: the pairs' outputs of a token are then summed in the token dtype.
        rows = (tokens.unsqueeze(1) * weights.unsqueeze(-1)).reshape(-1, tokens.shape[-1])
        row_weights, row_ids = rows.new_ones((rows.shape[0], 1)), ids.reshape(-1, 1)
    shards = layer_expert_shards(layer, plan)
    if shards is not None:  # this rank's experts only; the ranks' outputs are summed below
        rows, row_weights, row_ids = shards.local_routes(rows, row_weights, row_ids)
    if e.w13_scale is not None:
        w13, s13, w2, s2 = (local_tensor(_tensor(layer, p)) for p in (e.w13, e.w13_scale, e.w2, e.w2_scale))
        block = tuple(_tensor(layer, e.block))
        out = moe_experts_fp8(
            rows, row_weights, row_ids, w13, s13, w2, s2, block, e.spec, alpha=numbers.alpha, limit=numbers.limit
        )
    else:
        out = moe_experts(
            rows, row_weights, row_ids, local_tensor(_tensor(layer, e.w13)), local_tensor(_tensor(layer, e.w2)), e.spec,
            b13=local_tensor(_tensor(layer, e.b13)) if e.b13 is not None else None,
            b2=local_tensor(_tensor(layer, e.b2)) if e.b2 is not None else None,
            alpha=numbers.alpha, limit=numbers.limit,
        )  # fmt: skip
    if e.weights_on_input:
        out = out.view(ids.shape[0], ids.shape[1], -1).sum(dim=1)
    if shards is not None:
        out = shards.combine(out)
    if plan.routed_scaled:
        out = out * numbers.routed_scale
    if plan.combine_fp32:
        out = out.float()
    for shared in plan.shared:
        term = _block_shared(layer, shared, hidden_states, tokens, router_out).reshape(out.shape)
        out = out + (term.float() if plan.combine_fp32 else term)
    if plan.bias is not None:
        bias = _tensor(layer, plan.bias)
        out = out + (bias.float() if plan.combine_fp32 else bias)
    if plan.combine_fp32:
        out = out.to(hidden_states.dtype)
    if plan.post is not None:
        out = getattr(layer, plan.post)(out if plan.post_flat else out.reshape(hidden_states.shape))
    hidden = out if plan.flat_output else out.reshape(hidden_states.shape)
    values = {HIDDEN: hidden, LOGITS: logits, WEIGHTS: weights, IDS: ids}
    if router_out is not None:
        values |= {router_output(i): out for i, out in enumerate(router_out)}
    returned = tuple(values[role] for role in plan.outputs)
    return returned if plan.returns_tuple else returned[0]


def _block_route(layer: nn.Module, r: RouterPlan, n, hidden_states: Tensor, tokens: Tensor):
    module = getattr(layer, r.module)
    observed = watched(module)
    call_module = r.spec is None or (WEIGHTS in r.returns and (observed or (layer.training and r.train_as_module)))
    # A router with hooks (transformers records router logits with them) is called for its logits.
    if call_module or r.logits is None or (observed and LOGITS in r.returns):
        out = module(hidden_states if r.input else tokens, *(_tensor(layer, p) for p in r.extra))
        found = dict(zip(r.returns, out if len(r.returns) > 1 else (out,)))
        if call_module:
            return found.get(LOGITS), found[WEIGHTS], found[IDS], out
        logits = found[LOGITS]
    else:
        logits = r.logits.logits(layer, tokens)
    bias = _tensor(layer, r.correction_bias).reshape(-1) if r.correction_bias is not None else None
    dtype = {LOGITS: logits.dtype, INPUT: hidden_states.dtype, "float32": torch.float32, None: None}[r.weights_dtype]
    weights, ids = moe_route(
        logits, n.top_k, r.spec, correction_bias=bias, n_group=n.n_group, topk_group=n.topk_group,
        renorm_eps=n.renorm_eps, renorm_min=n.renorm_min, scale=n.scale, out_dtype=dtype,
    )  # fmt: skip
    return logits, weights, ids, None


def _block_shared(layer: nn.Module, shared: SharedPlan, hidden_states: Tensor, tokens: Tensor, router_out) -> Tensor:
    """``router_out``: what the router module returned (None when the layer routed itself)."""
    args = [router_out[i] for key, i in shared.router_outputs if key is None]
    kwargs = {key: router_out[i] for key, i in shared.router_outputs if key is not None}
    out = getattr(layer, shared.module)(hidden_states if shared.input else tokens, *args, **kwargs)
    if shared.gate is None:
        return out
    gate = getattr(layer, shared.gate)(hidden_states if shared.gate_input else tokens)
    return torch.sigmoid(gate) * out


class StackedExperts(nn.Module):
    """Per-expert GLU weights stacked as ``w13 [E, 2I, H]`` (gate rows, then up rows) and
    ``w2 [E, H, I]``, optional biases ``b13``/``b2``; ``state_dict`` reads and writes the
    original per-expert keys (``0.gate_proj.weight`` ...), so checkpoints keep their layout.

    keys: for each tensor name of ``w13``, ``w2``, ``b13``, ``b2``, the per-expert key
        template of each part, with ``{}`` for the expert index: ``w13`` has two parts
        (gate, up), the others one.
    whole: keys (without ``{}``) that hold a part for every expert in one tensor: (its shape, and
        whether each expert's block is stored transposed), the experts' blocks in order.
    """

    __transfuse_layer__ = True

    def __init__(
        self,
        tensors: dict[str, Tensor],
        keys: dict[str, tuple[str, ...]],
        whole: dict[str, tuple[tuple[int, ...], bool]] | None = None,
    ):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=tensor.requires_grad))
        self.keys = keys
        self.whole = whole or {}
        self.num_experts = next(iter(tensors.values())).shape[0]

    def _stored(self, template: str, part: Tensor) -> Tensor:
        """Every expert's part ``[E, r, c]`` as the key ``template`` holds it."""
        shape, transposed = self.whole[template]
        return (part.transpose(1, 2) if transposed else part).reshape(shape)

    def _loaded(self, template: str, value: Tensor, part: Tensor) -> Tensor | None:
        """``value`` of the key ``template`` as every expert's part (None when its shape is not the key's)."""
        shape, transposed = self.whole[template]
        if tuple(value.shape) != tuple(shape):
            return None
        e, r, c = part.shape
        return value.reshape(e, c, r).transpose(1, 2) if transposed else value.reshape(e, r, c)

    def _parts(self, name: str) -> list[tuple[str, slice]]:
        """Each part of a stacked tensor: its per-expert key template and its rows in one expert."""
        templates = self.keys[name]
        rows = getattr(self, name).shape[1] // len(templates)
        return [(t, slice(i * rows, (i + 1) * rows)) for i, t in enumerate(templates)]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.keys:
            tensor = getattr(self, name)
            tensor = tensor if keep_vars else tensor.detach()
            for template, rows in self._parts(name):
                if template in self.whole:
                    destination[prefix + template] = self._stored(template, tensor[:, rows]).clone()
                    continue
                for e in range(self.num_experts):
                    # A copy: per-expert views would share storage, which checkpoint writers refuse.
                    destination[prefix + template.format(e)] = tensor[e, rows].clone()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = set()
        with torch.no_grad():
            for name in self.keys:
                tensor = getattr(self, name)
                for template, rows in self._parts(name):
                    if template in self.whole:
                        key = prefix + template
                        expected.add(key)
                        if key not in state_dict:
                            missing_keys.append(key)
                            continue
                        loaded = self._loaded(template, state_dict[key], tensor[:, rows])
                        if loaded is None:
                            error_msgs.append(
                                f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}, "
                                f"the shape in the current model is {self.whole[template][0]}."
                            )
                            continue
                        tensor[:, rows].copy_(loaded)
                        continue
                    for e in range(self.num_experts):
                        key = prefix + template.format(e)
                        expected.add(key)
                        if key not in state_dict:
                            missing_keys.append(key)
                            continue
                        value = state_dict[key]
                        if value.shape != tensor[e, rows].shape:
                            error_msgs.append(
                                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                f"the shape in the current model is {tuple(tensor[e, rows].shape)}."
                            )
                            continue
                        tensor[e, rows].copy_(value)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={tuple(getattr(self, name).shape)}" for name in self.keys)
