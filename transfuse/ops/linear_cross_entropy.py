"""linear_cross_entropy: a causal LM's loss from its hidden states, chunk by chunk, never holding the logits.

``loss = CE(t(h @ Wᵀ + b).float(), shifted labels)`` as transformers' ``ForCausalLMLoss`` computes
it (labels shifted by one with a pad of ``ignore_index``, or ``shift_labels`` as given; the mean
over the labels that count, or the sum over ``num_items_in_batch``), with ``t`` the model's own
elementwise transform of its logits (Gemma 2's soft-capping, Cohere's and Granite's scales) or
none. A full ``[tokens, vocab]`` logits tensor, its float32 copy and their gradients are the
largest tensors of a training step (4 GiB each for Llama 3's vocabulary at 8k tokens). Here rows
are taken a block at a time (``BLOCK_BYTES`` of logits): a block's logits are computed, turned
into its loss, and overwritten in place by their gradient, by the ``cross_entropy_grad`` op (a
Triton kernel on GPUs, which reads the logits twice and writes them once) or, with a transform,
by autograd through ``t`` and the float32 cross-entropy; either way the gradient rounds where the
unfused model's does. The block's share of the hidden states' gradient is then one matmul, and
the weight's gradient is summed over blocks in the weight's dtype (one rounding per block after
the first: a few at Llama 3's shapes, where the unfused model rounds once, and far fewer than a
per-chunk sum; a float32 sum would hold a float32 weight gradient as large as all the logit
gradients). Everything is computed in forward; backward only scales the results.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .conformance import Rows
from .dispatch import Op

__all__ = [
    "CROSS_ENTROPY_GRAD",
    "SCALE_",
    "causal_lm_loss",
    "cross_entropy_grad_native",
    "linear_cross_entropy",
    "scale_native",
]

# Rows per chunk of the native loss: a chunk's logits, their float32 copy, its log-softmax and its
# float32 gradient (about 14 bytes an element) stay under this many bytes (benchmarks may set it).
CHUNK_BYTES = 256 << 20
# Rows per block of logit gradients (in the logits' dtype): the largest tensor held. The weight's
# gradient is summed over blocks in its own dtype, one rounding per block after the first. Each
# block's sum is a matmul that also reads and writes the whole weight gradient, so fewer, larger
# blocks are faster: at Llama-3-8B's shapes (8192 tokens) on an H200, 512 MiB took 1.4 ms a step
# off 256 MiB's 114.3 for 0.18 GiB more peak, and 1 GiB 2.3 ms for 0.67 GiB
# (``benchmarks/results/h200_train_llama_loss_blocks_2026-12-02.md``); in another run 1 GiB was 0.8 ms
# slower than 512 MiB, inside the rounds' spread (``h200_train_llama_2026-12-02.md``): 512 MiB it is.
BLOCK_BYTES = 512 << 20


def _rows_under(rows: int, bytes_per_row: int, budget: int) -> int:
    return max(1, min(rows, 2 ** int(math.log2(max(1, budget // bytes_per_row)))))


def _chunk_rows(rows: int, vocab: int) -> int:
    return _rows_under(rows, 14 * vocab, CHUNK_BYTES)


def _block_rows(rows: int, vocab: int, element_size: int) -> int:
    return _rows_under(rows, vocab * element_size, BLOCK_BYTES)


def _row_losses(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int, transform, differentiate: bool) -> Tensor:
    """Each row's ``CE(transform(logits).float(), targets)`` (0 where the target is ``ignore_index``),
    and, when ``differentiate``, ``logits`` overwritten by the gradient of ``scale * sum(losses)``:
    autograd through the unfused model's arithmetic, a chunk of rows at a time."""
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    step = _chunk_rows(logits.shape[0], logits.shape[1])
    for start in range(0, logits.shape[0], step):
        chunk = logits[start : start + step]
        with torch.enable_grad():
            leaf = chunk.detach().requires_grad_(differentiate)
            shaped = transform(leaf) if transform is not None else leaf
            loss = F.cross_entropy(shaped.float(), targets[start : start + step], ignore_index=ignore_index, reduction="none")
        if differentiate:
            # The gradient rounds to the logits' dtype after the scale, as the unfused model's does.
            (grad,) = torch.autograd.grad(loss, leaf, scale.expand_as(loss))
            chunk.copy_(grad)
        losses[start : start + step] = loss.detach()
    return losses


