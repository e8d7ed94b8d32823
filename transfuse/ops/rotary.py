"""rotary: the rotate-half rotary position embedding of the query and key, as Llama applies it.

``q * cos + rotate_half(q) * sin`` (and the same for ``k``), where ``rotate_half(x)`` is
``[-x2 | x1]`` for the halves ``x1, x2`` of the last dimension and ``cos``/``sin`` (``[batch or 1,
seq, head_dim]``) are unsqueezed at ``unsqueeze_dim`` to broadcast over the heads. The native
definition is Hugging Face's ``apply_rotary_pos_emb``, op for op, so it rounds where that function
rounds: each product and the sum in the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import Op, under_compile_use_library_op

__all__ = ["ROTARY", "rotary", "rotary_native"]


def _rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_native(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, cos and sin unsqueezed
    at ``unsqueeze_dim``: Hugging Face's ``apply_rotary_pos_emb``, the same ops in the same order."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


ROTARY = Op("rotary", rotary_native)


@torch.library.custom_op("transfuse::rotary", mutates_args=())
def _rotary_library_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    return ROTARY(q, k, cos, sin, unsqueeze_dim)


@_rotary_library_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    return rotary_native(q, k, cos, sin, unsqueeze_dim)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """The rotary embedding of ``q`` and ``k`` (``[batch, heads, seq, head_dim]`` with
    ``unsqueeze_dim=1``, ``[batch, seq, heads, head_dim]`` with 2; the two may differ in heads),
    for ``cos``/``sin`` of ``[batch or 1, seq, head_dim]``: ``(q_embed, k_embed)``."""
    if torch.compiler.is_compiling():
        if under_compile_use_library_op("rotary", (q, k, cos, sin)):
            return torch.ops.transfuse.rotary(q, k, cos, sin, unsqueeze_dim)
        return rotary_native(q, k, cos, sin, unsqueeze_dim)
    return ROTARY(q, k, cos, sin, unsqueeze_dim)
