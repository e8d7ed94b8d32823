"""linear_with_adapters: a merged projection plus low-rank adapters on some of its parts, in one op.

``out = x @ Wᵀ + b``, then for each adapter on the part whose columns start at ``start``:
``out[..., start : start + size] += scale * (u @ Aᵀ) @ Bᵀ (+ scale * B's bias)`` with ``u`` the
input in the adapter's dtype (LoRA keeps its adapters in float32 beside a bf16 model), the sum
done in the wider dtype and rounded once into the output's columns, as PEFT adds an adapter's
output to its layer's.

The merged matmul runs once whichever parts carry adapters, and the adapters without an input
of their own (no dropout) share one cast of ``x`` and one matmul for all their ``A``s, forward
and backward. Autograd through the same arithmetic would keep a float32 copy of the input per
adapter, splice each part's columns into a new output (a copy of the whole row per part, and a
zero-filled gradient per slice in backward) and compute the frozen base weight's gradient anyway
when only the adapters train; here the cast is recomputed in backward, the adapters' results are
added into their columns in place, and a gradient is computed only for what needs one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Adapter", "linear_with_adapters"]


@dataclass(frozen=True)
class Adapter:
    """One low-rank adapter on one part of a merged projection (columns ``start : start + size``).

    ``a`` is ``[rank, in]``, ``b`` is ``[size, rank]`` with an optional bias ``[size]``. ``inputs``
    is what ``a`` multiplies when it is not just ``x`` cast to ``a``'s dtype (an adapter's dropout in
    training): computed by the caller, differentiated by autograd outside this op.
    """

    start: int
    a: Tensor
    b: Tensor
    scale: float
    b_bias: Tensor | None = None
    inputs: Tensor | None = None

    @property
    def size(self) -> int:
        return self.b.shape[0]


def linear_with_adapters(x: Tensor, weight: Tensor, bias: Tensor | None, adapters: list[Adapter]) -> Tensor:
    """``F.linear(x, weight, bias)`` with each adapter's output added to its part's columns."""
    if not adapters:
        return F.linear(x, weight, bias)
    for adapter in adapters:
        if not 0 <= adapter.start <= adapter.start + adapter.size <= weight.shape[0]:
            raise ValueError(
                f"An adapter on columns {adapter.start}:{adapter.start + adapter.size} does not fit a projection "
                f"with {weight.shape[0]} outputs."
            )
        if adapter.a.shape[1] != weight.shape[1] or adapter.b.shape[1] != adapter.a.shape[0]:
            raise ValueError(
                f"An adapter's A {tuple(adapter.a.shape)} and B {tuple(adapter.b.shape)} do not compose on inputs of "
                f"width {weight.shape[1]}."
            )
    if torch.is_autocast_enabled(x.device.type):
        # Autocast picks each matmul's dtype, as it would for the unfused layers: plain autograd.
        return _composed(x, weight, bias, adapters)
    layout = tuple((a.start, a.size, float(a.scale), a.b_bias is not None, a.inputs is not None) for a in adapters)
    tensors = []
    for adapter in adapters:
        tensors += [adapter.a, adapter.b]
        tensors += [adapter.b_bias] if adapter.b_bias is not None else []
        tensors += [adapter.inputs] if adapter.inputs is not None else []
    return _LinearWithAdapters.apply(x, weight, bias, layout, *tensors)


def _composed(x: Tensor, weight: Tensor, bias: Tensor | None, adapters: list[Adapter]) -> Tensor:
    """The same arithmetic as plain autograd ops (under autocast; and the reference the tests use)."""
    out = F.linear(x, weight, bias)
    deltas: dict[int, Tensor] = {}
    for adapter in adapters:
        inputs = adapter.inputs if adapter.inputs is not None else x.to(adapter.a.dtype)
        delta = F.linear(F.linear(inputs, adapter.a), adapter.b, adapter.b_bias) * adapter.scale
        deltas[adapter.start] = delta if adapter.start not in deltas else deltas[adapter.start] + delta
    pieces, at = [], 0
    for start in sorted(deltas):
        delta = deltas[start]
        pieces += [out[..., at:start], (out[..., start : start + delta.shape[-1]] + delta).to(out.dtype)]
        at = start + delta.shape[-1]
    return torch.cat([*pieces, out[..., at:]], dim=-1)


def _unpack(layout, tensors):
    """Per adapter: (start, size, scale, a, b, b_bias, inputs) from the flat tensor list."""
    out, i = [], 0
    for start, size, scale, has_bias, has_inputs in layout:
        a, b = tensors[i], tensors[i + 1]
        i += 2
        b_bias = tensors[i] if has_bias else None
        i += has_bias
        inputs = tensors[i] if has_inputs else None
        i += has_inputs
        out.append((start, size, scale, a, b, b_bias, inputs))
    return out


def _shared_groups(adapters) -> dict[torch.dtype, list[int]]:
    """Indices of the adapters whose input is ``x`` cast to their ``a``'s dtype, by that dtype."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, (_, _, _, a, _, _, inputs) in enumerate(adapters):
        if inputs is None:
            groups.setdefault(a.dtype, []).append(i)
    return groups


