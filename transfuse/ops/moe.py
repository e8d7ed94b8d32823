"""Mixture of experts: ``Σ_k w_k · down_e(act(gate_e(x)) · up_e(x))`` over each token's top-k experts.

Two ops, each a native definition plus providers:

* ``moe_route``: router logits ``[T, E]`` → top-k weights and expert ids ``[T, k]``, in
  one of the ways models route (``RoutingSpec``): softmax over all experts then top-k,
  sigmoid scores, top-k of the logits then a softmax or a sigmoid of the k; optionally a correction
  bias that only steers the choice, group-limited choice, renormalisation of the k weights
  (plus an epsilon, or clamped below), a scaling factor, and a final cast. The native
  definition performs the same torch ops in the same order as the models it stands for,
  so it chooses the same experts with bit-identical weights.
* ``moe_experts``: tokens ``[T, H]``, weights and ids ``[T, k]``, and packed expert
  weights (``w13``: gate and up projections, ``w2``: down projection) → ``[T, H]``. The
  layouts models use (``ExpertsSpec``) are read through strides, never copied: ``w13`` as
  ``[E, 2I, H]`` (``F.linear``) or ``[E, H, 2I]`` (``x @ w``), gate and up as halves or
  interleaved columns, optional biases, and a plain activation or gpt-oss's clamped
  SwiGLU. The native definition sorts the (token, slot) pairs by expert and runs each
  projection as one grouped matmul over all experts, with no host sync and no loop over
  experts, so the same code serves inference on the CPU, training (it differentiates, the
  routing weights included), ``torch.export`` and ``torch.compile``; each pair's output is
  multiplied by its weight, then the k contributions of a token are summed and rounded to
  the token dtype. The Triton provider is forward-only (inference on a GPU).

* ``moe_experts_fp8``: the same over block-scaled FP8 experts (the DeepSeek/Qwen FP8 layout:
  ``w13``/``w2`` in e4m3, one float32 scale per ``block`` of each expert's matrix), with ``w13``
  ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` applied as ``F.linear``. The native definition
  dequantises each expert that received rows, block by block, into the tokens' dtype at run time
  (nothing dequantised is kept) and applies it as transformers computes an FP8 layer it
  dequantises: ``F.linear`` with the weight times its blocks' scales. It combines as transformers'
  FP8 experts do: each output times its weight cast to the output's dtype, summed in float32.

All are ``torch.library`` ops with fake implementations, so ``torch.compile`` sees them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable

import torch
import torch.nn.functional as F
from torch import Tensor

from .conformance import Rows, Sampler, ShapeClass, _random_like, _static_key, _tensor_key
from .dispatch import Op

__all__ = [
    "EXPERT_ACTIVATIONS",
    "MOE_EXPERTS",
    "MOE_ROUTE",
    "ExpertsSpec",
    "RoutingSpec",
    "MOE_EXPERTS_FP8",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_fp8_native",
    "moe_experts_native",
    "moe_route",
    "moe_route_native",
]

ROUTING_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
# Activations of the gate half; "clamped_swiglu" is ``(clamp(up, ±limit) + 1) · g·σ(α·g)`` with
# ``g = clamp(gate, max=limit)`` (gpt-oss); "clamped_<act>" is ``act(clamp(gate, max=limit)) · clamp(up, ±limit)``;
# "softcapped_swiglu" is ``(cap_α(g) · σ(g) · cap_limit(u)).to(dtype)`` with ``g, u`` the gate and up in float32
# and ``cap_c(v) = tanh(v / c) · c`` (alpha and limit are the two softcaps there).
_PLAIN_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
EXPERT_ACTIVATIONS = (
    *_PLAIN_ACTIVATIONS, "clamped_swiglu", *(f"clamped_{a}" for a in _PLAIN_ACTIVATIONS), "softcapped_swiglu",
)  # fmt: skip


@dataclass(frozen=True)
class RoutingSpec:
    """How router logits become top-k weights and ids; the numbers come with each call.

    scoring: "softmax" (over all experts, then top-k), "sigmoid" (then top-k),
        "topk_softmax" (top-k of the logits, then softmax over the k chosen), or
        "topk_sigmoid" (top-k of the logits, then the sigmoid of each of the k).
    float32: the softmax (or the top-k's sigmoid) is computed in float32.
    correction_bias: experts are chosen by ``score + bias``; the weights stay the scores.
    grouped: group-limited choice: experts form ``n_group`` groups, ranked by the sum of
        their two best choice scores, and only the best ``topk_group`` groups compete.
    renormalize: the k weights are divided by their sum (plus ``renorm_eps``, or clamped
        below at ``renorm_min``, when given).
    scaled: the weights are multiplied by ``scale``.
    """

    scoring: str = "softmax"
    float32: bool = True
    correction_bias: bool = False
    grouped: bool = False
    renormalize: bool = False
    scaled: bool = False

    def __post_init__(self):
        if self.scoring not in ROUTING_SCORINGS:
            raise ValueError(f"RoutingSpec.scoring must be one of {ROUTING_SCORINGS}, not {self.scoring!r}.")
        if self.scoring.startswith("topk_") and (self.correction_bias or self.grouped):
            raise ValueError("RoutingSpec: top-k of the logits takes no correction bias and no group limit.")

    def describe(self) -> str:
        parts = [f"{self.scoring}{' in float32' if self.float32 and self.scoring != 'sigmoid' else ''}"]
        for flag, text in (
            (self.correction_bias, "correction bias"),
            (self.grouped, "group-limited"),
            (self.renormalize, "renormalised"),
            (self.scaled, "scaled"),
        ):
            if flag:
                parts.append(text)
        return ", ".join(parts)


@dataclass(frozen=True)
class ExpertsSpec:
    """How the packed expert weights are laid out and what the activation is.

    activation: one of ``EXPERT_ACTIVATIONS``.
    interleaved: gate and up are alternating features of ``w13`` (else its two halves).
    gate_first: the gate is the first half (or the even features); else the up projection is.
    w13_transposed: ``w13`` is ``[E, H, 2I]`` and applied as ``x @ w`` (else ``[E, 2I, H]``, ``F.linear``).
    w2_transposed: ``w2`` is ``[E, I, H]`` and applied as ``h @ w`` (else ``[E, H, I]``, ``F.linear``).
    """

    activation: str = "silu"
    interleaved: bool = False
    gate_first: bool = True
    w13_transposed: bool = False
    w2_transposed: bool = False

    def __post_init__(self):
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"ExpertsSpec.activation must be one of {EXPERT_ACTIVATIONS}, not {self.activation!r}.")

    def flags(self) -> tuple[str, bool, bool, bool, bool]:
        return (self.activation, self.interleaved, self.gate_first, self.w13_transposed, self.w2_transposed)

    def describe(self) -> str:
        parts = [self.activation, "interleaved" if self.interleaved else "halves"]
        if not self.gate_first:
            parts.append("up first")
        if self.w13_transposed or self.w2_transposed:
            parts.append("transposed")
        return ", ".join(parts)


# ---- routing ---------------------------------------------------------------------------


def _group_limited(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """Mask out (with -inf) the experts outside the ``topk_group`` best groups of each token."""
    tokens, experts = choice.shape
    group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
    return choice.masked_fill(~score_mask.bool(), float("-inf"))


def moe_route_native(
    logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    scoring: str,
    float32: bool,
    grouped: bool,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    renorm_eps: float | None,
    renorm_min: float | None,
    scale: float | None,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """Top-k weights and ids ``[T, k]`` of router logits ``[T, E]``; see ``RoutingSpec``."""
    softmax_dtype = torch.float32 if float32 else None
    if scoring == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=softmax_dtype)
    elif scoring == "topk_sigmoid":
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = (top.float() if float32 else top).sigmoid()
    else:
        scores = F.softmax(logits, dim=-1, dtype=softmax_dtype) if scoring == "softmax" else logits.sigmoid()
        choice = scores + correction_bias if correction_bias is not None else scores
        if grouped:
            choice = _group_limited(choice, n_group, topk_group)
        if correction_bias is not None or grouped:
            ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        if renorm_eps is not None:
            total = total + renorm_eps
        if renorm_min is not None:
            total = torch.clamp(total, min=renorm_min)
        weights = weights / total
    if scale is not None:
        weights = weights * scale
    if out_dtype is not None:
        weights = weights.to(out_dtype)
    return weights, ids


# ---- experts ---------------------------------------------------------------------------


def _apply(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """``x @ weight + bias`` for a ``[in, out]`` weight, ``F.linear`` for ``[out, in]``; as models write each."""
    if transposed:
        out = x @ weight
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)


def gated_activation(
    h: Tensor, activation: str, interleaved: bool, gate_first: bool, alpha: float, limit: float
) -> Tensor:
    """``act(gate) * up`` of the gate/up projection output ``h``, in ``h``'s dtype."""
    if interleaved:
        first, second = h[..., ::2], h[..., 1::2]
    else:
        first, second = h.chunk(2, dim=-1)
    gate, up = (first, second) if gate_first else (second, first)
    if activation == "clamped_swiglu":
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation == "softcapped_swiglu":
        g, u = gate.float(), up.float()
        capped_gate = torch.tanh(g / alpha) * alpha
        capped_up = torch.tanh(u / limit) * limit
        return (capped_gate * torch.sigmoid(g) * capped_up).to(h.dtype)
    if activation.startswith("clamped_"):
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        activation = activation[len("clamped_") :]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "relu":
        return F.relu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def moe_experts_native(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None,
    b2: Tensor | None,
    activation: str,
    interleaved: bool,
    gate_first: bool,
    w13_transposed: bool,
    w2_transposed: bool,
    alpha: float,
    limit: float,
) -> Tensor:
    """Σ over each token's k (weight, expert) pairs of ``weight · expert(token)``; see ``ExpertsSpec``.

    The (token, slot) pairs are sorted by expert and each projection is one grouped matmul over
    all experts (``torch._grouped_mm``), so nothing here waits for the GPU or loops over experts in
    Python: the op traces under ``torch.export`` and ``torch.compile`` and differentiates with
    autograd (the router's weights included). Moving rows between token and expert order is done
    with permutations whose backward is the inverse permutation, never a scatter-add."""
    tokens, top_k = ids.shape
    experts = w13.shape[0]
    flat_ids = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    inverse = torch.argsort(order)  # a permutation's inverse: one op where a scatter of positions takes three
    offsets = _group_ends(sorted_ids, experts)
    rows = _GatherSorted.apply(x, order, inverse, top_k)
    h = _grouped_linear(rows, w13, offsets, sorted_ids, b13, w13_transposed)
    if activation in _FUSED_ACTIVATIONS and not interleaved and gate_first:
        from .act_and_mul import act_and_mul  # [gate | up] halves: the fused op, and its kernels' backward

        h = act_and_mul(h, activation)
    else:
        h = gated_activation(h, activation, interleaved, gate_first, alpha, limit)
    out = _grouped_linear(h, w2, offsets, sorted_ids, b2, w2_transposed)
    # As transformers' grouped and batched experts do: each output times its weight (in the
    # weights' dtype if wider), the k of a token summed, then rounded to the token dtype.
    contributions = _Permute.apply(out, inverse, order) * weights.reshape(-1, 1)
    total = contributions.view(tokens, top_k, -1).sum(dim=1)
    return total if total.dtype == x.dtype else total.to(x.dtype)


_FUSED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def dequantize_fp8_blocks(weight: Tensor, scale_inv: Tensor, block_n: int, block_k: int, dtype: torch.dtype) -> Tensor:
    """``weight`` (``[out, in]`` e4m3) times its block's scale (``scale_inv [⌈out/block_n⌉, ⌈in/block_k⌉]``),
    in ``dtype``: the e4m3 values and the scales each cast to ``dtype``, then multiplied there."""
    rows, cols = weight.shape
    scale = scale_inv.to(dtype).repeat_interleave(block_n, dim=0)[:rows].repeat_interleave(block_k, dim=1)[:, :cols]
    return weight.to(dtype) * scale


def _fp8_grouped_linear(
    rows: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int], offsets: Tensor
) -> Tensor:
    """Each expert's rows times its dequantised ``[out, in]`` weight (``F.linear``); only the experts that
    received rows are dequantised, one at a time (one host sync for the group sizes)."""
    pieces, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            matrix = dequantize_fp8_blocks(weight[expert], scale_inv[expert], block[0], block[1], rows.dtype)
            pieces.append(F.linear(rows[start:end], matrix))
        start = end
    return torch.cat(pieces) if pieces else rows.new_zeros((0, weight.shape[-2]))