def cross_entropy_grad_native(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int) -> Tensor:
    """Each row's loss ``CE(logits.float(), targets)`` (0 where ``targets`` is ``ignore_index``), with
    ``logits [N, V]`` overwritten by the gradient of ``scale * sum(losses)``, ``scale * (softmax -
    onehot)`` computed in float32 and rounded once to their dtype, as autograd rounds the unfused
    model's. The definition, and the CPU path; written out rather than differentiated, so that it
    also runs where autograd is off (inside the op that ``torch.compile`` sees)."""
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    step = _chunk_rows(logits.shape[0], logits.shape[1])
    for start in range(0, logits.shape[0], step):
        chunk, target = logits[start : start + step], targets[start : start + step]
        x = chunk.float()
        ignored = target == ignore_index
        safe = target.masked_fill(ignored, 0).unsqueeze(1)
        lse = torch.logsumexp(x, dim=1, keepdim=True)
        losses[start : start + step] = (lse - x.gather(1, safe)).squeeze(1).masked_fill(ignored, 0.0)
        row_scale = scale.float().expand(x.shape[0], 1).masked_fill(ignored.unsqueeze(1), 0.0)
        grad = x.sub_(lse).exp_().mul_(row_scale)
        grad.scatter_add_(1, safe, -row_scale)
        chunk.copy_(grad)
    return losses


class _LossRows(Rows):
    """Rows of logits with a target each (some ignored); the logits are overwritten (compared)."""

    def __init__(self):
        super().__init__("logits", mutates=("logits",), scale=3.0)

    def make(self, shape_class, args, kwargs, generator):
        (logits, targets, scale, ignore_index), _ = super().make(shape_class, args, kwargs, generator)
        rows = logits.reshape(-1, logits.shape[-1]).shape[0] if logits.dim() > 1 else 1
        picks = torch.randint(0, logits.shape[-1], (rows,), generator=generator, device=logits.device)
        picks[::3] = ignore_index
        return (logits.reshape(rows, -1), picks.to(targets.dtype), scale, ignore_index), {}


CROSS_ENTROPY_GRAD = Op("cross_entropy_grad", cross_entropy_grad_native, sampler=_LossRows())


