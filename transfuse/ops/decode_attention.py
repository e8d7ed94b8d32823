"""decode_attention: one query per sequence attending over a buffer of keys and values.

``query`` ``[batch, heads, 1, dim]``, ``keys``/``values`` ``[batch, kv_heads, length, dim]``
(``heads`` a multiple of ``kv_heads``: the query heads of one key/value head share it), and an
additive ``bias`` ``[batch * kv_heads, 1, length]`` (0 where a key may be attended to, -inf
where not): ``softmax(scaling * q k^T + bias) v``, returned as ``[batch, 1, heads, dim]``, the
layout transformers' attention functions return. With ``key``, ``value`` (``[batch, kv_heads, 1,
dim]``) and ``position`` (a one-element int64 tensor on the device), the token's key and value are
first written into the buffers at that position (in place), so a decode step that keeps its cache
in fixed buffers (``transfuse/compile/kv_store.py``) writes and attends in one call.

The native definition is three kernels (scores with the bias added, the softmax, the weighted
sum), each rounding to the query's dtype as the eager path's separate ops do; in batch-invariant
mode it is the mode's attention of the same query (in float32, its sums ordered), so a row's
decode step has the same bits as that row through ``scaled_dot_product_attention``. The Triton provider
(``ops/triton/decode_attention.py``) is one pass over the keys in blocks (the softmax online, in
float32) split over programs, and a second small kernel that combines the splits; it writes the
token itself. Forward only: a call that needs a gradient runs the native definition. On the
H200 the Triton provider takes 7 us where native takes 17.5 at one sequence of Llama-3-8B's heads
over 768 keys (``benchmarks/decode_attention_kernel.py``; ``benchmarks/results/``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Hashable

from .conformance import Sampler, ShapeClass, _random_like
from .dispatch import Op, batch_invariant_active

__all__ = ["DECODE_ATTENTION", "decode_attention", "decode_attention_native"]


def decode_attention_native(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    scaling: float,
    key: Tensor | None = None,
    value: Tensor | None = None,
    position: Tensor | None = None,
) -> Tensor:
    """``[batch, 1, heads, dim]``; see the module's docstring."""
    if key is not None:
        keys.index_copy_(2, position, key.to(keys.dtype))
        values.index_copy_(2, position, value.to(values.dtype))
    if batch_invariant_active():
        return _invariant(query, keys, values, bias, scaling)
    batch, heads, _, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    # The query heads of one key/value head are one matrix: the buffers are never repeated per head.
    grouped = query.reshape(batch * kv_heads, heads // kv_heads, dim)
    keys_t = keys.reshape(batch * kv_heads, length, dim).transpose(1, 2)
    scores = torch.baddbmm(bias, grouped, keys_t, alpha=scaling)
    weights = torch.softmax(scores, dim=-1)
    output = torch.bmm(weights, values.reshape(batch * kv_heads, length, values.shape[-1]))
    return output.reshape(batch, heads, 1, values.shape[-1]).transpose(1, 2).contiguous()


def _invariant(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scaling: float) -> Tensor:
    """In batch-invariant mode: the query's row computed as the mode's attention computes it
    (``batch_invariant.invariant_attention``, dispatched), so a decode step gives the same bits
    whether its attention comes here (a padded batch, a step over fixed buffers) or to
    ``scaled_dot_product_attention`` (a sequence alone)."""
    from .batch_invariant import invariant_attention

    batch, heads = query.shape[:2]
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    mask = bias.reshape(batch, kv_heads, 1, length)
    if group > 1:
        keys, values, mask = (t.repeat_interleave(group, 1) for t in (keys, values, mask))
    return invariant_attention(query, keys, values, mask, False, scaling).transpose(1, 2).contiguous()


class _DecodeSampler(Sampler):
    """One query per sequence over buffers of keys and values: classes of batch and length (one
    key, a few, a long buffer), a batch in which some sequences' first keys are masked (left
    padding), and both sides of the providers' declared ``"batch"`` and ``"length"`` thresholds.
    With ``key``, ``value`` and ``position`` the token is written into the buffers, which are
    compared too."""

    grads = ("query", "keys", "values")

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        query, keys, values = args[:3]
        writes = (len(args) > 5 and args[5] is not None) or kwargs.get("key") is not None
        return (query.dtype, query.device.type, query.shape[1:], keys.shape[1], keys.shape[-1], values.shape[-1],
                keys.dtype, writes)  # fmt: skip

    def describe(self, args: tuple, kwargs: dict) -> str:
        query, keys = args[:2]
        return (f"{str(query.dtype).replace('torch.', '')} on {query.device.type}, {query.shape[1]} heads over "
                f"{keys.shape[1]} of {keys.shape[-1]}")  # fmt: skip

    def classes(self, args: tuple, kwargs: dict, thresholds: dict) -> list[ShapeClass]:
        batch, length = args[1].shape[0], args[1].shape[2]
        found = [
            ShapeClass(f"as called ({batch} x {length} keys)", (("batch", batch), ("length", length))),
            ShapeClass("1 key", (("batch", 1), ("length", 1))),
            ShapeClass("1 sequence of 9 keys", (("batch", 1), ("length", 9))),
            ShapeClass("3 sequences of 40 keys, some padded", (("batch", 3), ("length", 40)), data="padded"),
        ]
        for size in sorted(thresholds.get("length", ())):
            for n in (size - 1, size):
                if n >= 1:
                    found.append(ShapeClass(f"{n} keys", (("batch", 1), ("length", n))))
        for size in sorted(thresholds.get("batch", ())):
            for n in (size - 1, size):
                if n >= 1:
                    found.append(ShapeClass(f"{n} sequences of 150 keys", (("batch", n), ("length", 150))))
        return found

    def make(self, shape_class: ShapeClass, args: tuple, kwargs: dict, generator) -> tuple[tuple, dict]:
        query, keys, values, bias, scaling = args[:5]
        key, value, position = (list(args[5:]) + [kwargs.get(n) for n in ("key", "value", "position")][len(args[5:]):])[:3]
        batch, length = shape_class.size("batch", 1), shape_class.size("length", 1)
        heads, dim, kv_heads, value_dim = query.shape[1], query.shape[-1], keys.shape[1], values.shape[-1]

        def rand(shape, like):
            return _random_like(shape, like.dtype, like.device, generator)

        mask = torch.zeros(batch * kv_heads, 1, length, dtype=bias.dtype, device=bias.device)
        if shape_class.data == "padded" and length > 2:
            for b in range(1, batch):
                mask[b * kv_heads : (b + 1) * kv_heads, :, : min(b * 3, length - 1)] = float("-inf")
        new = [rand((batch, heads, 1, dim), query), rand((batch, kv_heads, length, dim), keys),
               rand((batch, kv_heads, length, value_dim), values), mask, scaling]  # fmt: skip
        if key is not None:
            where = torch.tensor([length - 1], dtype=position.dtype, device=position.device)
            new += [rand((batch, kv_heads, 1, dim), key), rand((batch, kv_heads, 1, value_dim), value), where]
        return tuple(new), {}

    def mutated(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        return (1, 2) if len(args) > 5 and args[5] is not None else ()


DECODE_ATTENTION = Op("decode_attention", decode_attention_native, sampler=_DecodeSampler())


def decode_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    scaling: float,
    key: Tensor | None = None,
    value: Tensor | None = None,
    position: Tensor | None = None,
) -> Tensor:
    """``softmax(scaling * q k^T + bias) v`` of one query per sequence, ``[batch, 1, heads, dim]``;
    with ``key``, ``value`` and ``position``, the token written into ``keys``/``values`` first."""
    batch, heads, new, dim = query.shape
    if new != 1 or keys.dim() != 4 or keys.shape[0] != batch or heads % keys.shape[1]:
        raise ValueError(
            f"decode_attention takes one query per sequence [batch, heads, 1, dim] and buffers "
            f"[batch, kv_heads, length, dim] with heads a multiple of kv_heads; got query "
            f"{tuple(query.shape)}, keys {tuple(keys.shape)}."
        )
    if values.shape[:3] != keys.shape[:3] or keys.shape[-1] != dim:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not match the query's {dim}.")
    if bias.shape != (batch * keys.shape[1], 1, keys.shape[2]):
        raise ValueError(
            f"decode_attention's bias is [batch * kv_heads, 1, length] = "
            f"{(batch * keys.shape[1], 1, keys.shape[2])}; got {tuple(bias.shape)}."
        )
    if (key is None) != (value is None) or (key is None) != (position is None):
        raise ValueError("decode_attention writes a token only given all of key, value and position.")
    return DECODE_ATTENTION(query, keys, values, bias, float(scaling), key, value, position)