def moe_experts_fp8_native(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale_inv: Tensor,
    w2: Tensor,
    w2_scale_inv: Tensor,
    block_n: int,
    block_k: int,
    activation: str,
    interleaved: bool,
    gate_first: bool,
    alpha: float,
    limit: float,
) -> Tensor:
    """``moe_experts_native`` over block-FP8 experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (e4m3) and their
    block scales, each expert dequantised into ``x``'s dtype when it has rows."""
    tokens, top_k = ids.shape
    experts = w13.shape[0]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    inverse = torch.argsort(order)
    offsets = _group_ends(sorted_ids, experts)
    rows = _GatherSorted.apply(x, order, inverse, top_k)
    block = (block_n, block_k)
    h = _fp8_grouped_linear(rows, w13, w13_scale_inv, block, offsets)
    h = gated_activation(h, activation, interleaved, gate_first, alpha, limit)
    out = _fp8_grouped_linear(h, w2, w2_scale_inv, block, offsets)
    # As transformers' FP8 experts do: each output times its weight cast to the output's dtype, the k
    # of a token summed in float32, then rounded to the token dtype.
    contributions = _Permute.apply(out, inverse, order) * weights.reshape(-1, 1).to(out.dtype)
    return contributions.float().view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _group_ends(sorted_ids: Tensor, experts: int) -> Tensor:
    """The end of each expert's rows in expert order, as ``torch._grouped_mm`` takes them (int32): for
    each expert e, how many sorted ids are at most e. One fixed size, so the shape never depends on
    the data."""
    return torch.searchsorted(sorted_ids, _expert_ids(experts, sorted_ids), right=True, out_int32=True)


