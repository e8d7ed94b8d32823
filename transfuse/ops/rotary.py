"""rotary: the rotate-half rotary position embedding of the query and key, as Llama applies it.

``q * cos + rotate_half(q) * sin`` (and the same for ``k``), where ``rotate_half(x)`` is
``[-x2 | x1]`` for the halves ``x1, x2`` of the last dimension and ``cos``/``sin`` (``[batch or 1,
seq, head_dim]``) are unsqueezed at ``unsqueeze_dim`` to broadcast over the heads. The native
definition is Hugging Face's ``apply_rotary_pos_emb``, op for op, so it rounds where that function
rounds: each product and the sum in the input dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

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


def rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, original: Callable | None = None
) -> tuple[Tensor, Tensor]:
    """The rotary embedding of ``q`` and ``k`` (``[batch, heads, seq, head_dim]`` with
    ``unsqueeze_dim=1``, ``[batch, seq, heads, head_dim]`` with 2; the two may differ in heads),
    for ``cos``/``sin`` of ``[batch or 1, seq, head_dim]``: ``(q_embed, k_embed)``.

    ``original`` is the model's own function this call stands for (a rewritten forward passes
    it by its global name, so it is whatever the name holds at the time of the call): while it
    is a function proved to compute this op (``transfuse/fusers/rotary.py``), the op runs; a
    function patched in later (another library's kernel, a user's change) is called instead.
    Under ``torch.compile`` the function itself is traced."""
    if original is not None and (torch.compiler.is_compiling() or not _proved(original, unsqueeze_dim)):
        return original(q, k, cos, sin)
    if torch.compiler.is_compiling():
        if under_compile_use_library_op("rotary", (q, k, cos, sin)):
            return torch.ops.transfuse.rotary(q, k, cos, sin, unsqueeze_dim)
        return rotary_native(q, k, cos, sin, unsqueeze_dim)
    return ROTARY(q, k, cos, sin, unsqueeze_dim)


# Functions checked by the prover (the rotary fuser's proof, installed by it: ops do not import
# fusers): the unsqueeze dimension at which each computes this op, or 0 where it does not.
_PROVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROVER: list[Callable[[Callable], int | None]] = []


def set_prover(prover: Callable[[Callable], int | None]) -> None:
    """Install the proof ``rotary`` checks an ``original`` function with (once per function)."""
    _PROVER[:] = [prover]
    _PROVED.clear()


def _proved(function: Callable, unsqueeze_dim: int) -> bool:
    try:
        dim = _PROVED.get(function)
    except TypeError:  # not weakly referenceable: never proved
        return False
    if dim is None:
        dim = (_PROVER[0](function) if _PROVER else None) or 0
        _PROVED[function] = dim
    return dim == unsqueeze_dim
