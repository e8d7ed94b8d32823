"""rotary: the rotary position embedding of the query and key (``rotary``) or of one tensor
(``rotary_one``), in the layouts modeling files write it.

Each tensor ``x`` becomes ``x * cos + rotate(x) * sin``, with ``cos`` and ``sin`` (``[batch or 1,
seq, width]``) unsqueezed at ``unsqueeze_dim`` to broadcast over the heads. The layout parameters
(``RotaryLayout``) say how the model writes it:

* ``interleaved``: ``rotate`` turns pairs of neighbouring channels, ``stack((-x[..., 1::2],
  x[..., ::2]), -1).flatten(-2)``; else the two halves, ``cat((-x2, x1), -1)`` (Llama's
  ``rotate_half``).
* ``first_half``: only the first half of each table is read (``t[..., : t.shape[-1] // 2]``);
  ``expand``: the tables hold one value a pair, widened to one a channel by
  ``repeat_interleave(2, -1)`` or by ``"repeat"`` (``cat((t, t), -1)``); ``"none"``: read as they are.
* ``partial``: the rotary width is the widened table's; the channels past it pass through
  unchanged (``cat((x_embed, x_pass), -1)``). Without it the table is as wide as the head.
* ``upcast``: computed from float32 copies of the tensors (``q.float()``), the results cast back to
  their dtype; ``cast``: computed in the dtype the inputs promote to, the results cast back.

The native definitions are the modeling files' functions op for op, so they round where those
round: each product and the sum, in the dtype the function computes in. ``CallForm`` says how a
model's own function is called, for the check of ``original`` (see ``rotary``).
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any, Hashable, NamedTuple

import torch
from torch import Tensor

from .conformance import Sampler, ShapeClass, _random_like, _tensor_key
from .dispatch import Op, under_compile_use_library_op

__all__ = [
    "CallForm",
    "EXPANDS",
    "ROTARY",
    "ROTARY_ONE",
    "RotaryLayout",
    "rotary",
    "rotary_backward_native",
    "rotary_native",
    "rotary_one",
    "rotary_one_backward_native",
    "rotary_one_native",
    "rotary_width",
    "table_width",
]

# How a table of one value a pair is widened to one a channel.
EXPANDS = ("none", "repeat_interleave", "repeat")


class RotaryLayout(NamedTuple):
    """The op's layout parameters, in the order the ops take them after ``cos`` and ``sin``."""

    unsqueeze_dim: int = 1
    interleaved: bool = False
    expand: str = "none"
    first_half: bool = False
    partial: bool = False
    upcast: bool = False
    cast: bool = False

    def keywords(self) -> dict:
        """The parameters a call must name: the dimension, and those not at their defaults."""
        named = {"unsqueeze_dim": self.unsqueeze_dim}
        named.update({k: v for k, v in self._asdict().items() if k != "unsqueeze_dim" and v != self._field_defaults[k]})
        return named


class CallForm(NamedTuple):
    """How a call of a model's function passes its arguments: ``(q, k, cos, sin)`` with or without a
    fifth argument (``position_ids``: ignored, or the index cos and sin are read at), or one tensor
    with cos and sin, or with sin and cos (``(tensor, sin, cos)``, GPT-J's order)."""

    tensors: int = 2
    fifth: bool = False
    indexed: bool = False
    sin_first: bool = False


FOUR = CallForm()
INDEXED = CallForm(fifth=True, indexed=True)
IGNORED_FIFTH = CallForm(fifth=True)
ONE = CallForm(tensors=1)
ONE_SIN_FIRST = CallForm(tensors=1, sin_first=True)