# (experts, device) -> arange(experts): the ids ``_group_ends`` looks up, made once per layer shape.
_EXPERT_IDS: dict = {}


def _expert_ids(experts: int, like: Tensor) -> Tensor:
    if torch.compiler.is_compiling() or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return torch.arange(experts, device=like.device, dtype=like.dtype)  # no tensor made outside the graph
    key = (experts, like.device, like.dtype)
    ids = _EXPERT_IDS.get(key)
    if ids is None:
        ids = _EXPERT_IDS[key] = torch.arange(experts, device=like.device, dtype=like.dtype)
    return ids


class _GatherSorted(torch.autograd.Function):
    """``x[order // k]``: each token's row once per slot, in expert order. The backward puts the
    gradient rows back in token order (``inverse``) and sums each token's k of them: deterministic,
    where the scatter-add that indexing differentiates to is not."""

    @staticmethod
    def forward(ctx, x, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x[torch.div(order, top_k, rounding_mode="floor")]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse].view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None


class _Permute(torch.autograd.Function):
    """``t[perm]`` for a permutation ``perm`` whose inverse is ``inverse``: the backward gathers too."""

    @staticmethod
    def forward(ctx, t, perm, inverse):
        ctx.save_for_backward(inverse)
        return t[perm]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def _grouped_linear(
    rows: Tensor, weight: Tensor, offsets: Tensor, sorted_ids: Tensor, bias: Tensor | None, transposed: bool
) -> Tensor:
    """Each expert's rows times its weight (``[E, in, out]`` applied as ``x @ w`` when ``transposed``,
    else ``[E, out, in]`` as ``F.linear``), plus its bias: as models write each."""
    matrix = weight if transposed else weight.transpose(-2, -1)
    out = _grouped_matmul(rows, matrix, offsets)
    return out + bias[sorted_ids] if bias is not None else out


