"""Keys and values in buffers with room, so a whole decode step is one CUDA graph.

With the cache outside the graph, every layer's attention runs from Python at every token
(the cache's two concatenations, the mask, the attention, the copies into the next piece's
graph): about 90 launches a token at 8 layers, and the host, not the GPU, sets the pace.

A ``KVStore`` holds every layer's keys and values for one batch in buffers of a fixed
capacity, ``[batch, kv_heads, capacity, head_dim]``, and the cache's layers hold views of
them (``buffer[:, :, :length]``): the cache stays an ordinary ``DynamicCache`` for whoever
reads it (``get_seq_length``, ``generate``'s crop, a cache ``generate`` returns). A decode step
writes its token's key and value at the position a one-element device tensor holds and attends
over the whole capacity, the positions past the token masked out, in one ``decode_attention``
call (on a GPU a Triton kernel that writes the token as it reads), so every address and shape of
the step is fixed for a capacity and the backend replays the whole step, every layer and its
attention, as one CUDA graph (``backend.StepGraph``). The host's work per token is then the
graph's launch, the position and the padding mask written into their buffers, and a view per
layer.

The capacity grows by half (in multiples of ``GRANULE`` positions) when a token would not fit;
new buffers mean a new capture. Buffers are zeroed when made: masked positions have weight 0,
and ``0 * NaN`` from uninitialised memory would be NaN.

One store serves one cache at a time. When another cache of the same shapes takes it (a second
``generate`` call), the layers of the one that held it are given copies of their keys and values
first, so a cache kept from an earlier call still holds its own tokens.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any

import torch
from torch import Tensor

from ..ops.decode_attention import decode_attention

__all__ = ["GRANULE", "KVStore", "StoreUnusable", "signature"]

# Capacities are multiples of this many positions.
GRANULE = 256
# Names of stores; a graph's key holds its store's (never reused, as ``id`` would be).
_NAMES = itertools.count()
_LIVE: set[tuple] = set()


def live(key: tuple) -> bool:
    """Whether a graph keyed with this store key can still be replayed."""
    return key in _LIVE


class StoreUnusable(Exception):
    """A layer's attention needs more than the store gives (a window, soft-capping, sinks, a
    mask that is not causal), or its keys and values are not what its cache holds (latent
    attention caches its compressed latents): the call is run again without the store."""


def signature(cache: Any, length: int) -> tuple | None:
    """What a store for ``cache`` must match: each layer's batch, heads, head dims, dtype and
    device; None unless every layer holds ``length`` positions (a layer that holds nothing yet,
    or fewer than the others, is not one the store can serve)."""
    parts = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, Tensor) or not isinstance(values, Tensor) or keys.dim() != 4 or values.dim() != 4:
            return None
        if keys.shape[-2] != length or values.shape[-2] != length:
            return None
        parts.append((keys.shape[0], keys.shape[1], keys.shape[3], values.shape[1], values.shape[3], keys.dtype, keys.device))
    return tuple(parts)


class KVStore:
    def __init__(self, layout: tuple):
        self.layout = layout
        self.batch = layout[0][0]
        self.device = layout[0][6]
        self.capacity = 0
        self.name = next(_NAMES)
        # Bumped when the buffers are made again: a graph reads them by address.
        self.generation = 0
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        # Where this step's token goes (a one-element int64 tensor, read by the graph).
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        # [batch, capacity]: the padding mask of the positions held (True: may be attended to).
        self.allowed: Tensor | None = None
        self.arange: Tensor | None = None
        self._padded = False
        self._owner: Any = None

    def key(self) -> tuple:
        return (self.name, self.generation)

    def retire(self) -> None:
        """No graph replays this store again. A cache that holds views of its buffers keeps
        them (and its tokens) alive as long as it lives."""
        _LIVE.discard(self.key())

    # -- host side, around each decode step --------------------------------------------------

    def begin(self, cache: Any, padding: Tensor | None, seen: int) -> None:
        """Make the buffers hold ``cache``'s ``seen`` positions, with room for one more, and
        write the step's position and padding mask."""
        if seen + 1 > self.capacity:
            self._grow(seen + 1)
        if not self._holds(cache, seen):
            self._adopt(cache, seen)
        self.position.fill_(seen)
        if padding is None:
            if self._padded:
                self.allowed.fill_(True)
                self._padded = False
        else:
            self.allowed[:, : seen + 1].copy_(padding)
            self._padded = True

    def end(self, cache: Any, length: int) -> None:
        """After the step: the cache's layers are views of the first ``length`` positions."""
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            layer.keys = keys.narrow(2, 0, length)
            layer.values = values.narrow(2, 0, length)

    def owner(self) -> Any:
        return self._owner() if self._owner is not None else None

    def _holds(self, cache: Any, seen: int) -> bool:
        if self.owner() is not cache:
            return False
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            held_keys, held_values = layer.keys, layer.values
            if (
                held_keys.data_ptr() != keys.data_ptr()
                or held_values.data_ptr() != values.data_ptr()
                or held_keys.shape[2] != seen
                or held_values.shape[2] != seen
                or held_keys.stride() != keys.stride()
                or held_values.stride() != values.stride()
            ):
                return False
        return True

    def _release(self) -> None:
        """The cache that held the buffers gets copies of what its layers see in them."""
        owner = self.owner()
        self._owner = None
        if owner is None:
            return
        for layer, keys, values in zip(owner.layers, self.keys, self.values):
            if _aliases(layer.keys, keys):
                layer.keys = layer.keys.clone()
            if _aliases(layer.values, values):
                layer.values = layer.values.clone()

    def _adopt(self, cache: Any, seen: int) -> None:
        self._release()
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            keys[:, :, :seen].copy_(layer.keys)
            values[:, :, :seen].copy_(layer.values)
        self._owner = weakref.ref(cache)
        self.end(cache, seen)

    def _grow(self, need: int) -> None:
        capacity = GRANULE * math.ceil(max(need, self.capacity * 3 // 2) / GRANULE)
        owner = self.owner()
        held = owner.layers[0].keys.shape[2] if owner is not None and self._holds(owner, owner.layers[0].keys.shape[2]) else 0
        keys, values = [], []
        for index, (batch, heads, dim, value_heads, value_dim, dtype, device) in enumerate(self.layout):
            keys.append(torch.zeros(batch, heads, capacity, dim, dtype=dtype, device=device))
            values.append(torch.zeros(batch, value_heads, capacity, value_dim, dtype=dtype, device=device))
            if held:
                keys[-1][:, :, :held].copy_(self.keys[index][:, :, :held])
                values[-1][:, :, :held].copy_(self.values[index][:, :, :held])
        self.keys, self.values = keys, values
        allowed = torch.ones(self.batch, capacity, dtype=torch.bool, device=self.device)
        if self.allowed is not None:
            allowed[:, : self.capacity].copy_(self.allowed)
        self.allowed = allowed
        self.arange = torch.arange(capacity, device=self.device)
        self.capacity = capacity
        _LIVE.discard(self.key())
        self.generation += 1
        _LIVE.add(self.key())
        if held:
            self.end(owner, held)

    # -- inside the step (and its graph) ---------------------------------------------------

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float, masks: dict) -> Tensor:
        """Write one token's key and value (``[batch, heads, 1, dim]``) at the position and attend
        to the layer's whole buffers with ``bias``, in one ``decode_attention`` call:
        ``[batch, 1, heads, dim]``."""
        keys, values = self.keys[layer], self.values[layer]
        if key.shape[:2] != keys.shape[:2] or key.shape[-1] != keys.shape[-1] or value.shape[-1] != values.shape[-1]:
            raise StoreUnusable(
                f"layer {layer} attends with keys and values of {tuple(key.shape[1::2])} and "
                f"{tuple(value.shape[1::2])} (heads, size) but its cache holds {tuple(keys.shape[1::2])} and "
                f"{tuple(values.shape[1::2])}: the model caches something else (latent attention caches its latents)"
            )
        bias = self.bias(query.dtype, keys.shape[1], masks)
        key, value = key.to(keys.dtype), value.to(values.dtype)
        return decode_attention(query, keys, values, bias, scaling, key, value, self.position)

    def bias(self, dtype: torch.dtype, kv_heads: int, masks: dict) -> Tensor:
        """0 / -inf ``[batch * kv_heads, 1, capacity]``: the positions before the token where
        the padding allows, and the token itself (made once a step, shared by the layers)."""
        found = masks.get(("store", dtype, kv_heads))
        if found is None:
            before = self.arange < self.position
            allowed = (before & self.allowed) | (self.arange == self.position)
            found = torch.zeros((self.batch, kv_heads, 1, self.capacity), dtype=dtype, device=self.device)
            found.masked_fill_(~allowed.reshape(self.batch, 1, 1, self.capacity), -math.inf)
            found = found.reshape(self.batch * kv_heads, 1, self.capacity)
            masks[("store", dtype, kv_heads)] = found
        return found


def _aliases(view: Any, buffer: Tensor) -> bool:
    return isinstance(view, Tensor) and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
