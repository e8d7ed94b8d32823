"""linear_cross_entropy: a causal LM's loss from its hidden states, chunk by chunk, never holding the logits.

``loss = CE(t(h @ Wᵀ + b).float(), shifted labels)`` as transformers' ``ForCausalLMLoss`` computes
it (labels shifted by one with a pad of ``ignore_index``, or ``shift_labels`` as given; the mean
over the labels that count, or the sum over ``num_items_in_batch``), with ``t`` the model's own
elementwise transform of its logits (Gemma 2's soft-capping, Cohere's and Granite's scales) or
none. A full ``[tokens, vocab]`` logits tensor, its float32 copy and their gradients are the
largest tensors of a training step (4 GiB each for Llama 3's vocabulary at 8k tokens); here rows
are taken ``chunk_rows`` at a time: each chunk's logits are computed, transformed, turned into
the loss and differentiated there (autograd through ``t`` and the float32 cross-entropy, so the
gradient rounds where the unfused model's does) into one ``[tokens, vocab]`` tensor of logit
gradients in the logits' dtype, the only full-size tensor held (the unfused model holds it too,
beside the logits, their float32 copy and its log-softmax). The hidden states' and the weight's
gradients are then one matmul each, rounded once as the unfused model's are (a weight gradient
summed chunk by chunk would instead round once per chunk in bf16, or read and write a float32
copy of the weight once per chunk), and the logit gradients are freed before the forward
returns: backward only scales the results.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["causal_lm_loss", "linear_cross_entropy"]

# Rows per chunk: a chunk's logits, their float32 copy, its log-softmax and its float32 gradient
# (about 14 bytes an element) stay under this many bytes (benchmarks may set it).
CHUNK_BYTES = 512 << 20


def _chunk_rows(rows: int, vocab: int) -> int:
    per_row = 14 * vocab
    return max(1, min(rows, 2 ** int(math.log2(max(1, CHUNK_BYTES // per_row)))))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, scale, transform, chunk_rows):
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        differentiate = needs_hidden or needs_weight or needs_bias
        rows, vocab = hidden.shape[0], weight.shape[0]
        # The logits' gradient for every row, in the logits' dtype (as the unfused model holds it):
        # the chunks fill it, then the hidden states' and the weight's gradients are one matmul each,
        # rounded once as the unfused model's are. It is the one [tokens, vocab] tensor held.
        grad_logits = torch.empty((rows, vocab), dtype=torch.result_type(hidden, weight), device=hidden.device) if differentiate else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk_rows):
            h = hidden[start : start + chunk_rows]
            with torch.enable_grad():
                logits = F.linear(h, weight, bias).detach().requires_grad_(differentiate)
                shaped = transform(logits) if transform is not None else logits
                loss = F.cross_entropy(
                    shaped.float(), targets[start : start + chunk_rows], ignore_index=ignore_index, reduction="sum"
                )
                scaled = loss * scale  # the gradient rounds to the logits' dtype after the scale, as unfused
            total += scaled.detach()
            if differentiate:
                (grad_logits[start : start + chunk_rows],) = torch.autograd.grad(scaled, logits)
            del logits, shaped, loss, scaled
        grads = (None, None, None)
        if differentiate:
            grads = (
                grad_logits @ weight if needs_hidden else None,
                grad_logits.t() @ hidden if needs_weight else None,
                grad_logits.sum(0, dtype=torch.float32).to(bias.dtype) if needs_bias else None,
            )
            del grad_logits
        ctx.save_for_backward(*grads)
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        grads = [g * grad_loss.to(g.dtype) if g is not None else None for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Tensor | int | float | None = None,
    transform: Callable[[Tensor], Tensor] | None = None,
    chunk_rows: int | None = None,
) -> Tensor:
    """``CE(transform(hidden @ weightᵀ + bias).float(), targets)`` for ``hidden [N, H]``, ``targets [N]``:
    the mean over targets other than ``ignore_index``, or the sum over ``num_items_in_batch``."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy takes hidden states [N, H] and targets [N]; got {tuple(hidden.shape)} "
            f"and {tuple(targets.shape)}."
        )
    targets = targets.to(hidden.device)
    if num_items_in_batch is None:
        count = targets.ne(ignore_index).sum().to(torch.float32)
    elif torch.is_tensor(num_items_in_batch):
        count = num_items_in_batch.to(device=hidden.device, dtype=torch.float32)
    else:
        count = torch.tensor(float(num_items_in_batch), device=hidden.device)
    chunk = chunk_rows or _chunk_rows(hidden.shape[0], weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, 1.0 / count, transform, chunk)


def causal_lm_loss(
    head: nn.Module,
    hidden_states: Tensor,
    labels: Tensor,
    vocab_size: int,
    num_items_in_batch: Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    *,
    transform: Callable[[Tensor], Tensor] | None = None,
    **kwargs,
) -> Tensor:
    """transformers' ``ForCausalLMLoss(head(hidden_states) [transformed], labels, ...)``, same arguments
    after the logits, computed by ``linear_cross_entropy`` from the head's weight and bias."""
    weight, bias = head.weight, getattr(head, "bias", None)
    if weight.shape[0] != vocab_size:
        raise ValueError(f"The output projection has {weight.shape[0]} rows but vocab_size is {vocab_size}.")
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    return linear_cross_entropy(
        hidden,
        weight,
        shift_labels.reshape(-1),
        bias,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        transform=transform,
    )