# (device type, dtype) pairs on which torch._grouped_mm was found not to run.
_GROUPED_MM_FAILS: set = set()


def _grouped_matmul(rows: Tensor, matrix: Tensor, offsets: Tensor) -> Tensor:
    """``torch._grouped_mm`` where it has a kernel for these tensors; else the same one expert at a
    time, inside an opaque op (``transfuse::grouped_matmul``) when compiling or exporting, since
    its group sizes are data (compile and export trace ``_grouped_mm`` for bf16 only)."""
    if _grouped_mm_takes(rows, matrix):
        if not torch.compiler.is_compiling():
            try:
                return torch._grouped_mm(rows, matrix, offs=offsets)
            except RuntimeError:  # no kernel for this device and dtype after all: remember it
                _GROUPED_MM_FAILS.add((rows.device.type, rows.dtype))
        elif rows.dtype == torch.bfloat16:
            return torch._grouped_mm(rows, matrix, offs=offsets)
    if torch.compiler.is_compiling():
        return _opaque_grouped_matmul(rows, matrix, offsets)
    return _looped_matmul(rows, matrix, offsets)


def _opaque_grouped_matmul(rows: Tensor, matrix: Tensor, offsets: Tensor) -> Tensor:
    """``_looped_matmul`` as one op that compiled code does not look into (its group sizes are data)."""
    return torch.ops.transfuse.grouped_matmul(rows, matrix, offsets)