def _rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: Tensor) -> Tensor:
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _table(t: Tensor, unsqueeze_dim: int, expand: str, first_half: bool) -> Tensor:
    """A cos or sin table as the product reads it: unsqueezed, cut to its first half, widened."""
    t = t.unsqueeze(unsqueeze_dim)
    if first_half:
        t = t[..., : t.shape[-1] // 2]
    if expand == "repeat_interleave":
        t = t.repeat_interleave(2, dim=-1)
    elif expand == "repeat":
        t = torch.cat((t, t), dim=-1)
    elif expand != "none":
        raise ValueError(f"rotary: expand must be one of {EXPANDS}, not {expand!r}.")
    return t


def rotary_width(table_width: int, expand: str = "none", first_half: bool = False) -> int:
    """The channels a table of ``table_width`` rotates, once cut and widened."""
    width = table_width // 2 if first_half else table_width
    return width if expand == "none" else 2 * width


def table_width(width: int, expand: str = "none", first_half: bool = False) -> int:
    """The width of the tables that rotate ``width`` channels, cut and widened as given."""
    stored = width if expand == "none" else width // 2
    return 2 * stored if first_half else stored


def _embed(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, partial: bool, upcast: bool, cast: bool) -> Tensor:
    dtype = x.dtype
    if upcast:
        x = x.float()
    if partial:
        x, x_pass = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
    rotate = _rotate_pairs if interleaved else _rotate_half
    out = (x * cos) + (rotate(x) * sin)
    if partial:
        out = torch.cat((out, x_pass), dim=-1)
    return out.to(dtype) if upcast or cast else out


def rotary_native(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False,
    expand: str = "none", first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(q * cos + rotate(q) * sin, k * cos + rotate(k) * sin)`` in the layout the parameters give
    (the module docstring): with the defaults, Hugging Face's ``apply_rotary_pos_emb``, the same ops
    in the same order."""
    cos = _table(cos, unsqueeze_dim, expand, first_half)
    sin = _table(sin, unsqueeze_dim, expand, first_half)
    q_embed = _embed(q, cos, sin, interleaved, partial, upcast, cast)
    k_embed = _embed(k, cos, sin, interleaved, partial, upcast, cast)
    return q_embed, k_embed


def rotary_one_native(
    x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False, expand: str = "none",
    first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> Tensor:  # fmt: skip
    """``x * cos + rotate(x) * sin`` of one tensor, in the layout the parameters give (GPT-J's
    ``apply_rotary_pos_emb(tensor, sin, cos)``: interleaved, ``expand="repeat_interleave"``)."""
    cos = _table(cos, unsqueeze_dim, expand, first_half)
    sin = _table(sin, unsqueeze_dim, expand, first_half)
    return _embed(x, cos, sin, interleaved, partial, upcast, cast)


def _embed_grad(g: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, partial: bool, upcast: bool) -> Tensor:
    """``g * cos + rotate^T(g * sin)``: the adjoint of either rotation is its negation."""
    dtype = g.dtype
    if upcast:
        g = g.float()
    if partial:
        g, g_pass = g[..., : cos.shape[-1]], g[..., cos.shape[-1] :]
    rotate = _rotate_pairs if interleaved else _rotate_half
    out = g * cos - rotate(g * sin)
    if partial:
        out = torch.cat((out, g_pass), dim=-1)
    return out.to(dtype) if upcast else out


def rotary_backward_native(
    grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False,
    expand: str = "none", first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The gradients of ``q`` and ``k`` for the outputs' gradients: ``g * cos + rotate^T(g * sin)``,
    where the adjoint of ``rotate`` (``[-x2 | x1]``, or each pair ``(-b, a)``) is its negation; the
    channels passed through get their gradient as it is."""
    cos = _table(cos, unsqueeze_dim, expand, first_half)
    sin = _table(sin, unsqueeze_dim, expand, first_half)
    return tuple(_embed_grad(g, cos, sin, interleaved, partial, upcast) for g in (grad_q, grad_k))


def rotary_one_backward_native(
    grad: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, interleaved: bool = False, expand: str = "none",
    first_half: bool = False, partial: bool = False, upcast: bool = False, cast: bool = False,
) -> Tensor:  # fmt: skip
    """The gradient of ``rotary_one``'s ``x`` for its output's gradient (see ``rotary_backward_native``)."""
    cos = _table(cos, unsqueeze_dim, expand, first_half)
    sin = _table(sin, unsqueeze_dim, expand, first_half)
    return _embed_grad(grad, cos, sin, interleaved, partial, upcast)


class _RotarySampler(Sampler):
    """The rotated tensors (q and k, or one) ``[batch, heads, seq, dim]`` (heads and seq swapped with
    ``unsqueeze_dim=2``) and cos and sin ``[batch or 1, seq, width]``, the call's own width (its
    layout is part of the configuration): classes of batch and sequence length, a batch whose
    sequences have positions of their own (cos and sin per sequence, as left padding gives), and
    tensors cut from one merged projection's output (strided heads). A provider's backward kernel
    is judged on its gradients."""

    def __init__(self, tensors: tuple[str, ...]):
        self.tensors = tensors
        self.grads = tensors

    def bind(self, native: Callable) -> None:
        super().bind(native)
        self.defaults = RotaryLayout()

    def layout(self, args: tuple, kwargs: dict) -> RotaryLayout:
        start = len(self.tensors) + 2
        given = dict(zip(self.names[start:], args[start:]), **kwargs)
        return self.defaults._replace(**{k: v for k, v in given.items() if k in RotaryLayout._fields})

    def _heads(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        axis = 1 if self.layout(args, kwargs).unsqueeze_dim in (1, -3) else 2
        return tuple(x.shape[axis] for x in args[: len(self.tensors)])

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        n = len(self.tensors)
        x, cos, sin = args[0], args[n], args[n + 1]
        return (_tensor_key(x, True), *(t.dtype for t in args[1 : n + 2]), cos.shape[-1], self._heads(args, kwargs),
                self.layout(args, kwargs), cos.shape[0] == 1)  # fmt: skip

    def describe(self, args: tuple, kwargs: dict) -> str:
        x, layout = args[0], self.layout(args, kwargs)
        named = ", ".join(f"{k}={v}" for k, v in layout.keywords().items() if k != "unsqueeze_dim")
        return f"{str(x.dtype).replace('torch.', '')} on {x.device.type}, heads of {x.shape[-1]}" + (
            f", {named}" if named else ""
        )

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
        n = len(self.tensors)
        cos, sin = args[n], args[n + 1]
        dim = self.layout(args, kwargs).unsqueeze_dim
        batch, seq, head_dim = shape_class.size("batch", 1), shape_class.size("seq", 1), args[0].shape[-1]
        heads = self._heads(args, kwargs)
        merged = None
        if shape_class.layout == "strided":  # [batch, seq, all heads + as many more, dim], cut into the tensors
            merged = _random_like((batch, seq, 2 * sum(heads), head_dim), args[0].dtype, args[0].device, generator)
        firsts = [sum(heads[:i]) for i in range(n)]

        def part(x: Tensor, first: int, count: int) -> Tensor:
            if merged is not None:
                cut = merged[:, :, first : first + count]
                return cut if dim in (2, -2) else cut.transpose(1, 2)
            shape = (batch, count, seq, head_dim) if dim in (1, -3) else (batch, seq, count, head_dim)
            return _random_like(shape, x.dtype, x.device, generator)

        rows = batch if shape_class.data == "per sequence" or cos.shape[0] != 1 else 1
        angle = _random_like((rows, seq, cos.shape[-1]), torch.float32, cos.device, generator, 3.0)
        tensors = [part(x, first, count) for x, first, count in zip(args[:n], firsts, heads)]
        return (*tensors, angle.cos().to(cos.dtype), angle.sin().to(sin.dtype), *args[n + 2 :]), dict(kwargs)

    def backward_forms(self, provider) -> list:
        if provider.backward is None:
            return []
        n = len(self.tensors)

        def run(grads: list, args: tuple, kwargs: dict) -> list:
            out = provider.backward(*grads[:n], args[n], args[n + 1], *self.layout(args, kwargs))
            return list(out) if n > 1 else [out]

        return [("its backward kernel", run)]


# The library ops' backwards, for ``torch.compile`` of training code (``under_compile_use_library_op``
# with ``backward``): the providers' backward kernel, where Inductor's code for the gradient of a
# merged projection's q and k (rotated back, transposed and concatenated with v's in one kernel)
# measured four times slower on the GPU.
@torch.library.custom_op("transfuse::rotary_backward", mutates_args=())
def _rotary_backward_library_op(
    grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int, interleaved: bool, expand: str,
    first_half: bool, partial: bool, upcast: bool, cast: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    layout = (unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    provider = ROTARY.select_with_backward(grad_q, grad_k, cos, sin, *layout)
    if provider.backward is not None:
        return provider.backward(grad_q, grad_k, cos, sin, *layout)
    return rotary_backward_native(grad_q, grad_k, cos, sin, *layout)


@_rotary_backward_library_op.register_fake
def _(grad_q, grad_k, cos, sin, *layout):
    return rotary_backward_native(grad_q, grad_k, cos, sin, *layout)


@torch.library.custom_op("transfuse::rotary_one_backward", mutates_args=())
def _rotary_one_backward_library_op(
    grad: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int, interleaved: bool, expand: str, first_half: bool,
    partial: bool, upcast: bool, cast: bool,
) -> Tensor:  # fmt: skip
    layout = (unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    provider = ROTARY_ONE.select_with_backward(grad, cos, sin, *layout)
    if provider.backward is not None:
        return provider.backward(grad, cos, sin, *layout)
    return rotary_one_backward_native(grad, cos, sin, *layout)


@_rotary_one_backward_library_op.register_fake
def _(grad, cos, sin, *layout):
    return rotary_one_backward_native(grad, cos, sin, *layout)


def _keeper(tensors: int) -> Callable:
    def keep_cos_sin(ctx, inputs, output):
        ctx.save_for_backward(inputs[tensors], inputs[tensors + 1])
        ctx.layout = tuple(inputs[tensors + 2 :])

    return keep_cos_sin


def _rotary_grad(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.transfuse.rotary_backward(grad_q, grad_k, cos, sin, *ctx.layout)
    return (grad_q, grad_k, None, None, *(None,) * len(ctx.layout))


def _rotary_one_grad(ctx, grad):
    cos, sin = ctx.saved_tensors
    return (torch.ops.transfuse.rotary_one_backward(grad, cos, sin, *ctx.layout), None, None, *(None,) * len(ctx.layout))


ROTARY = Op("rotary", rotary_native, sampler=_RotarySampler(("q", "k")), library=True, autograd=(_rotary_grad, _keeper(2)))
ROTARY_ONE = Op(
    "rotary_one", rotary_one_native, sampler=_RotarySampler(("x",)), library=True, autograd=(_rotary_one_grad, _keeper(1))
)


def rotary(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    unsqueeze_dim: int = 1,
    original: Callable | None = None,
    position_ids: Tensor | None = None,
    indexed: bool = False,
    *,
    interleaved: bool = False,
    expand: str = "none",
    first_half: bool = False,
    partial: bool = False,
    upcast: bool = False,
    cast: bool = False,
    original_keywords: tuple[tuple[str, Any], ...] = (),
) -> tuple[Tensor, Tensor]:
    """The rotary embedding of ``q`` and ``k`` (``[batch, heads, seq, head_dim]`` with
    ``unsqueeze_dim=1``, ``[batch, seq, heads, head_dim]`` with 2; the two may differ in heads),
    for ``cos``/``sin`` of ``[batch or 1, seq, width]``: ``(q_embed, k_embed)``, in the layout the
    keyword parameters give (the module docstring).

    ``original`` is the model's own function this call stands for (a rewritten forward passes
    it by its global name, so it is whatever the name holds at the time of the call): while it
    is a function proved to compute this op in this layout (``transfuse/fusers/rotary.py``), the op
    runs; a function patched in later (another library's kernel, a user's change) is called
    instead, with the call's own arguments, and so is the function for arguments outside what the
    proof covered (``_outside``). Under ``torch.compile`` the function itself
    is traced, except where autograd needs a backward and backward kernels run
    (``under_compile_use_library_op``): then the library op runs.

    ``position_ids`` is the fifth argument of a call that passes one. With ``indexed`` the
    function reads ``cos`` and ``sin`` (tables of ``[positions, width]``, squeezed of leading
    ones) at those positions, as older modeling files do (``cos[position_ids]``); without it the
    function was proved not to read the argument at all.

    ``original_keywords``: the constants the call passed by keyword (``(("unsqueeze_dim", 2),)``),
    with which the function was proved (``with_keywords``) and with which it is called."""
    layout = (unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    form = (INDEXED if indexed else IGNORED_FIFTH) if position_ids is not None else FOUR
    if original is not None and not torch.compiler.is_compiling():
        bad_tables = indexed and not (_is_table(cos) and _is_table(sin))
        if bad_tables or _outside(q, k, cos, layout) or not _proved(original, form, layout, original_keywords):
            return original(*_call_arguments(q, k, cos, sin, position_ids), **dict(original_keywords))
    tables = (cos, sin)
    if indexed:
        cos, sin = _at_positions(cos, position_ids), _at_positions(sin, position_ids)
    if not torch.compiler.is_compiling():
        return ROTARY(q, k, cos, sin, *layout)
    if under_compile_use_library_op("rotary", (q, k, cos, sin), backward=True) and (
        original is None
        or (_proved_constant(original, form, layout, original_keywords) and not _outside(q, k, cos, layout))
    ):
        return ROTARY.library(q, k, cos, sin, *layout)
    if original is not None:
        return original(*_call_arguments(q, k, *tables, position_ids), **dict(original_keywords))
    return rotary_native(q, k, cos, sin, *layout)


def rotary_one(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    unsqueeze_dim: int = 1,
    original: Callable | None = None,
    sin_first: bool = False,
    *,
    interleaved: bool = False,
    expand: str = "none",
    first_half: bool = False,
    partial: bool = False,
    upcast: bool = False,
    cast: bool = False,
    original_keywords: tuple[tuple[str, Any], ...] = (),
) -> Tensor:
    """The rotary embedding of one tensor ``x`` (laid out as ``rotary``'s q), in the layout the
    keyword parameters give. ``original`` and ``original_keywords`` as for ``rotary``: the model's
    function, called with the call's own arguments where it is not proved to compute this,
    ``(x, sin, cos)`` with ``sin_first`` (GPT-J's order), else ``(x, cos, sin)``."""
    layout = (unsqueeze_dim, interleaved, expand, first_half, partial, upcast, cast)
    form = ONE_SIN_FIRST if sin_first else ONE
    if original is not None and not torch.compiler.is_compiling():
        if _outside(x, None, cos, layout) or not _proved(original, form, layout, original_keywords):
            return _call_one(original, x, cos, sin, sin_first, original_keywords)
    if not torch.compiler.is_compiling():
        return ROTARY_ONE(x, cos, sin, *layout)
    if under_compile_use_library_op("rotary_one", (x, cos, sin), backward=True) and (
        original is None
        or (_proved_constant(original, form, layout, original_keywords) and not _outside(x, None, cos, layout))
    ):
        return ROTARY_ONE.library(x, cos, sin, *layout)
    if original is not None:
        return _call_one(original, x, cos, sin, sin_first, original_keywords)
    return rotary_one_native(x, cos, sin, *layout)


def _call_one(original: Callable, x: Tensor, cos: Tensor, sin: Tensor, sin_first: bool, keywords: tuple) -> Tensor:
    """The model's own one-tensor call, in its order of the tables."""
    return original(x, sin, cos, **dict(keywords)) if sin_first else original(x, cos, sin, **dict(keywords))


def _outside(x: Tensor, k: Tensor | None, cos: Tensor, layout: tuple) -> bool:
    """Arguments outside what the proof of a function covered, for which the function itself runs:
    with a cast, q and k of two dtypes; without partial rotary, tables that do not rotate the whole
    head (a function that measures cos may pass the rest through, which the proof at the head's
    width cannot tell)."""
    _, _, expand, first_half, partial, upcast, cast = layout
    if (upcast or cast) and k is not None and k.dtype != x.dtype:
        return True
    return not partial and rotary_width(cos.shape[-1], expand, first_half) != x.shape[-1]


def _is_table(table: Tensor) -> bool:
    """``[positions, width]``, or that held as ``[1, 1, positions, width]``: the shapes the
    proof of an indexed function tries (a function that cannot take one is not proved)."""
    return table.dim() == 2 or (table.dim() == 4 and table.shape[0] == table.shape[1] == 1)


def _at_positions(table: Tensor, position_ids: Tensor) -> Tensor:
    """``table[position_ids]`` of a ``[positions, width]`` table, squeezed of its leading ones
    (as the older functions squeeze it)."""
    return table.reshape(table.shape[-2:])[position_ids]


def _call_arguments(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> tuple:
    """The arguments of the model's own call: a fifth where the call passed one."""
    return (q, k, cos, sin) if position_ids is None else (q, k, cos, sin, position_ids)


# Functions checked by the prover (the rotary fuser's proof, installed by it: ops do not import
# fusers): per function and call form, the layout in which it computes the op, or None.
_PROVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROVER: list[Callable[[Callable, CallForm], RotaryLayout | None]] = []


def set_prover(prover: Callable[[Callable, CallForm], RotaryLayout | None]) -> None:
    """Install the proof ``rotary`` and ``rotary_one`` check an ``original`` function with (once per
    function and call form): the layout the function computes, or None."""
    _PROVER[:] = [prover]
    _PROVED.clear()


@torch.compiler.assume_constant_result
def _proved_constant(function: Callable, form: CallForm, layout: tuple, keywords: tuple = ()) -> bool:
    """``_proved`` run outside a ``torch.compile`` trace (the prover reads source): a constant of the
    graph, which Dynamo guards on the function the global name held."""
    return _proved(function, form, layout, keywords)


def _proved(function: Callable, form: CallForm, layout: tuple, keywords: tuple = ()) -> bool:
    if keywords:
        function = with_keywords(function, keywords)
        if function is None:
            return False
    try:
        forms = _PROVED.setdefault(function, {})
    except TypeError:  # not weakly referenceable: never proved
        return False
    if form not in forms:
        forms[form] = _PROVER[0](function, form) if _PROVER else None
    return forms[form] == layout


# (function, keywords) -> the function with those keywords as its defaults; kept as long as the function.
_VARIANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def with_keywords(function: Callable, keywords: tuple[tuple[str, Any], ...]) -> types.FunctionType | None:
    """``function`` with the constants a call passes by keyword (``((name, value), ...)``) as the
    defaults of those parameters: a function of the call's positional arguments alone, which the
    proof takes as it takes any other (one object per function and keywords, so that its proof is
    made once). None where a keyword names no parameter with a default, or ``function`` is no
    Python function."""
    if not isinstance(function, types.FunctionType):
        return None
    keywords = tuple(keywords)
    known = _VARIANTS.setdefault(function, {})
    if keywords in known:
        return known[keywords]
    given = dict(keywords)
    parameters = inspect.signature(function, follow_wrapped=False).parameters  # (the code's own, as its defaults are)
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    defaults = function.__defaults__ or ()
    with_default = positional[len(positional) - len(defaults) :]
    kw_defaults = dict(function.__kwdefaults__ or {})
    names = {p.name for p in with_default} | set(kw_defaults)
    if not set(given) <= names:
        known[keywords] = None
        return None
    variant = types.FunctionType(
        function.__code__, function.__globals__, function.__name__,
        tuple(given.get(p.name, d) for p, d in zip(with_default, defaults)), function.__closure__,
    )  # fmt: skip
    variant.__kwdefaults__ = {name: given.get(name, value) for name, value in kw_defaults.items()} or None
    variant.__module__, variant.__qualname__ = function.__module__, function.__qualname__
    known[keywords] = variant
    return variant
