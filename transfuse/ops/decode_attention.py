"""decode_attention: one decode step's attention, the new token's key and value written into the cache.

A decode step of a key/value-cached model does, per layer: append the token's key and value to
the cache, then attend its query to every cached key (grouped-query heads share a key/value
head; a padding mask may hide keys). Written as torch ops that is two concatenations of the
whole cache and three or four attention kernels, each a launch from Python, at a size where
the launches cost more host time than the GPU spends on them.

This op takes the cache as buffers with room (``keys``/``values`` ``[batch, kv_heads, capacity,
dim]``, the first ``n`` positions filled): it writes the new token at position ``n`` and
attends over the ``n + 1``. The native definition does that with torch ops (a copy, then
``scaled_dot_product_attention``); the Triton provider does both in one kernel. The output is
``[batch, 1, heads, dim]``, the layout the model's output projection reads.

``allowed`` (``[batch, n + 1]`` booleans, or None for all) hides keys; the new token's own
position is always attended to (a padding query's output is never read, and must not be NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import Op

__all__ = ["DECODE_ATTENTION", "decode_attention", "decode_attention_native"]


def decode_attention_native(
    query: Tensor, key: Tensor, value: Tensor, keys: Tensor, values: Tensor, n: int, allowed: Tensor | None, scaling: float
) -> Tensor:
    """``query`` ``[B, H, 1, D]``; ``key``/``value`` ``[B, KVH, 1, D]`` the new token's; ``keys``/``values``
    the cache buffers. Writes the token at position ``n``; returns ``[B, 1, H, D]``."""
    keys[:, :, n : n + 1].copy_(key)
    values[:, :, n : n + 1].copy_(value)
    k, v = keys[:, :, : n + 1], values[:, :, : n + 1]
    mask = None
    if allowed is not None:
        mask = allowed.clone()
        mask[:, -1] = True
        mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


DECODE_ATTENTION = Op("decode_attention", decode_attention_native)


def decode_attention(
    query: Tensor, key: Tensor, value: Tensor, keys: Tensor, values: Tensor, n: int, allowed: Tensor | None, scaling: float
) -> Tensor:
    """One decode step's attention over a cache with room (see the module docstring)."""
    batch, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    if tokens != 1 or key.shape != (batch, kv_heads, 1, dim) or value.shape[:3] != (batch, kv_heads, 1):
        raise ValueError(
            f"decode_attention takes one token: query [B, H, 1, D], key and value [B, KVH, 1, D]; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
        )
    if heads % kv_heads or keys.shape[:2] != (batch, kv_heads) or keys.shape[2] <= n or values.shape[2] <= n:
        raise ValueError(
            f"decode_attention: {heads} query heads over {kv_heads} key/value heads, and buffers "
            f"{tuple(keys.shape)} / {tuple(values.shape)} with room for position {n}."
        )
    if allowed is not None and allowed.shape != (batch, n + 1):
        raise ValueError(f"decode_attention: allowed must be [batch, n + 1] = {(batch, n + 1)}, got {tuple(allowed.shape)}.")
    with torch.no_grad():
        return DECODE_ATTENTION(query, key, value, keys, values, int(n), allowed, float(scaling))