def _grouped_mm_takes(rows: Tensor, matrix: Tensor) -> bool:
    """``torch._grouped_mm`` may run these: it exists, both are one dtype it has kernels for, and
    rows and columns are 16-byte multiples (its kernels' alignment)."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != matrix.dtype:
        return False
    if rows.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if (rows.device.type, rows.dtype) in _GROUPED_MM_FAILS:
        return False
    size = rows.element_size()
    return rows.shape[-1] * size % 16 == 0 and matrix.shape[-1] * size % 16 == 0 and matrix.shape[-2] * size % 16 == 0


def _looped_matmul(rows: Tensor, matrix: Tensor, offsets: Tensor) -> Tensor:
    """The same as ``torch._grouped_mm``, one matmul per expert with rows (one host sync for the
    group sizes)."""
    pieces, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            pieces.append(rows[start:end] @ matrix[expert])
        start = end
    return torch.cat(pieces) if pieces else rows.new_zeros((0, matrix.shape[-1]))


@torch.library.custom_op("transfuse::grouped_matmul", mutates_args=())
def _grouped_matmul_op(rows: Tensor, matrix: Tensor, offsets: Tensor) -> Tensor:
    return _looped_matmul(rows, matrix, offsets)


@_grouped_matmul_op.register_fake
def _(rows, matrix, offsets):
    return rows.new_empty((rows.shape[0], matrix.shape[-1]))


@torch.library.custom_op("transfuse::grouped_matmul_backward", mutates_args=())
def _grouped_matmul_backward_op(grad: Tensor, rows: Tensor, matrix: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    grad_rows = _looped_matmul(grad, matrix.transpose(-2, -1), offsets)
    grad_matrix = torch.zeros_like(matrix)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            grad_matrix[expert] = rows[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return grad_rows, grad_matrix


@_grouped_matmul_backward_op.register_fake
def _(grad, rows, matrix, offsets):
    return torch.empty_like(rows), torch.empty_like(matrix)


def _grouped_matmul_setup(ctx, inputs, output):
    rows, matrix, offsets = inputs
    ctx.save_for_backward(rows, matrix, offsets)


def _grouped_matmul_backward(ctx, grad):
    rows, matrix, offsets = ctx.saved_tensors
    grad_rows, grad_matrix = torch.ops.transfuse.grouped_matmul_backward(grad.contiguous(), rows, matrix, offsets)
    return grad_rows, grad_matrix, None


_grouped_matmul_op.register_autograd(_grouped_matmul_backward, setup_context=_grouped_matmul_setup)


# ---- dispatch --------------------------------------------------------------------------

class _ExpertsSampler(Sampler):
    """Tokens ``[T, H]`` routed to ``k`` of the experts: classes of token counts (one token, a few,
    the call's, both sides of the providers' declared ``"tokens"`` thresholds) and of routings (every
    token to the same k experts; an expert that receives no token). Routing weights are positive
    and sum to one per token, as a softmax gives; the expert weights are the call's own."""

    grads = ("x", "weights", "w13", "w2", "b13", "b2")

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        x, weights, ids = args[:3]
        return (_tensor_key(x, True), weights.dtype, ids.dtype, ids.shape[-1],
                *(_static_key(a) for a in args[3:]))  # fmt: skip

    def describe(self, args: tuple, kwargs: dict) -> str:
        x, ids, w13 = args[0], args[2], args[3]
        return (f"{str(x.dtype).replace('torch.', '')} on {x.device.type}, {w13.shape[0]} experts, top {ids.shape[-1]}, "
                f"hidden {x.shape[-1]}")  # fmt: skip

    def classes(self, args: tuple, kwargs: dict, thresholds: dict) -> list[ShapeClass]:
        tokens = args[0].shape[0]
        found = [
            ShapeClass(f"as called ({tokens} tokens)", (("tokens", tokens),)),
            ShapeClass("1 token", (("tokens", 1),)),
            ShapeClass("3 tokens", (("tokens", 3),)),
            ShapeClass("6 tokens, all to the same experts", (("tokens", 6),), data="one group"),
            ShapeClass("6 tokens, one expert receiving none", (("tokens", 6),), data="one idle"),
        ]
        for size in sorted(thresholds.get("tokens", ())):
            for n in (size - 1, size):
                if n >= 1:
                    found.append(ShapeClass(f"{n} tokens", (("tokens", n),)))
        return found

    def make(self, shape_class: ShapeClass, args: tuple, kwargs: dict, generator) -> tuple[tuple, dict]:
        x, weights, ids, w13 = args[:4]
        tokens, top_k, experts = shape_class.size("tokens", 1), ids.shape[-1], w13.shape[0]
        pool = experts - 1 if shape_class.data == "one idle" and experts > top_k else experts
        scores = torch.rand(tokens, pool, generator=generator, device=x.device)
        if shape_class.data == "one group":
            scores = scores[:1].expand(tokens, pool)
        chosen = scores.topk(top_k, dim=-1).indices + (experts - pool)  # the idle expert is expert 0
        routing = _random_like((tokens, top_k), torch.float32, x.device, generator).softmax(dim=-1)
        new = (_random_like((tokens, x.shape[-1]), x.dtype, x.device, generator), routing.to(weights.dtype),
               chosen.to(ids.dtype))  # fmt: skip
        return (*new, *args[3:]), dict(kwargs)


