"""Attention with its KV cache, as one op the compiled graph does not see into.

The compile path hands the model no cache: every attention layer's cache write and attention
run in ``transfuse::cached_attention``, an opaque custom op, so the graph Dynamo captures has
the same shapes at every decode step whatever the cache holds (a ``DynamicCache`` grows
without a recompile or a recapture), and the backend can split the graph at these ops.

The op reads the cache and the 2D padding mask of the current call from a ``Step``, which
``compiled_forward`` opens around each call of the compiled model. It writes through the
cache's own ``update`` (so the cache the caller holds is the one that grows, and
``generate`` crops it and returns it as usual), builds the mask from absolute positions
(causal, the padding mask, a sliding window) and runs ``scaled_dot_product_attention``, the
``decode_attention`` op for a decode step's one query under a mask (SDPA with a mask picks
kernels whose host cost per call is several times this op's), or a plain softmax where a layer
soft-caps its scores or has attention sinks.

A decode step whose ``Step`` carries a ``KVStore`` (``kv_store.py``) writes and attends there
instead, over buffers of fixed shape and address, so the whole step can be one CUDA graph; a
layer the store cannot serve raises ``StoreUnusable`` and the caller runs the call again without it.

The model's attention is switched to this op by registering it with transformers as the
attention implementation ``"transfuse"``; transformers then builds no mask of its own (it
builds none for implementations it does not know), which is what keeps the mask out of the
graph.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.decode_attention import decode_attention
from ..ops.dispatch import batch_invariant_active

__all__ = ["IMPLEMENTATION", "Step", "attention_forward", "cached_attention", "current_step", "current_store", "step"]

IMPLEMENTATION = "transfuse"

# Keyword arguments transformers' attention modules pass on that say nothing the op needs:
# positions the cache (which the op owns) tracks itself. Flags (booleans) are for other
# layers (``output_router_logits``) and are ignored too; any other argument is refused.
_IGNORED = frozenset({"position_ids", "cache_position"})


@dataclass
class Step:
    """One call of a compiled model: the cache it reads and grows, and its padding mask
    (``[batch, cached + new tokens]``, True where a token may be attended to; None: all may)."""

    cache: Any = None
    padding: Tensor | None = None
    # A decode step whose keys and values live in a ``KVStore`` (``kv_store.py``): every
    # layer writes and attends there, with fixed shapes and addresses.
    store: Any = None
    # Masks of this call, shared by the layers that ask for the same one.
    masks: dict[tuple, Tensor | None] = field(default_factory=dict)
    # The cache layers this call's attention op served, in order (``unserved``), and whether the
    # call's whole step was replayed as a graph instead (no Python ran to record them).
    attended: list[int] = field(default_factory=list)
    replayed: bool = False

    def unserved(self) -> str | None:
        """Why the call was not served as the model's own forward would have served it, or None:
        each of the cache's layers must have had its attention through the op exactly once (a
        layer of the model's own that does not call transformers' attention functions would
        have attended without the cache, which the call does not hand to the model)."""
        if self.cache is None or self.replayed:
            return None
        layers = len(self.cache.layers)
        if sorted(self.attended) == list(range(layers)):
            return None
        missing = sorted(set(range(layers)) - set(self.attended))
        twice = sorted({layer for layer in self.attended if self.attended.count(layer) > 1})
        return (
            f"of the cache's {layers} layers, {len(missing)} did not attend through transformers' attention functions"
            + (f" and {len(twice)} attended more than once" if twice else "")
        )


class _Steps(threading.local):
    """The calls in progress in this thread, the innermost last (two threads' calls, of one model
    or two, each read their own cache and store)."""

    def __init__(self) -> None:
        self.stack: list[Step] = []


_STEPS = _Steps()


def current_store() -> Any:
    """The ``KVStore`` of this thread's call in progress, or None."""
    steps = _STEPS.stack
    return steps[-1].store if steps else None


def current_step() -> Step | None:
    steps = _STEPS.stack
    return steps[-1] if steps else None


