"""moe_experts for training: the native definition's grouped matmuls as one autograd node.

The native definition (``moe.moe_experts_native``) differentiates with autograd, which records
each of its twenty-odd torch ops and keeps what each one's backward reads: the gathered rows, the
gate/up projection, the activation's product and the expert outputs. In a training step that
costs host time (in a Qwen3-MoE step on an H200 the experts were about 1 ms of host time a
layer, a third of the forward's, which the GPU waited for) and memory (the rows and the product,
``T·k·(H + I)`` elements a layer, until the backward).

``_GroupedExperts`` runs the same ops in the same order under one ``torch.autograd.Function``, so
its output is the native definition's, bit for bit, and writes their backward by hand: the
transposed grouped matmuls autograd would run, the activation's gradient from the kernel that
also gives its product again (``act_and_mul``'s ``backward_and_output``, in place over the
projection it reads), the rows gathered again where the gate/up weights' gradient needs them.
It keeps the input, the routing, the gate/up projection and the permuted expert outputs.

It is the ``torch`` provider of ``moe_experts``, for calls that need a backward and that it can
compute: no biases, an activation ``act_and_mul`` fuses with gate and up as halves (gate first),
and shapes ``torch._grouped_mm`` takes. Every other call runs the native definition.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .act_and_mul import _backward_and_output, _op_and_args
from .dispatch import Provider
from .moe import _FUSED_ACTIVATIONS, MOE_EXPERTS, _group_ends, _grouped_mm_takes, moe_experts_native

__all__ = ["grouped_experts_apply"]


def _applies(x, weights, ids, w13, w2, b13, b2, activation, interleaved, gate_first, w13_t, w2_t, alpha, limit):
    """A call that needs a backward, of the form this node computes."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (x, weights, w13, w2)):
        return False  # inference: the native definition or a faster provider
    if b13 is not None or b2 is not None or activation not in _FUSED_ACTIVATIONS or interleaved or not gate_first:
        return False
    if x.dim() != 2 or ids.dim() != 2 or x.shape[0] == 0 or not (x.dtype == w13.dtype == w2.dtype):
        return False
    up = w13 if w13_t else w13.transpose(-2, -1)  # [E, H, 2I] as the forward multiplies it
    down = w2 if w2_t else w2.transpose(-2, -1)  # [E, I, H]
    # ``_grouped_mm_takes(x, down)`` checks the down projection's rows (I wide) as its matrix's rows.
    return up.shape[-1] == 2 * down.shape[-2] and _grouped_mm_takes(x, up) and _grouped_mm_takes(x, down)


class _GroupedExperts(torch.autograd.Function):
    """The native definition's grouped-matmul path (see the module docstring), its backward by hand."""

    @staticmethod
    def forward(ctx, x, weights, ids, up, down, activation):
        # up: [E, H, 2I] and down: [E, I, H], each as the forward multiplies it (views of the weights).
        tokens, top_k = ids.shape
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        offsets = _group_ends(sorted_ids, up.shape[0])
        token_of_row = torch.div(order, top_k, rounding_mode="floor")
        h = torch._grouped_mm(x[token_of_row], up, offs=offsets)
        op, args = _op_and_args(activation)
        provider = op.select_with_backward(h, *args)  # the backward recomputes with the same implementation
        out = torch._grouped_mm(provider.impl(h, *args), down, offs=offsets)
        permuted = out[inverse]
        contributions = permuted * weights.reshape(-1, 1)
        ctx.save_for_backward(x, weights, up, down, token_of_row, order, inverse, offsets, h, permuted)
        ctx.provider, ctx.args, ctx.top_k, ctx.dtype = provider, args, top_k, contributions.dtype
        return contributions.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weights, up, down, token_of_row, order, inverse, offsets, h, permuted = ctx.saved_tensors
        need_x, need_weights, _, need_up, need_down, _ = ctx.needs_input_grad
        width = grad.shape[-1]
        # The cast's and the sum's backward: every slot of a token gets the token's gradient.
        g = grad.to(ctx.dtype).unsqueeze(1).expand(-1, ctx.top_k, width).reshape(-1, width)
        grad_weights = (g * permuted).sum(-1).view(weights.shape).to(weights.dtype) if need_weights else None
        grad_x = grad_up = grad_down = None
        if need_x or need_up or need_down:
            g_out = (g * weights.reshape(-1, 1)).to(permuted.dtype)[order]  # back to expert order
            g_product = torch._grouped_mm(g_out, down.transpose(-2, -1), offs=offsets)
            # The activation's gradient, in place over h (nothing else reads it), and its product again
            # where the down projection's gradient needs it.
            g_h, product = _backward_and_output(ctx.provider, g_product, h, ctx.args, in_place=True, output=need_down)
            if need_down:
                grad_down = torch._grouped_mm(product.transpose(0, 1), g_out, offs=offsets)
            if need_up:
                grad_up = torch._grouped_mm(x[token_of_row].transpose(0, 1), g_h, offs=offsets)
            if need_x:
                g_rows = torch._grouped_mm(g_h, up.transpose(-2, -1), offs=offsets)
                grad_x = g_rows[inverse].view(-1, ctx.top_k, width).sum(dim=1)  # each token's k rows
        return grad_x, grad_weights, None, grad_up, grad_down, None


def grouped_experts_apply(
    x, weights, ids, w13, w2, b13, b2, activation, interleaved, gate_first, w13_transposed, w2_transposed, alpha, limit
) -> Tensor:
    """``moe_experts_native`` of a call ``_applies`` accepts, as one autograd node."""
    up = w13 if w13_transposed else w13.transpose(-2, -1)
    down = w2 if w2_transposed else w2.transpose(-2, -1)
    return _GroupedExperts.apply(x, weights, ids, up, down, activation)


MOE_EXPERTS.register(
    Provider("torch", moe_experts_native, supports_args=_applies, differentiable=True, autograd=grouped_experts_apply)
)