class _FP8ExpertsSampler(_ExpertsSampler):
    grads = ("x", "weights")  # the FP8 weights and scales are frozen


def _route_fake(logits, correction_bias, top_k, scoring, float32, grouped, n_group, topk_group, renormalize,
                renorm_eps, renorm_min, scale, out_dtype):  # fmt: skip
    dtype = out_dtype or (torch.float32 if (float32 and scoring != "sigmoid") else logits.dtype)
    shape = (*logits.shape[:-1], top_k)
    return logits.new_empty(shape, dtype=dtype), logits.new_empty(shape, dtype=torch.long)


def _experts_fake(x, weights, ids, w13, w2, b13, b2, *flags):
    return x.new_empty(x.shape)


class _RoutesSampler(Rows):
    """A token's chosen experts, compared in one order among experts of equal logits.

    Top-k leaves the order of equal values to the implementation (torch's CUDA ``topk`` sorts its
    picks with an unstable sort), and bfloat16 router logits tie often. Tied experts have equal
    weights, so the layer's result does not depend on their order. Each token's (weight, id) pairs
    are compared sorted by logit, then id; pairs stay pairs, so a weight given to the wrong expert
    still differs, and so does a different choice among experts tied at the k-th place. With a
    correction bias or group limits the choice is not the logits' order, and the results are
    compared as they are."""

    def comparable(self, outputs: list[Tensor], args: tuple, kwargs: dict) -> list[Tensor]:
        if self.argument("correction_bias", args, kwargs) is not None or self.argument("grouped", args, kwargs):
            return outputs
        weights, ids, *rest = outputs
        logits = self.argument("logits", args, kwargs).detach()
        by_id, first = ids.sort(dim=-1, stable=True)
        second = logits.gather(-1, by_id).argsort(dim=-1, descending=True, stable=True)
        order = first.gather(-1, second)
        return [weights.gather(-1, order), ids.gather(-1, order), *rest]