class _LinearWithAdapters(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layout, *tensors):
        adapters = _unpack(layout, tensors)
        x2 = x.reshape(-1, x.shape[-1])
        out = F.linear(x2, weight, bias)
        # Each adapter's scaled low-rank activations [tokens, rank]: small, kept for backward.
        hidden: list = [None] * len(adapters)
        for dtype, members in _shared_groups(adapters).items():
            shared = F.linear(x2.to(dtype), torch.cat([adapters[i][3] for i in members]))
            for i, h in zip(members, shared.split([adapters[i][3].shape[0] for i in members], dim=1)):
                hidden[i] = h * adapters[i][2]
        for i, (_, _, scale, a, _, _, inputs) in enumerate(adapters):
            if inputs is not None:
                hidden[i] = F.linear(inputs.reshape(-1, inputs.shape[-1]), a) * scale
        deltas: dict[int, Tensor] = {}  # per part: its adapters' sum, in their dtype
        for (start, _, scale, _, b, b_bias, _), h in zip(adapters, hidden):
            delta = F.linear(h, b)
            if b_bias is not None:
                delta.add_(b_bias, alpha=scale)
            deltas[start] = delta if start not in deltas else deltas[start] + delta
        for start, delta in deltas.items():
            out[:, start : start + delta.shape[1]].add_(delta)  # in the wider dtype, rounded once
        ctx.layout = layout
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.save_for_backward(x, weight, *tensors, *hidden)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight, *rest = ctx.saved_tensors
        count = len(rest) - len(ctx.layout)
        tensors, hidden = rest[:count], rest[count:]
        adapters = _unpack(ctx.layout, tensors)
        needs = ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grads: list = [None] * count
        extra = None  # the adapters' part of the input's gradient, in their dtype
        part_grads: dict[tuple[int, torch.dtype], Tensor] = {}  # each part's columns of grad, cast once

        def part_grad(start, size, dtype):
            key = (start, dtype)
            if key not in part_grads:
                part_grads[key] = g2[:, start : start + size].to(dtype)
            return part_grads[key]

        # grad of h (unscaled) per adapter, and the gradients of b and its bias.
        grad_hidden: list = [None] * len(adapters)
        index = 0
        positions = []
        for i, (start, size, scale, a, b, b_bias, inputs) in enumerate(adapters):
            positions.append(index)
            gp = part_grad(start, size, b.dtype)
            if needs[4 + index + 1]:
                grads[index + 1] = gp.t() @ hidden[i]
            if b_bias is not None and needs[4 + index + 2]:
                grads[index + 2] = gp.sum(0) * scale
            grad_hidden[i] = (gp @ b) * scale
            index += 2 + (b_bias is not None) + (inputs is not None)
        for dtype, members in _shared_groups(adapters).items():
            gh = torch.cat([grad_hidden[i] for i in members], dim=1)
            a_cat = torch.cat([adapters[i][3] for i in members])
            if any(needs[4 + positions[i]] for i in members):
                ga = gh.t() @ x2.to(dtype)
                for i, g in zip(members, ga.split([adapters[i][3].shape[0] for i in members])):
                    grads[positions[i]] = g
            if needs[0]:
                gx = gh @ a_cat
                extra = gx if extra is None else extra + gx.to(extra.dtype)
        for i, (_, _, _, a, _, b_bias, inputs) in enumerate(adapters):
            if inputs is None:
                continue
            u2 = inputs.reshape(-1, inputs.shape[-1])
            if needs[4 + positions[i]]:
                grads[positions[i]] = grad_hidden[i].t() @ u2
            slot = positions[i] + 2 + (b_bias is not None)
            if needs[4 + slot]:
                grads[slot] = (grad_hidden[i] @ a).reshape(inputs.shape)
        grad_x = grad_weight = grad_bias = None
        if needs[0]:
            if extra is not None:
                grad_x = torch.addmm(extra.to(x.dtype), g2, weight)
            else:
                grad_x = g2 @ weight
            grad_x = grad_x.reshape(ctx.x_shape)
        if needs[1]:
            grad_weight = g2.t() @ x2
        if ctx.has_bias and needs[2]:
            grad_bias = g2.sum(0)
        return (grad_x, grad_weight, grad_bias, None, *grads)