@contextlib.contextmanager
def step(cache: Any, padding: Tensor | None, store: Any = None) -> Iterator[Step]:
    current = Step(cache, padding, store)
    steps = _STEPS.stack
    steps.append(current)
    try:
        yield current
    finally:
        steps.pop()


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function registered as ``"transfuse"``: transformers' calling convention
    (``query`` ``[batch, heads, tokens, dim]``, the output ``[batch, tokens, heads, dim]``)."""
    if attention_mask is not None:
        raise NotImplementedError(
            f"transfuse.compile: {type(module).__name__} receives an attention mask the model "
            "built itself; the compile path builds masks from the cache and the padding mask "
            "only, so this model runs through the eager path"
        )
    if dropout:
        raise NotImplementedError("transfuse.compile is an inference path: attention dropout must be 0")
    extra = sorted(
        name
        for name, value_ in kwargs.items()
        if name not in _IGNORED and value_ is not None and not isinstance(value_, bool)
    )
    if extra:
        raise NotImplementedError(
            f"transfuse.compile: {type(module).__name__} passes attention arguments the compile "
            f"path does not implement: {', '.join(extra)}"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise NotImplementedError(
            f"transfuse.compile: {type(module).__name__} has no layer_idx, so its cache layer is unknown"
        )
    output = torch.ops.transfuse.cached_attention(
        query,
        key,
        value,
        s_aux,
        int(layer),
        float(scaling if scaling is not None else query.shape[-1] ** -0.5),
        int(sliding_window or 0),
        float(softcap or 0.0),
        bool(getattr(module, "is_causal", True)),
    )
    return output, None


def cached_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    sinks: Tensor | None,
    layer: int,
    scaling: float,
    sliding_window: int,
    softcap: float,
    causal: bool,
) -> Tensor:
    current = current_step() or Step()
    current.attended.append(layer)
    cache = current.cache
    new = query.shape[2]
    if current.store is not None:
        if softcap or sinks is not None or sliding_window or not causal or new != 1:
            from .kv_store import StoreUnusable

            raise StoreUnusable(f"layer {layer} attends with a window, soft-capping, sinks or no causal mask")
        return current.store.attend(layer, query, key, value, scaling, current.masks)
    if cache is not None:
        seen = cache.get_seq_length(layer)
        key, value = cache.update(key, value, layer)
    else:
        seen = 0
    mask, is_causal = _mask(current, query, key.shape[2], seen, new, sliding_window, causal)
    if new == 1 and mask is not None and not softcap and sinks is None:
        return decode_attention(query, key, value, _bias(current, mask, query.dtype, key.shape[1]), scaling)
    # This op runs outside Dynamo, where the torch-function mode a batch-invariant model's forward
    # enters (which Dynamo traced) need not be active: the mode's attention is entered here (SDPA's
    # kernels choose their key blocks by the sequence's length, so a left-padded prompt would be
    # summed in other blocks than alone).
    with _invariant_functions() if batch_invariant_active() else contextlib.nullcontext():
        if softcap or sinks is not None:
            output = _attend_softmax(query, key, value, mask, is_causal, scaling, softcap, sinks)
        else:
            output = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1],
            )
    return output.transpose(1, 2).contiguous()


def _invariant_functions() -> Any:
    from ..ops.batch_invariant import InvariantFunctions

    return InvariantFunctions()


# The op the graph holds. The backend calls ``cached_attention`` directly in its place: the
# dispatcher's custom-op path costs tens of microseconds a call, every layer, every token.
_cached_attention_op = torch.library.custom_op("transfuse::cached_attention", mutates_args=())(cached_attention)


@_cached_attention_op.register_fake
def _(query, key, value, sinks, layer, scaling, sliding_window, softcap, causal):
    batch, heads, tokens, _ = query.shape
    return query.new_empty(batch, tokens, heads, value.shape[-1])


def _mask(
    current: Step, query: Tensor, kv_length: int, seen: int, new: int, window: int, causal: bool
) -> tuple[Tensor | None, bool]:
    """(boolean mask ``[batch or 1, 1, new, kv_length]`` or None, whether SDPA's own causal mask
    is the whole mask). Keys are the last ``kv_length`` of the ``seen + new`` tokens (a sliding
    cache keeps only the last ones); queries are the last ``new``."""
    first_key = seen + new - kv_length
    window_bites = window > 0 and kv_length > window
    if current.padding is None and not window_bites:
        if not causal or new == 1:
            return None, False
        if first_key == 0 and new == kv_length:
            return None, True
    key_ = (first_key, kv_length, seen, new, window, causal)
    if key_ in current.masks:
        return current.masks[key_], False
    if new == 1 and not window_bites:
        # A decode step: one query, which may attend to every key but padding. It always may
        # attend to itself (a padding query's output is never read, and it must not be NaN).
        allowed = current.padding[:, first_key : first_key + kv_length]
        allowed = allowed.to(device=query.device, dtype=torch.bool, copy=True)
        allowed[:, -1] = True
        allowed = allowed[:, None, None, :]
        current.masks[key_] = allowed
        return allowed, False
    device = query.device
    keys = torch.arange(first_key, first_key + kv_length, device=device)
    queries = torch.arange(seen, seen + new, device=device)
    allowed = torch.ones(new, kv_length, dtype=torch.bool, device=device)
    if causal:
        allowed = keys[None, :] <= queries[:, None]
    if window > 0:
        allowed = allowed & (queries[:, None] - keys[None, :] < window)
    allowed = allowed[None, None]
    if current.padding is not None:
        padding = current.padding[:, first_key : first_key + kv_length].to(device=device, dtype=torch.bool)
        allowed = allowed & padding[:, None, None, :]
    # A query that may attend to nothing (a padding token) attends to everything instead: its
    # output is never read, and a row of -inf would make it NaN, which the next layer's zero
    # attention weights would spread to every token (0 * NaN).
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    current.masks[key_] = allowed
    return allowed, False


def _bias(current: Step, mask: Tensor, dtype: torch.dtype, kv_heads: int) -> Tensor:
    """A decode step's boolean mask ``[batch, 1, 1, keys]`` as 0 / -inf in ``dtype``, one row per
    (sequence, key/value head) as ``decode_attention`` takes it: made once a call for all layers."""
    key_ = ("bias", mask.data_ptr(), dtype, kv_heads)
    found = current.masks.get(key_)
    if found is None:
        batch, keys = mask.shape[0], mask.shape[-1]
        found = torch.zeros((batch, kv_heads, 1, keys), dtype=dtype, device=mask.device)
        found.masked_fill_(~mask.reshape(batch, 1, 1, keys), -math.inf)
        found = found.reshape(batch * kv_heads, 1, keys)
        current.masks[key_] = found
    return found


def _attend_softmax(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scaling: float,
    softcap: float,
    sinks: Tensor | None,
) -> Tensor:
    """Attention written out, for what SDPA does not take: scores soft-capped
    (``softcap * tanh(s / softcap)``) and sink logits (one per head, a column every query may
    attend to that has no value), with the softmax in float32 as transformers' eager path."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        new, kv_length = scores.shape[-2:]
        mask = torch.ones(new, kv_length, dtype=torch.bool, device=scores.device).tril(kv_length - new)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, column.to(scores.dtype)], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    return torch.matmul(weights, value)


def register() -> None:
    """Make ``"transfuse"`` an attention implementation transformers accepts (idempotent)."""
    from transformers import AttentionInterface

    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, attention_forward)