MOE_ROUTE = Op(
    "moe_route", moe_route_native, sampler=_RoutesSampler("logits", grads=("logits",), scale=2.0), library=True,
    fake=_route_fake,
)  # fmt: skip
# The native definition groups tokens with data-dependent sizes: compiled, it would break the graph.
MOE_EXPERTS = Op(
    "moe_experts", moe_experts_native, sampler=_ExpertsSampler(), library=True, fake=_experts_fake,
    compile_default="library",
)  # fmt: skip


MOE_EXPERTS_FP8 = Op(
    "moe_experts_fp8", moe_experts_fp8_native, sampler=_FP8ExpertsSampler(), library=True, fake=_experts_fake,
    compile_default="library",
)  # fmt: skip


def moe_route(
    logits: Tensor,
    top_k: int,
    spec: RoutingSpec = RoutingSpec(),
    *,
    correction_bias: Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renorm_eps: float | None = None,
    renorm_min: float | None = None,
    scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Top-k routing weights and expert ids of router ``logits`` ``[T, E]``, as ``spec`` says."""
    if spec.correction_bias != (correction_bias is not None):
        raise ValueError(
            f"RoutingSpec.correction_bias is {spec.correction_bias} but correction_bias is "
            f"{'given' if correction_bias is not None else 'None'}; pass the bias exactly when the spec has one."
        )
    if spec.grouped and logits.shape[-1] % n_group:
        raise ValueError(f"{logits.shape[-1]} experts cannot form {n_group} equal groups for group-limited routing.")
    args = (
        logits, correction_bias, int(top_k), spec.scoring, spec.float32, spec.grouped, int(n_group), int(topk_group),
        spec.renormalize, renorm_eps, renorm_min, scale if spec.scaled else None, out_dtype,
    )  # fmt: skip
    return MOE_ROUTE(*args)


def moe_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    spec: ExpertsSpec = ExpertsSpec(),
    *,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    alpha: float = 1.0,
    limit: float = math.inf,
) -> Tensor:
    """``[T, H]``: for each token, the sum over its k slots of ``weights · expert_ids(x)``."""
    if x.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts takes tokens [T, H] with weights and ids [T, k]; got x {tuple(x.shape)}, "
            f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}."
        )
    args = (x, weights, ids, w13, w2, b13, b2, *spec.flags(), float(alpha), float(limit))
    return MOE_EXPERTS(*args)


def moe_experts_fp8(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w13_scale_inv: Tensor,
    w2: Tensor,
    w2_scale_inv: Tensor,
    block: tuple[int, int],
    spec: ExpertsSpec = ExpertsSpec(),
    *,
    alpha: float = 1.0,
    limit: float = math.inf,
) -> Tensor:
    """``moe_experts`` over block-FP8 experts: ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in FP8 with one scale
    per ``block`` (``[E, ⌈rows/block[0]⌉, ⌈cols/block[1]⌉]`` each)."""
    if x.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts_fp8 takes tokens [T, H] with weights and ids [T, k]; got x {tuple(x.shape)}, "
            f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}."
        )
    if spec.w13_transposed or spec.w2_transposed:
        raise ValueError(
            "moe_experts_fp8 takes [E, out, in] expert weights (applied as F.linear), not transposed ones."
        )
    for name, w, s in (("w13", w13, w13_scale_inv), ("w2", w2, w2_scale_inv)):
        want = (w.shape[0], -(-w.shape[1] // block[0]), -(-w.shape[2] // block[1]))
        if w.element_size() != 1 or tuple(s.shape) != want:
            raise ValueError(
                f"moe_experts_fp8: {name} {tuple(w.shape)} {w.dtype} with scales {tuple(s.shape)} is not one scale per "
                f"{block[0]}x{block[1]} block of an FP8 weight (scales {want} expected)."
            )
    args = (x, weights, ids, w13, w13_scale_inv, w2, w2_scale_inv, int(block[0]), int(block[1]),
            spec.activation, spec.interleaved, spec.gate_first, float(alpha), float(limit))  # fmt: skip
    return MOE_EXPERTS_FP8(*args)
