"""Batch-invariant mode: a row's numbers depend on the row alone, never on what else is in the batch.

A model made batch-invariant (``enable``; ``transfuse.rewrite(model, batch_invariant=True)``) runs
its forward inside ``dispatch.batch_invariant_mode`` and ``InvariantFunctions``:

* the dispatched ops (norms, activations, rotary, MoE, attention of the decode paths) take only
  providers that declare ``batch_invariant`` (one launch configuration for every row count), or
  their native definitions, whose torch calls the next point makes invariant;
* the torch functions whose reduction order a library chooses by shape (matmuls and linear
  layers, softmax and log-softmax, sums and means, scaled-dot-product attention, cross-entropy)
  are computed here with an order fixed per output element: every sum is taken strictly from the
  first term to the last (``ordered_sum``), so neither the number of rows, nor the other rows, nor
  the row's position, nor zeros put before it (a left-padded sequence's masked keys) change it.
  Matmuls and linear layers go through the ``invariant_linear`` / ``invariant_matmul`` ops, whose
  GPU provider is a Triton GEMM with one tile shape and one reduction tile per weight shape
  (``ops/triton/invariant.py``); attention through ``invariant_attention`` (a Triton kernel that
  walks a sequence's keys in fixed blocks from its first unmasked key);
* other torch functions that reduce along a row (layer and group norms of torch, ``einsum``,
  convolutions, norms, variances, ...) run as they are and are recorded, with the line of code
  that called them, as not invariant (``not_invariant``): the report lists them.

The native forms here are plain torch: the product of each pair of terms, then a cumulative sum
along the reduced dimension, whose last element is the sequential sum (on a CPU ``cumsum`` is a
sequential scan, in double precision for float32). They cost memory and time proportional to
``rows x outputs x reduced length`` (computed in chunks of rows) and serve CPU runs and tests;
a GPU runs the Triton providers.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import weakref
from typing import Any, Callable, Hashable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import dispatch
from .conformance import Sampler, ShapeClass, _like_call, _replace
from .dispatch import Op, batch_invariant_active, batch_invariant_mode

__all__ = [
    "InvariantFunctions",
    "disable",
    "enable",
    "invariant_attention",
    "invariant_bmm_native",
    "invariant_grouped_mm_native",
    "invariant_linear",
    "invariant_matmul",
    "is_enabled",
    "not_invariant",
    "ordered_sum",
]

# Elements of the product of a chunk of rows with the other operand materialised at once.
_CHUNK_ELEMENTS = 1 << 24


def ordered_sum(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """``x`` summed along ``dim`` strictly from the first element to the last, in float32 (double on a
    CPU, where ``cumsum`` accumulates float32 in double) or wider: the same bits for a row whatever
    the other rows, and unchanged by zeros anywhere in the row."""
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    n = wide.shape[dim]
    if not n:
        return wide.sum(dim, keepdim=keepdim)
    # The scan runs along a dimension that is neither the innermost nor the tensor's only one:
    # there torch's CUDA ``cumsum`` is one thread per sum, adding the elements in order. Along the
    # innermost dimension it scans a row as a tree whose shape depends on the number of rows, and
    # a tensor that is one row it scans with CUB's device-wide scan, not reproducible from run to
    # run. A CPU scans every dimension in order.
    columns = wide.movedim(dim, -1).unsqueeze(-1)  # [..., n, 1]
    if columns.numel() == n:
        columns = torch.cat([columns, torch.zeros_like(columns)], -1)
    total = columns.cumsum(-2)[..., n - 1, 0]
    return total.unsqueeze(dim % wide.dim()) if keepdim else total


def _row_chunks(rows: int, per_row: int) -> int:
    """How many rows a chunk holds: from the other operand's size only, never from the row count."""
    return max(1, _CHUNK_ELEMENTS // max(1, per_row))


def invariant_linear_native(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with each output an ordered sum over the input features."""
    out_features, k = weight.shape
    rows = x.reshape(-1, k)
    w = weight.float()
    step = _row_chunks(rows.shape[0], out_features * k)
    pieces = [
        ordered_sum(rows[start : start + step].float()[:, None, :] * w[None], dim=-1)
        for start in range(0, rows.shape[0], step)
    ]
    out = torch.cat(pieces) if pieces else x.new_zeros((0, out_features), dtype=torch.float32)
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.result_type(x, weight)).reshape(*x.shape[:-1], out_features)


def _linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.result_type(x, weight))


INVARIANT_LINEAR = Op("invariant_linear", invariant_linear_native, library=True, fake=_linear_fake)


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """A linear layer whose outputs do not depend on the other rows (dispatched)."""
    return _with_reference_backward(INVARIANT_LINEAR, F.linear, x, weight, bias)


class _ReferenceBackward(torch.autograd.Function):
    """The op's value as computed without autograd (its invariant kernels, which have no backward
    of their own), differentiated as ``reference`` (the torch function it computes) at the same
    inputs: the backward recomputes ``reference`` there and takes its gradient. A gradient is a
    sum over the batch in any case; what the mode promises is each row's forward."""

    @staticmethod
    def forward(ctx, op: Op, reference: Callable[..., Tensor], *args: Any) -> Tensor:
        ctx.reference = reference
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.others = [None if isinstance(a, Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        return op(*(a.detach() if isinstance(a, Tensor) else a for a in args))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        args = list(ctx.others)
        wanted = []
        for i, saved in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = saved.detach().requires_grad_(ctx.needs_input_grad[i + 2])
            if ctx.needs_input_grad[i + 2]:
                wanted.append(i)
        with torch.enable_grad():
            out = ctx.reference(*args)
        found = torch.autograd.grad(out, [args[i] for i in wanted], grad, allow_unused=True)
        grads: list[Optional[Tensor]] = [None] * len(args)
        for i, g in zip(wanted, found):
            grads[i] = g
        return (None, None, *grads)


def _with_reference_backward(op: Op, reference: Callable[..., Tensor], *args: Any) -> Tensor:
    """``op(*args)``; where autograd needs its backward (eagerly), through ``_ReferenceBackward``, so
    that the forward still runs the invariant kernels (forward-only) rather than the native
    definition's materialised products, which autograd would keep for the backward."""
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or not any(isinstance(a, Tensor) and a.requires_grad for a in args)
    ):
        return op(*args)
    return _ReferenceBackward.apply(op, reference, *args)


def invariant_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` with each output an ordered sum over the shared dimension. A
    two-dimensional ``b`` (a weight) goes through ``invariant_linear``."""
    if a.dim() == 0 or b.dim() == 0:
        return a * b
    if b.dim() == 1:
        return invariant_matmul(a, b[:, None]).squeeze(-1)
    if a.dim() == 1:
        return invariant_matmul(a[None], b).squeeze(-2)
    if b.dim() == 2:
        return invariant_linear(a, b.transpose(0, 1))
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])
    m, n = a.shape[-2], b.shape[-1]
    # Both have dimensions, so their dtypes decide alone. (torch 2.11's Dynamo breaks the graph at
    # ``torch.result_type``; a graph break inside a torch-function handler makes Dynamo resume the
    # wrong handler's code, see ``InvariantFunctions``.)
    dtype = torch.promote_types(a.dtype, b.dtype)
    flat = _with_reference_backward(
        INVARIANT_BMM, torch.bmm, a.reshape(-1, m, a.shape[-1]).to(dtype), b.reshape(-1, *b.shape[-2:]).to(dtype)
    )
    return flat.reshape(*batch, m, n)


def invariant_bmm_native(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm(a, b)`` with each output an ordered sum over the shared dimension."""
    batch, m, k = a.shape
    n = b.shape[-1]
    step = _row_chunks(m, batch * k * n)
    pieces = [
        ordered_sum(a[:, start : start + step, :, None].float() * b[:, None, :, :].float(), dim=-2)
        for start in range(0, m, step)
    ]
    out = torch.cat(pieces, dim=-2) if pieces else a.new_zeros((batch, 0, n), dtype=torch.float32)
    return out.to(a.dtype)


def _bmm_fake(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[-1]))


class _AsCalled(Sampler):
    """Conformance of the mode's batched matmul and attention: the call as made, with fresh random
    values (a mask kept as called). The configuration is the dtype, the device, the head sizes and
    the kinds of the other arguments, never the lengths, which change at every decode step."""

    kept = ("attn_mask",)

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        parts = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor):
                parts.append((value.dtype, value.device.type, value.dim(), value.shape[-1] if value.dim() > 2 else None))
            else:
                parts.append(value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__)
        return tuple(parts)

    def classes(self, args: tuple, kwargs: dict, thresholds: dict) -> list[ShapeClass]:
        return [ShapeClass("as called", layout="as called")]

    def make(self, shape_class: ShapeClass, args: tuple, kwargs: dict, generator: torch.Generator) -> tuple[tuple, dict]:
        makers = {
            name: (lambda value: _like_call(value, generator, 1.0))
            for name in self.names
            if name not in self.kept
        }
        return _replace(self, args, kwargs, makers)


INVARIANT_BMM = Op("invariant_bmm", invariant_bmm_native, library=True, fake=_bmm_fake, sampler=_AsCalled())


def _softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None, safe: bool = False, log: bool = False) -> Tensor:
    """Softmax (or log-softmax) along ``dim`` with an ordered sum. ``safe``: a row masked entirely
    gives zeros (as torch's scaled-dot-product attention does), not NaN."""
    out_dtype = dtype or x.dtype
    x = x.float() if x.dtype != torch.float64 else x
    top = x.amax(dim, keepdim=True)  # a maximum is exact in any order
    if safe:
        top = torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)
    shifted = x - top
    exp = _lanewise(torch.exp, shifted)
    total = ordered_sum(exp, dim, keepdim=True).to(exp.dtype)
    if log:
        return (shifted - _lanewise(torch.log, total)).to(out_dtype)
    out = exp / total
    if safe:
        out = torch.where(total == 0, torch.zeros_like(out), out)
    return out.to(out_dtype)


def _attention_mask(mask: Tensor | None, is_causal: bool, scores: Tensor) -> Tensor | None:
    """The additive mask of ``scores`` (``-inf`` where masked), or None."""
    additive = None
    if is_causal:
        q, k = scores.shape[-2], scores.shape[-1]
        allowed = torch.ones(q, k, dtype=torch.bool, device=scores.device).tril(k - q)
        additive = torch.zeros(q, k, device=scores.device).masked_fill(~allowed, float("-inf"))
    if mask is not None:
        extra = torch.zeros(mask.shape, device=scores.device).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask.float()
        additive = extra if additive is None else additive + extra
    return additive


def invariant_attention_native(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """Scaled-dot-product attention (``[batch, heads, length, dim]``, as many heads in every input)
    whose every sum is ordered: the scores over the head dimension, the softmax's total and the
    weighted values over the keys, masked keys contributing exact zeros."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = invariant_matmul(query.float(), key.float().transpose(-2, -1)) * scale
    additive = _attention_mask(attn_mask, is_causal, scores)
    if additive is not None:
        scores = scores + additive
    weights = _softmax(scores, -1, safe=True)
    return invariant_matmul(weights, value.float()).to(query.dtype)


def _attention_fake(query, key, value, attn_mask=None, is_causal=False, scale=None):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


INVARIANT_ATTENTION = Op(
    "invariant_attention", invariant_attention_native, library=True, fake=_attention_fake, sampler=_AsCalled()
)


def invariant_attention(query, key, value, attn_mask=None, is_causal=False, scale=None) -> Tensor:
    """Scaled-dot-product attention that computes each query the same way whatever the batch (dispatched)."""
    return _with_reference_backward(
        INVARIANT_ATTENTION, _sdpa_reference, query, key, value, attn_mask, is_causal, scale
    )


def _sdpa_reference(query, key, value, attn_mask=None, is_causal=False, scale=None) -> Tensor:
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


# ---------------------------------------------------------------------------------------------
# The torch functions a batch-invariant model's forward computes our way.


def _linear(input, weight, bias=None):
    return invariant_linear(input, weight, bias)


def _matmul(input, other, *, out=None):
    if out is not None:
        return NotImplemented
    return invariant_matmul(input, other)


def _rmatmul(self, other):
    return invariant_matmul(other, self)


def _baddbmm(input, batch1, batch2, *, beta=1, alpha=1, out=None):
    """``beta * input + alpha * (batch1 @ batch2)``, the product's sums ordered."""
    if out is not None:
        return NotImplemented
    product = invariant_matmul(batch1, batch2)
    scaled = product * alpha if alpha != 1 else product
    return scaled + (input * beta if beta != 1 else input) if beta != 0 else scaled


def _dims(x: Tensor, dim) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(x.dim()))
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(sorted(d % max(x.dim(), 1) for d in dim))


def _reduce(x: Tensor, dim, keepdim: bool, dtype, mean: bool) -> Tensor:
    """``x.sum(dim)`` / ``x.mean(dim)`` with the reduced dimensions flattened (in order) and summed in order."""
    dims = _dims(x, dim)
    if x.dim() == 0:
        return x.to(dtype) if dtype is not None else x.clone()
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims)
    flat = moved.reshape(*moved.shape[: len(kept)], -1)
    total = ordered_sum(flat, -1)
    if mean:
        total = total / flat.shape[-1]
    out_dtype = dtype or x.dtype
    if keepdim:
        total = total.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    return total.to(out_dtype)


def _sum(input, dim=None, keepdim=False, *, dtype=None, out=None):
    if out is not None or not (input.is_floating_point() or (dtype is not None and dtype.is_floating_point)):
        return NotImplemented
    return _reduce(input, dim, keepdim, dtype, mean=False)


def _mean(input, dim=None, keepdim=False, *, dtype=None, out=None):
    if out is not None or not input.is_floating_point():
        return NotImplemented
    return _reduce(input, dim, keepdim, dtype, mean=True)


def _softmax_fn(input, dim=None, _stacklevel=3, dtype=None, *, log: bool = False):
    if dim is None:
        return NotImplemented
    return _softmax(input, dim, dtype, log=log)


def _log_softmax_fn(input, dim=None, _stacklevel=3, dtype=None):
    return _softmax_fn(input, dim, _stacklevel, dtype, log=True)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        return NotImplemented  # dropout draws random numbers: no row is reproducible anyway
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    return invariant_attention(query, key, value, attn_mask, is_causal, scale)


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):  # fmt: skip
    if weight is not None or size_average is not None or reduce is not None or label_smoothing or target.is_floating_point():
        return NotImplemented
    classes = 1 if input.dim() > 1 else 0
    logp = _softmax(input, classes, torch.float32 if input.dtype != torch.float64 else None, log=True)
    keep = target != ignore_index
    picked = logp.gather(classes, target.where(keep, 0).unsqueeze(classes)).squeeze(classes)
    losses = torch.where(keep, -picked, torch.zeros_like(picked)).to(input.dtype)
    if reduction == "none":
        return losses
    total = ordered_sum(losses.reshape(-1), 0).to(input.dtype)
    return total if reduction == "sum" else total / keep.sum().to(total.dtype)


# A CPU computes a transcendental function in SIMD lanes, and the few elements past the last
# whole vector one at a time, with other rounding: where an element falls depends on the tensor's
# size and its place in it. The mode computes them on a copy whose rows are padded to whole vectors.
_LANES = 64


def _lanewise(func: Callable, x: Tensor, *args, **kwargs) -> Tensor:
    """``func(x)`` with every element of ``x`` through the same (vector) path of a CPU kernel."""
    if x.device.type != "cpu" or x.dim() == 0 or x.numel() == 0:
        return func(x, *args, **kwargs)
    n = x.shape[-1]
    width = -(-n // _LANES) * _LANES
    padded = x.new_zeros((*x.shape[:-1], width))
    padded[..., :n] = x
    return func(padded, *args, **kwargs)[..., :n]


def _elementwise(func: Callable) -> Callable:
    def compute(input, *args, **kwargs):
        if kwargs.get("out") is not None or kwargs.get("inplace") or (args and args[0] is True and func in _INPLACE_ARG):
            return NotImplemented
        return _lanewise(func, input, *args, **kwargs)

    return compute


def _handlers() -> dict[Callable, Callable]:
    t = torch.Tensor
    table = {
        F.linear: _linear,
        torch.matmul: _matmul,
        t.matmul: _matmul,
        t.__matmul__: _matmul,
        t.__rmatmul__: _rmatmul,
        torch.mm: _matmul,
        t.mm: _matmul,
        torch.bmm: _matmul,
        t.bmm: _matmul,
        torch.baddbmm: _baddbmm,
        t.baddbmm: _baddbmm,
        torch.sum: _sum,
        t.sum: _sum,
        torch.mean: _mean,
        t.mean: _mean,
        F.softmax: _softmax_fn,
        torch.softmax: _softmax_fn,
        t.softmax: _softmax_fn,
        F.log_softmax: _log_softmax_fn,
        torch.log_softmax: _log_softmax_fn,
        t.log_softmax: _log_softmax_fn,
        F.scaled_dot_product_attention: _sdpa,
        F.cross_entropy: _cross_entropy,
    }
    if hasattr(torch, "_grouped_mm"):
        table[torch._grouped_mm] = _grouped_mm
    for func in _TRANSCENDENTAL:
        table[func] = _elementwise(func)
    return table


_TRANSCENDENTAL = (
    F.silu, F.gelu, F.softplus, F.mish, F.elu, F.selu, torch.sigmoid, torch.Tensor.sigmoid, torch.tanh,
    torch.Tensor.tanh, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.erf, torch.Tensor.erf,
    torch.sin, torch.Tensor.sin, torch.cos, torch.Tensor.cos, torch.rsqrt, torch.Tensor.rsqrt, torch.sqrt,
    torch.Tensor.sqrt, torch.pow, torch.Tensor.pow, torch.reciprocal, torch.Tensor.reciprocal,
)  # fmt: skip
_INPLACE_ARG = (F.silu, F.elu, F.selu, F.mish)


def _grouped_mm(input, mat2, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` of rows grouped by ``offs`` (each group times its matrix), ordered."""
    if offs is None or bias is not None or input.dim() != 2 or mat2.dim() != 3 or mat2.dtype != input.dtype:
        return NotImplemented
    if torch.is_grad_enabled() and (input.requires_grad or mat2.requires_grad):
        out = invariant_grouped_mm_native(input, mat2, offs)  # each group through autograd's invariant matmul
    else:
        out = INVARIANT_GROUPED_MM(input, mat2, offs)
    return out.to(out_dtype) if out_dtype is not None else out


def invariant_grouped_mm_native(rows: Tensor, matrices: Tensor, ends: Tensor) -> Tensor:
    """``torch._grouped_mm(rows, matrices, offs=ends)`` with each output an ordered sum: the rows
    of group g (``ends[g-1]:ends[g]``) times ``matrices[g]``; rows past the last end are zeros.
    Reads the group ends on the host; the Triton provider does not."""
    pieces, start = [], 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            pieces.append(invariant_matmul(rows[start:end], matrices[group]))
        start = max(start, end)
    if start < rows.shape[0]:
        pieces.append(rows.new_zeros((rows.shape[0] - start, matrices.shape[-1])))
    return torch.cat(pieces) if pieces else rows.new_zeros((0, matrices.shape[-1]))


def _grouped_mm_fake(rows: Tensor, matrices: Tensor, ends: Tensor) -> Tensor:
    return rows.new_empty((rows.shape[0], matrices.shape[-1]))


class _GroupedAsCalled(_AsCalled):
    """The call as made with fresh rows and matrices, its groups kept."""

    kept = ("ends",)


INVARIANT_GROUPED_MM = Op(
    "invariant_grouped_mm", invariant_grouped_mm_native, library=True, fake=_grouped_mm_fake, sampler=_GroupedAsCalled()
)


# Functions that reduce along a row in an order the library chooses, which the mode does not
# replace: they run as they are and are recorded as not invariant.
def _unreplaced() -> dict[Callable, str]:
    t = torch.Tensor
    names = {
        F.layer_norm: "torch.nn.functional.layer_norm",
        F.group_norm: "torch.nn.functional.group_norm",
        F.normalize: "torch.nn.functional.normalize",
        torch.einsum: "torch.einsum",
        torch.addmm: "torch.addmm",
        t.addmm: "Tensor.addmm",
        torch.norm: "torch.norm",
        t.norm: "Tensor.norm",
        torch.linalg.vector_norm: "torch.linalg.vector_norm",
        torch.var: "torch.var",
        t.var: "Tensor.var",
        torch.std: "torch.std",
        t.std: "Tensor.std",
        torch.var_mean: "torch.var_mean",
        torch.logsumexp: "torch.logsumexp",
        t.logsumexp: "Tensor.logsumexp",
        torch.dot: "torch.dot",
        torch.mv: "torch.mv",
        t.mv: "Tensor.mv",
        torch.tensordot: "torch.tensordot",
        F.conv1d: "torch.nn.functional.conv1d",
        F.conv2d: "torch.nn.functional.conv2d",
        F.conv3d: "torch.nn.functional.conv3d",
        torch.prod: "torch.prod",
        t.prod: "Tensor.prod",
    }
    if hasattr(F, "rms_norm"):
        names[F.rms_norm] = "torch.nn.functional.rms_norm"
    return names


_HANDLERS: dict[Callable, Callable] | None = None
_UNREPLACED: dict[Callable, str] | None = None
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _caller() -> str:
    """The first frame outside torch and transfuse's ops: the model's line that made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not (name.startswith(_TORCH) or name.startswith(os.path.join(_HERE, "ops"))):
            return f"{os.path.basename(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class InvariantFunctions(TorchFunctionMode):
    """Computes the torch functions of the table above in their ordered forms; records the
    row-reducing functions it does not replace in ``found`` (name -> where called).

    Compiled code traces this mode and its handlers. A handler must trace without a graph break:
    Dynamo resumes a handler broken in the middle with another handler's code (the same torch
    function's result for every call after the break), a silent wrong answer.
    ``test_compiled_code_in_the_mode_computes_what_each_handler_computes_eagerly`` compiles every
    handler with ``fullgraph=True``."""

    def __init__(self, found: dict[str, str] | None = None):
        super().__init__()
        global _HANDLERS, _UNREPLACED
        if _HANDLERS is None:
            _HANDLERS, _UNREPLACED = _handlers(), _unreplaced()
        self.found = found if found is not None else {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None and _floating(args):
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        elif func in _UNREPLACED and not torch.compiler.is_compiling():
            name = _UNREPLACED[func]
            if name not in self.found:
                self.found[name] = _caller()
        return func(*args, **kwargs)


dispatch._INVARIANT_MODES = (InvariantFunctions,)


def _floating(args: tuple) -> bool:
    first = args[0] if args else None
    return isinstance(first, Tensor) and first.is_floating_point()


# ---------------------------------------------------------------------------------------------
# A model's mode.


class _State:
    """What ``enable`` keeps on a model: the functions its forwards called that are not invariant."""

    def __init__(self):
        self.found: dict[str, str] = {}


_STATE_ATTR = "_transfuse_batch_invariant"


class InvariantForward:
    """A batch-invariant model's ``forward``: its class's forward inside the mode."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)

    @property
    def __wrapped__(self):
        model = self._model()
        return type(model).forward.__get__(model) if model is not None else None

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(self.__wrapped__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if not torch.compiler.is_compiling() and _inside_the_mode():
            return type(model).forward(model, *args, **kwargs)  # (the caller entered the mode around the call)
        with entered(model):
            return type(model).forward(model, *args, **kwargs)

    def __reduce__(self):
        return (_forward_of, (self._model(),))


def _forward_of(model: nn.Module) -> InvariantForward:
    return InvariantForward(model)


def functions_of(model: nn.Module) -> InvariantFunctions:
    """A batch-invariant model's torch-function mode (what it finds recorded on the model)."""
    return InvariantFunctions(model.__dict__[_STATE_ATTR].found)


def entered(model: nn.Module) -> contextlib.AbstractContextManager:
    """A batch-invariant model's mode (dispatch's and the torch functions'), entered for a call of it."""
    stack = contextlib.ExitStack()
    stack.enter_context(batch_invariant_mode())
    stack.enter_context(functions_of(model))
    return stack


def _inside_the_mode() -> bool:
    return batch_invariant_active() and isinstance(torch.overrides._get_current_function_mode(), InvariantFunctions)


# The lines with which a compiled call's entry function (``transfuse.compile``'s, with ``model``
# and the call's arguments) calls a batch-invariant model's class forward: its caller entered the
# mode around the call (``compile.calls.DecodeCalls._functions``), which the model's own forward
# would enter inside the traced code, where Dynamo cannot trace the mode's context variable. Its
# namespace holds InvariantForward.
CLASS_FORWARD_IN_THE_MODE = (
    "    if isinstance(model.forward, InvariantForward):\n"
    "        return type(model).forward(model, *args, **kwargs)\n"
)


def enable(model: nn.Module) -> _State:
    """Make ``model`` batch-invariant: its forward runs in the mode from now on (its class and every
    other instance are untouched). Returns its state (``not_invariant`` reads it)."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        state = _State()
        object.__setattr__(model, _STATE_ATTR, state)
    if "forward" in model.__dict__ and not isinstance(model.__dict__["forward"], InvariantForward):
        raise ValueError(
            f"This {type(model).__name__} has a forward of its own set on the instance (a hook of another "
            "library); batch-invariant mode wraps the class's forward and cannot keep it. Enable the mode first."
        )
    model.__dict__["forward"] = InvariantForward(model)
    return state


def disable(model: nn.Module) -> None:
    """Undo ``enable``."""
    if isinstance(model.__dict__.get("forward"), InvariantForward):
        del model.__dict__["forward"]
    model.__dict__.pop(_STATE_ATTR, None)


def is_enabled(model: nn.Module) -> bool:
    return isinstance(model.__dict__.get("forward"), InvariantForward)


def not_invariant(model: nn.Module) -> dict[str, str]:
    """The functions a batch-invariant model's forward called that the mode does not make invariant
    (name -> the line that called it first), as far as its forwards have run."""
    state = model.__dict__.get(_STATE_ATTR)
    return dict(state.found) if state is not None else {}


def active() -> bool:
    return batch_invariant_active()
