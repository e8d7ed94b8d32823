"""act_and_mul: ``act(x[..., :d]) * x[..., d:]``, the gated activation of a GLU MLP.

A merged gate/up projection produces ``[gate | up]`` along the last dimension; these ops
apply the activation to the gate half and multiply by the up half, in the input dtype,
exactly as ``act_fn(gate_proj(x)) * up_proj(x)`` does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .conformance import Rows
from .dispatch import Op, Provider
from .hooks import watched

__all__ = [
    "ACTIVATIONS",
    "GELU_AND_MUL",
    "SILU_AND_MUL",
    "act_and_mul",
    "act_and_mul_backward_native",
    "act_and_mul_linear",
    "gelu_and_mul_native",
    "identify_activation",
    "silu_and_mul_native",
]

# The attribute that marks an input nothing but act_and_mul reads (``MergedProjection`` sets it on a
# gate/up output when no hook can see it): a backward kernel may then overwrite it with its gradient.
CONSUMABLE = "_transfuse_consumable"

# Activation names act_and_mul accepts, as F.gelu's ``approximate`` names them for gelu.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    # ``chunk``, not two slices: its backward writes both halves' gradients into one tensor (a
    # concatenation), where two slices' backward zero-fill a full-size tensor each and add them.
    gate, up = x.chunk(2, dim=-1)
    return gate, up


def silu_and_mul_native(x: Tensor) -> Tensor:
    gate, up = _halves(x)
    return F.silu(gate) * up


def gelu_and_mul_native(x: Tensor, approximate: str = "none") -> Tensor:
    gate, up = _halves(x)
    return F.gelu(gate, approximate=approximate) * up


class _ActAndMulRows(Rows):
    """Rows of ``[gate | up]``; a provider's one-kernel backward (``backward_and_output``) is
    judged on its gradient and on the output it gives again."""

    def __init__(self):
        super().__init__("x", grads=("x",), scale=2.0)

    def backward_forms(self, provider: Provider) -> list:
        if provider.backward_and_output is None:
            return []

        def run(grads: list, args: tuple, kwargs: dict) -> list:
            grad_x, _ = provider.backward_and_output(grads[0], *args, in_place=False, output=True, **kwargs)
            return [grad_x]

        return [("its backward kernel", run)]


def act_and_mul_backward_native(grad: Tensor, x: Tensor, approximate: str | None) -> Tensor:
    """The gradient ``[dgate | dup]`` of act_and_mul at ``x`` (silu for ``approximate`` None, else
    gelu with it), by the formulas native autograd applies to ``act(gate) * up``."""
    gate, up = _halves(x)
    if approximate is None:
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        activated = F.silu(gate)
    else:
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate=approximate)
        activated = F.gelu(gate, approximate=approximate)
    return torch.cat([grad_gate, grad * activated], dim=-1)


def _act_and_mul_backward(grad: Tensor, x: Tensor, approximate: str | None) -> Tensor:
    op, args = (SILU_AND_MUL, ()) if approximate is None else (GELU_AND_MUL, (approximate,))
    provider = op.select_with_backward(x, *args)
    if provider.backward_and_output is not None:
        return provider.backward_and_output(grad, x, *args, in_place=False, output=False)[0]
    return act_and_mul_backward_native(grad, x, approximate)


# The library ops' backward, for ``torch.compile`` of training code (``under_compile_use_library_op``
# with ``backward``): the gradient in one kernel, where Inductor's code for the gradient of the
# merged projection's two halves concatenates them in a kernel of its own making.
@torch.library.custom_op("transfuse::silu_and_mul_backward", mutates_args=())
def _silu_and_mul_backward_library_op(grad: Tensor, x: Tensor) -> Tensor:
    return _act_and_mul_backward(grad, x, None)


@_silu_and_mul_backward_library_op.register_fake
def _(grad, x):
    return torch.empty_like(x)


@torch.library.custom_op("transfuse::gelu_and_mul_backward", mutates_args=())
def _gelu_and_mul_backward_library_op(grad: Tensor, x: Tensor, approximate: str) -> Tensor:
    return _act_and_mul_backward(grad, x, approximate)


@_gelu_and_mul_backward_library_op.register_fake
def _(grad, x, approximate):
    return torch.empty_like(x)


def _keep_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1] if len(inputs) > 1 else None


def _silu_and_mul_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.transfuse.silu_and_mul_backward(grad, x)


def _gelu_and_mul_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.transfuse.gelu_and_mul_backward(grad, x, ctx.approximate), None


SILU_AND_MUL = Op(
    "silu_and_mul", silu_and_mul_native, sampler=_ActAndMulRows(), library=True,
    autograd=(_silu_and_mul_grad, _keep_input),
)  # fmt: skip
GELU_AND_MUL = Op(
    "gelu_and_mul", gelu_and_mul_native, sampler=_ActAndMulRows(), library=True,
    autograd=(_gelu_and_mul_grad, _keep_input),
)  # fmt: skip


def act_and_mul(x: Tensor, activation: str | nn.Module) -> Tensor:
    """``act(gate) * up`` for ``x = [gate | up]``; ``activation`` is one of ``ACTIVATIONS``, or a module
    that computes it (a GLU's activation module that has hooks), which is called on the gate."""
    if x.shape[-1] % 2:
        raise ValueError(f"act_and_mul needs an even last dimension ([gate | up]), got {x.shape[-1]}.")
    if isinstance(activation, nn.Module):
        gate, up = _halves(x)
        return activation(gate) * up
    op, args = _op_and_args(activation)
    return op(x, *args)


def act_and_mul_linear(linear: nn.Module, x: Tensor, activation: str | nn.Module) -> Tensor:
    """``linear(act_and_mul(x, activation))``: a GLU's product and the projection that reads it.

    The same numbers as those two calls. What differs is what a training step keeps: autograd
    would keep the product (``[tokens, width]``) for the linear layer's weight gradient, beside
    ``x``, which act_and_mul's own backward keeps anyway. Here only ``x`` is kept and the product is
    computed again in the backward, by the kernel that computes act_and_mul's gradient from the same
    read of ``x`` (a Llama-3-8B layer at 8192 tokens: 235 MB less per layer until its backward).

    Only for a plain ``nn.Linear`` that nothing watches (no hooks, plain parameters, no autocast):
    anything else (a LoRA wrapper, a tensor-parallel layer, a hooked or quantised layer) is called
    as it is, after act_and_mul. So is every call that records no backward, every compiled
    one (Inductor chooses what to keep and what to recompute itself), and every call whose
    activation is a module (``act_and_mul``)."""
    if not isinstance(activation, nn.Module) and _recomputes(linear, x):
        op, args = _op_and_args(activation)
        return _ActAndMulLinear.apply(x, linear.weight, linear.bias, op, args)
    return linear(act_and_mul(x, activation))


def _op_and_args(activation: str) -> tuple[Op, tuple]:
    if activation == "silu":
        return SILU_AND_MUL, ()
    if activation in ("gelu", "gelu_tanh"):
        return GELU_AND_MUL, ("tanh" if activation == "gelu_tanh" else "none",)
    raise ValueError(f"act_and_mul has no activation {activation!r}; it has: {', '.join(ACTIVATIONS)}.")


def _recomputes(linear: nn.Module, x: Tensor) -> bool:
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or type(linear) is not nn.Linear:
        return False
    weight, bias = linear.weight, linear.bias
    if type(weight) is not nn.Parameter or not (bias is None or type(bias) is nn.Parameter):
        return False  # a tensor subclass (DTensor, a quantised weight) computes its own way
    if not (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if x.dtype != weight.dtype or x.shape[-1] != 2 * weight.shape[1] or torch.is_autocast_enabled(x.device.type):
        return False
    return not watched(linear)


class _ActAndMulLinear(torch.autograd.Function):
    """``F.linear(act_and_mul(x), weight, bias)`` keeping ``x`` and ``weight`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, op, args):
        # The provider autograd would pick, so that the backward recomputes the product with the
        # same implementation (the same bits) the forward used.
        provider = op.select_with_backward(x, *args)
        product = provider.impl(x, *args)
        ctx.save_for_backward(x, weight)
        ctx.provider, ctx.args = provider, args
        # A merged gate/up output that nothing else reads takes its gradient in place.
        ctx.consumable = getattr(x, CONSUMABLE, False) and x.is_contiguous()
        return F.linear(product, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = grad_weight = grad_bias = None
        if need_x:
            # The product again only where the weight's gradient reads it (a frozen down projection,
            # as under LoRA elsewhere, needs the input's gradient alone).
            grad_x, product = _backward_and_output(
                ctx.provider, grad.matmul(weight), x, ctx.args, ctx.consumable, output=need_weight
            )
            if ctx.consumable and grad_x.data_ptr() == x.data_ptr():
                # Its version is bumped, so a later autograd use of x fails autograd's check
                # rather than read the gradient.
                torch.autograd.graph.increment_version(x)
        elif need_weight:
            product = ctx.provider.impl(x, *ctx.args)
        rows = grad.reshape(-1, grad.shape[-1])
        if need_weight:
            grad_weight = rows.t().mm(product.reshape(-1, product.shape[-1]))
        if need_bias:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias, None, None


def _backward_and_output(
    provider: Provider, grad: Tensor, x: Tensor, args: tuple, in_place: bool, output: bool
) -> tuple[Tensor, Tensor | None]:
    """(act_and_mul's gradient at ``x``, its output at ``x`` if ``output`` else None): in one kernel
    where the provider has one, else by autograd through the provider's differentiable
    implementation."""
    if provider.backward_and_output is not None:
        return provider.backward_and_output(grad, x, *args, in_place=in_place, output=output)
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        product = provider.implementation(True)(leaf, *args)
    (grad_x,) = torch.autograd.grad(product, leaf, grad)
    return grad_x, product.detach() if output else None


@functools.cache
def _probe(dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A gate probe in ``dtype`` (a sweep plus random values) and each fused activation's output on it.
    On the CPU whatever the default device is (a ``with torch.device("meta")`` block has no data,
    and the cache outlives the block)."""
    sweep = torch.linspace(-8.0, 8.0, 257, device="cpu")
    noise = torch.randn(256, generator=torch.Generator().manual_seed(0), device="cpu") * 3
    gate = torch.cat([sweep, noise]).to(dtype)
    gate_up = torch.cat([gate, torch.ones_like(gate, device="cpu")])
    native = {
        "silu": silu_and_mul_native(gate_up),
        "gelu": gelu_and_mul_native(gate_up, "none"),
        "gelu_tanh": gelu_and_mul_native(gate_up, "tanh"),
    }
    return gate, native


def identify_activation(module: nn.Module) -> str | None:
    """Which fused activation a stateless activation module computes, checked bit for bit in fp32 and bf16."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    candidates = set(ACTIVATIONS)
    for dtype in (torch.float32, torch.bfloat16):
        gate, expected = _probe(dtype)
        with torch.no_grad():
            got = module(gate)
        candidates &= {a for a, want in expected.items() if torch.equal(want, got)}
    return candidates.pop() if len(candidates) == 1 else None
