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
from typing import Hashable

import torch
from torch import Tensor

from .conformance import Sampler, ShapeClass, _random_like, _tensor_key
from .dispatch import Op, under_compile_use_library_op

__all__ = ["ROTARY", "rotary", "rotary_backward_native", "rotary_native"]


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


class _RotarySampler(Sampler):
    """q and k ``[batch, heads, seq, dim]`` (heads and seq swapped with ``unsqueeze_dim=2``) and cos
    and sin ``[batch or 1, seq, dim]``: classes of batch and sequence length, a batch whose
    sequences have positions of their own (cos and sin per sequence, as left padding gives), and q
    and k cut from one merged projection's output (strided heads). A provider's backward kernel is
    judged on its gradients."""

    grads = ("q", "k")

    @staticmethod
    def _dim(args: tuple, kwargs: dict) -> int:
        return args[4] if len(args) > 4 else kwargs.get("unsqueeze_dim", 1)

    def _heads(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        q, k = args[:2]
        return (q.shape[1], k.shape[1]) if self._dim(args, kwargs) in (1, -3) else (q.shape[2], k.shape[2])

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        q, k, cos, sin = args[:4]
        return (_tensor_key(q, True), k.dtype, cos.dtype, sin.dtype, self._heads(args, kwargs),
                self._dim(args, kwargs), cos.shape[0] == 1)  # fmt: skip

    def describe(self, args: tuple, kwargs: dict) -> str:
        q = args[0]
        return f"{str(q.dtype).replace('torch.', '')} on {q.device.type}, heads of {q.shape[-1]}"

    def classes(self, args: tuple, kwargs: dict, thresholds: dict) -> list[ShapeClass]:
        found = [
            ShapeClass("one position (a decode step)", (("batch", 1), ("seq", 1))),
            ShapeClass("one position of 3 sequences", (("batch", 3), ("seq", 1))),
            ShapeClass("7 positions", (("batch", 1), ("seq", 7))),
            ShapeClass("2 sequences of 5 with their own positions", (("batch", 2), ("seq", 5)), data="per sequence"),
            ShapeClass("5 positions cut from a merged projection", (("batch", 1), ("seq", 5)), layout="strided"),
        ]
        for dim in ("batch", "seq"):
            for size in sorted(thresholds.get(dim, ())):
                for n in (size - 1, size):
                    if n >= 1:
                        other = "seq" if dim == "batch" else "batch"
                        found.append(ShapeClass(f"{dim} {n}", ((dim, n), (other, 1))))
        return found

    def make(self, shape_class: ShapeClass, args: tuple, kwargs: dict, generator) -> tuple[tuple, dict]:
        q, k, cos, sin = args[:4]
        dim = self._dim(args, kwargs)
        batch, seq, head_dim = shape_class.size("batch", 1), shape_class.size("seq", 1), q.shape[-1]
        heads_q, heads_k = self._heads(args, kwargs)
        merged = None
        if shape_class.layout == "strided":  # [batch, seq, q + k + v heads, dim], cut into q and k
            merged = _random_like((batch, seq, heads_q + 2 * heads_k, head_dim), q.dtype, q.device, generator)

        def part(x: Tensor, first: int, heads: int) -> Tensor:
            if merged is not None:
                cut = merged[:, :, first : first + heads]
                return cut if dim in (2, -2) else cut.transpose(1, 2)
            shape = (batch, heads, seq, head_dim) if dim in (1, -3) else (batch, seq, heads, head_dim)
            return _random_like(shape, x.dtype, x.device, generator)

        rows = batch if shape_class.data == "per sequence" or cos.shape[0] != 1 else 1
        half = _random_like((rows, seq, head_dim // 2), torch.float32, cos.device, generator, 3.0)
        angle = torch.cat([half, half], dim=-1)
        new = (part(q, 0, heads_q), part(k, heads_q, heads_k), angle.cos().to(cos.dtype), angle.sin().to(sin.dtype))
        return (*new, *args[4:]), dict(kwargs)

    def backward_forms(self, provider) -> list:
        if provider.backward is None:
            return []

        def run(grads: list, args: tuple, kwargs: dict) -> list:
            return list(provider.backward(grads[0], grads[1], args[2], args[3], self._dim(args, kwargs)))

        return [("its backward kernel", run)]


def rotary_backward_native(
    grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """The gradients of ``q`` and ``k`` for the outputs' gradients: ``g * cos + rotate_half^T(g * sin)``,
    where the adjoint of ``rotate_half`` (``[-x2 | x1]``) is ``[x2 | -x1]``, its negation."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return tuple(g * cos - _rotate_half(g * sin) for g in (grad_q, grad_k))


# The library op's backward, for ``torch.compile`` of training code (``under_compile_use_library_op``
# with ``backward``): the providers' backward kernel, where Inductor's code for the gradient of a
# merged projection's q and k (rotated back, transposed and concatenated with v's in one kernel)
# measured four times slower on the GPU.
@torch.library.custom_op("transfuse::rotary_backward", mutates_args=())
def _rotary_backward_library_op(
    grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int
) -> tuple[Tensor, Tensor]:
    provider = ROTARY.select_with_backward(grad_q, grad_k, cos, sin, unsqueeze_dim)
    if provider.backward is not None:
        return provider.backward(grad_q, grad_k, cos, sin, unsqueeze_dim)
    return rotary_backward_native(grad_q, grad_k, cos, sin, unsqueeze_dim)


@_rotary_backward_library_op.register_fake
def _(grad_q, grad_k, cos, sin, unsqueeze_dim):
    return rotary_backward_native(grad_q, grad_k, cos, sin, unsqueeze_dim)


def _keep_cos_sin(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim = unsqueeze_dim


def _rotary_grad(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.transfuse.rotary_backward(grad_q, grad_k, cos, sin, ctx.unsqueeze_dim)
    return grad_q, grad_k, None, None, None


ROTARY = Op("rotary", rotary_native, sampler=_RotarySampler(), library=True, autograd=(_rotary_grad, _keep_cos_sin))


def rotary(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    unsqueeze_dim: int = 1,
    original: Callable | None = None,
    position_ids: Tensor | None = None,
    indexed: bool = False,
) -> tuple[Tensor, Tensor]:
    """The rotary embedding of ``q`` and ``k`` (``[batch, heads, seq, head_dim]`` with
    ``unsqueeze_dim=1``, ``[batch, seq, heads, head_dim]`` with 2; the two may differ in heads),
    for ``cos``/``sin`` of ``[batch or 1, seq, head_dim]``: ``(q_embed, k_embed)``.

    ``original`` is the model's own function this call stands for (a rewritten forward passes
    it by its global name, so it is whatever the name holds at the time of the call): while it
    is a function proved to compute this op (``transfuse/fusers/rotary.py``), the op runs; a
    function patched in later (another library's kernel, a user's change) is called instead, with
    the call's own arguments. Under ``torch.compile`` the function itself is traced, except where
    autograd needs a backward and backward kernels run (``under_compile_use_library_op``): then
    the library op runs.

    ``position_ids`` is the fifth argument of a call that passes one. With ``indexed`` the
    function reads ``cos`` and ``sin`` (tables of ``[positions, head_dim]``, squeezed of leading
    ones) at those positions, as older modeling files do (``cos[position_ids]``); without it the
    function was proved not to read the argument at all."""
    form = (position_ids is not None, indexed)
    unproved = original is not None and not torch.compiler.is_compiling() and not _proved(original, unsqueeze_dim, form)
    if unproved or (original is not None and indexed and not (_is_table(cos) and _is_table(sin))):
        return original(*_call_arguments(q, k, cos, sin, position_ids))
    tables = (cos, sin)
    if indexed:
        cos, sin = _at_positions(cos, position_ids), _at_positions(sin, position_ids)
    if not torch.compiler.is_compiling():
        return ROTARY(q, k, cos, sin, unsqueeze_dim)
    if under_compile_use_library_op("rotary", (q, k, cos, sin), backward=True) and (
        original is None or _proved_constant(original, unsqueeze_dim, form)
    ):
        return ROTARY.library(q, k, cos, sin, unsqueeze_dim)
    return original(*_call_arguments(q, k, *tables, position_ids)) if original is not None else rotary_native(
        q, k, cos, sin, unsqueeze_dim
    )


def _is_table(table: Tensor) -> bool:
    """``[positions, head_dim]``, or that held as ``[1, 1, positions, head_dim]``: the shapes the
    proof of an indexed function tries (a function that cannot take one is not proved)."""
    return table.dim() == 2 or (table.dim() == 4 and table.shape[0] == table.shape[1] == 1)


def _at_positions(table: Tensor, position_ids: Tensor) -> Tensor:
    """``table[position_ids]`` of a ``[positions, head_dim]`` table, squeezed of its leading ones
    (as the older functions squeeze it)."""
    return table.reshape(table.shape[-2:])[position_ids]


def _call_arguments(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> tuple:
    """The arguments of the model's own call: a fifth where the call passed one."""
    return (q, k, cos, sin) if position_ids is None else (q, k, cos, sin, position_ids)


# Functions checked by the prover (the rotary fuser's proof, installed by it: ops do not import
# fusers): per function and call form (whether a fifth argument is passed, whether cos and sin are
# read at it), the unsqueeze dimension at which it computes this op, or 0 where it does not.
_PROVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROVER: list[Callable[[Callable, tuple[bool, bool]], int | None]] = []


def set_prover(prover: Callable[[Callable, tuple[bool, bool]], int | None]) -> None:
    """Install the proof ``rotary`` checks an ``original`` function with (once per function and call
    form ``(fifth argument passed, cos and sin read at it)``)."""
    _PROVER[:] = [prover]
    _PROVED.clear()


@torch.compiler.assume_constant_result
def _proved_constant(function: Callable, unsqueeze_dim: int, form: tuple[bool, bool] = (False, False)) -> bool:
    """``_proved`` run outside a ``torch.compile`` trace (the prover reads source): a constant of the
    graph, which Dynamo guards on the function the global name held."""
    return _proved(function, unsqueeze_dim, form)


def _proved(function: Callable, unsqueeze_dim: int, form: tuple[bool, bool] = (False, False)) -> bool:
    try:
        forms = _PROVED.setdefault(function, {})
    except TypeError:  # not weakly referenceable: never proved
        return False
    if form not in forms:
        forms[form] = (_PROVER[0](function, form) if _PROVER else None) or 0
    return forms[form] == unsqueeze_dim
