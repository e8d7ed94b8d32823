"""moe_experts' training node (ops/moe_grouped.py) against the native definition under autograd.

The node runs the native definition's ops in the same order, so its output must equal the
native one bit for bit, and its hand-written backward must give autograd's gradients (the same
grouped matmuls; equal on the CPU, where the kernels are deterministic) for the input, the routing
weights and both expert weights, in every layout it takes. On a GPU, the same in bf16.
"""

from __future__ import annotations

import pytest
import torch

from transfuse import ops
from transfuse.ops import ExpertsSpec, moe_experts_native
from transfuse.ops.moe_grouped import _applies, grouped_experts_apply

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


def _case(device, dtype, spec: ExpertsSpec, tokens=37, hidden=32, inter=48, experts=6, top_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    if spec.w13_transposed:
        w13 = w13.transpose(1, 2).contiguous()
    if spec.w2_transposed:
        w2 = w2.transpose(1, 2).contiguous()
    ids[0] = torch.tensor([experts - 1] * 1 + [0] * (top_k - 1))  # expert 0 and the last one used
    ids[:, :] = torch.where(ids == 3, 2, ids)  # expert 3 gets no rows: an empty group
    grad = torch.randn(tokens, hidden, generator=g)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (x, weights, w13, w2)]
    return leaves, ids.to(device), grad.to(device=device, dtype=dtype)


def _run(fn, leaves, ids, grad, spec):
    x, weights, w13, w2 = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(x, weights, ids, w13, w2, None, None, *spec.flags(), 1.0, float("inf"))
    out.backward(grad)
    return out.detach(), [t.grad for t in (x, weights, w13, w2)]


SPECS = {
    "silu": ExpertsSpec("silu"),
    "gelu": ExpertsSpec("gelu"),
    "gelu_tanh transposed": ExpertsSpec("gelu_tanh", w13_transposed=True, w2_transposed=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_training_node_gives_the_native_definitions_output_and_gradients(device, dtype, name):
    spec = SPECS[name]
    leaves, ids, grad = _case(device, dtype, spec)
    args = (*leaves[:1], leaves[1], ids, *leaves[2:], None, None, *spec.flags(), 1.0, float("inf"))
    with torch.enable_grad():
        assert _applies(*args)
    got, got_grads = _run(grouped_experts_apply, leaves, ids, grad, spec)
    want, want_grads = _run(moe_experts_native, leaves, ids, grad, spec)
    assert torch.equal(got, want), f"{name} {dtype}: the forward differs from the native definition"
    for what, g, w in zip(("x", "weights", "w13", "w2"), got_grads, want_grads):
        assert g is not None and g.shape == w.shape and g.dtype == w.dtype, what
        if device == "cpu":
            assert torch.equal(g, w), f"{name} {dtype}: the gradient of {what} differs from autograd's"
        else:  # GPU matmuls may split their sums differently between calls
            torch.testing.assert_close(g, w, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-3)


def test_dispatch_takes_the_node_only_when_autograd_needs_a_backward_of_a_form_it_computes():
    spec = SPECS["silu"]
    leaves, ids, grad = _case("cpu", torch.float32, spec)
    x, weights, w13, w2 = leaves
    with ops.trace() as calls:
        ops.moe_experts(x, weights, ids, w13, w2, spec).sum().backward()
        with torch.no_grad():
            ops.moe_experts(x, weights, ids, w13, w2, spec)
        ops.moe_experts(x, weights, ids, w13, w2, ExpertsSpec("silu", interleaved=True))  # not a form it takes
        ops.moe_experts(x, weights, ids, w13, w2, spec, b2=torch.zeros(w2.shape[:2], requires_grad=True))
    assert [c.provider for c in calls if c.op == "moe_experts"] == ["torch", "native", "native", "native"]
    assert all(t.grad is not None for t in leaves)


def test_frozen_expert_weights_get_no_gradient_and_the_rest_are_autograds():
    """LoRA elsewhere, frozen experts: only the input's and the routing weights' gradients."""
    spec = SPECS["silu"]
    leaves, ids, grad = _case("cpu", torch.float32, spec)
    for t in leaves[2:]:
        t.requires_grad_(False)
    x, weights = (t.detach().clone().requires_grad_() for t in leaves[:2])
    grouped_experts_apply(x, weights, ids, *leaves[2:], None, None, *spec.flags(), 1.0, float("inf")).backward(grad)
    x2, weights2 = (t.detach().clone().requires_grad_() for t in leaves[:2])
    moe_experts_native(x2, weights2, ids, *leaves[2:], None, None, *spec.flags(), 1.0, float("inf")).backward(grad)
    assert torch.equal(x.grad, x2.grad) and torch.equal(weights.grad, weights2.grad)
    assert leaves[2].grad is None and leaves[3].grad is None