def scale_native(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` multiplied in place by the one-element ``scale`` rounded to ``x``'s dtype (as ``mul_``
    by a tensor of another dtype rounds it), and returned."""
    return x.mul_(scale.to(x.dtype))


# The backward's scaling of the saved gradients by the loss's gradient. ``mul_`` by a one-element
# GPU tensor takes TensorIterator's unvectorised broadcast path (1.5-2.3 ms for Llama 3's 1 GiB
# head gradient on an H200, 3-5x a copy's time); a kernel that reads the scale once per program
# runs at copy bandwidth.
SCALE_ = Op("scale_", scale_native, sampler=Rows("x", mutates=("x",)))


def _block_loss(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int, transform, differentiate: bool) -> Tensor:
    """A block of rows' summed, scaled loss; their logits overwritten by its gradient when ``differentiate``."""
    if transform is None and differentiate and not torch.compiler.is_compiling():
        losses = CROSS_ENTROPY_GRAD(logits, targets, scale, ignore_index)  # a kernel where there is one
    else:
        losses = _row_losses(logits, targets, scale, ignore_index, transform, differentiate)
    return losses.sum() * scale


def _loss_and_grads(hidden, weight, bias, targets, ignore_index, scale, transform, block_rows, needs):
    """The summed, scaled loss and the gradients that ``needs`` (hidden, weight, bias) asks for."""
    needs_hidden, needs_weight, needs_bias = needs
    differentiate = needs_hidden or needs_weight or needs_bias
    rows = hidden.shape[0]
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    grad_weight = grad_bias = None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, rows, block_rows):
        h = hidden[start : start + block_rows]
        # This block's logits, then (in place) their gradient: the one [rows, vocab] tensor held.
        logits = F.linear(h, weight, bias)
        total += _block_loss(logits, targets[start : start + block_rows], scale, ignore_index, transform, differentiate)
        if needs_hidden:
            torch.mm(logits, weight, out=grad_hidden[start : start + block_rows])
        if needs_weight:
            grad_weight = logits.t() @ h if grad_weight is None else grad_weight.addmm_(logits.t(), h)
        if needs_bias:
            block_sum = logits.sum(0, dtype=torch.float32)
            grad_bias = block_sum if grad_bias is None else grad_bias + block_sum
        del logits
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return total, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, scale, transform, block_rows):
        total, *grads = _loss_and_grads(
            hidden, weight, bias, targets, ignore_index, scale, transform, block_rows, ctx.needs_input_grad[:3]
        )
        ctx.save_for_backward(*grads)
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place: a scaled copy would hold a second weight gradient (1 GiB for Llama 3's
        # head) beside the saved one at the step's peak. A second backward through the same graph
        # (retain_graph=True) then fails autograd's version check instead of scaling twice.
        # (``_foreach_mul_`` with the scale in float32 was slower than ``mul_`` on an H200, 2.30
        # against 1.49 ms: it falls back to a per-tensor path with type promotion.)
        grads = [SCALE_(g, grad_loss) if g is not None else None for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None)


# Under torch.compile, the loss (without a transform) is one opaque op: Dynamo cannot trace a loop
# that differentiates inside a forward, and would break the graph around it. Gradients not asked
# for come back empty.
@torch.library.custom_op("transfuse::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int, scale: Tensor,
    block_rows: int, needs_hidden: bool, needs_weight: bool, needs_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    total, *grads = _loss_and_grads(hidden, weight, bias, targets, ignore_index, scale, None, block_rows, needs)
    return (total, *(g if g is not None else hidden.new_empty(0) for g in grads))


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, targets, ignore_index, scale, block_rows, needs_hidden, needs_weight, needs_bias):
    def grad(needed, like):
        return torch.empty_like(like) if needed and like is not None else hidden.new_empty(0)

    total = hidden.new_empty((), dtype=torch.float32)
    return total, grad(needs_hidden, hidden), grad(needs_weight, weight), grad(needs_bias, bias)


def _linear_cross_entropy_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.needs = inputs[7:10]


def _linear_cross_entropy_backward(ctx, grad_loss, *unused):
    grads = [g * grad_loss.to(g.dtype) if needed else None for g, needed in zip(ctx.saved_tensors, ctx.needs)]
    return (*grads, None, None, None, None, None, None, None)


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_backward, setup_context=_linear_cross_entropy_setup)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Tensor | int | float | None = None,
    transform: Callable[[Tensor], Tensor] | None = None,
    block_rows: int | None = None,
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
    scale = 1.0 / count
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # The logits in autocast's dtype, as the head's matmul under autocast gives them; the casts are
        # differentiated outside (each gradient arrives in its input's dtype), the loss computed inside
        # with autocast off, so that its matmuls and in-place sums see one dtype.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return _linear_cross_entropy(hidden, weight, bias, targets, ignore_index, scale, transform, block_rows)
    return _linear_cross_entropy(hidden, weight, bias, targets, ignore_index, scale, transform, block_rows)


def _linear_cross_entropy(hidden, weight, bias, targets, ignore_index, scale, transform, block_rows):
    block = block_rows or _block_rows(hidden.shape[0], weight.shape[0], hidden.element_size())
    if transform is None and torch.compiler.is_compiling():
        needs = [t is not None and t.requires_grad and torch.is_grad_enabled() for t in (hidden, weight, bias)]
        return torch.ops.transfuse.linear_cross_entropy(hidden, weight, bias, targets, ignore_index, scale, block, *needs)[0]
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, scale, transform, block)


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
