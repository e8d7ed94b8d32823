"""linear_with_adapters against the same arithmetic in plain autograd ops: float64 gradients by
gradcheck, a bf16 projection with float32 adapters (LoRA's usual dtypes), autocast, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transfuse.ops.low_rank import Adapter, _composed, linear_with_adapters


def _tensors(dtype, adapter_dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dt=dtype):
        return (torch.randn(shape, generator=g) * 0.5).to(dt).requires_grad_()

    x, weight = rand(2, 5, 16), rand(24, 16)
    b = rand(24) if bias else None
    # q-like part 0:8 with two adapters (one with a bias on B), k-like 8:16 with one, v-like 16:24 none;
    # one adapter takes an input of its own (as with dropout).
    own = rand(2, 5, 16, dt=adapter_dtype)
    specs = [(0, 3, 2.0, False, False), (0, 2, 0.5, True, False), (8, 4, 1.0, False, True)]
    adapters = []
    for start, rank, scale, has_bias, has_input in specs:
        adapters.append(
            Adapter(
                start, rand(rank, 16, dt=adapter_dtype), rand(8, rank, dt=adapter_dtype), scale,
                rand(8, dt=adapter_dtype) if has_bias else None, own if has_input else None,
            )
        )  # fmt: skip
    return x, weight, b, adapters, own


def _leaves(x, weight, b, adapters, own):
    leaves = [x, weight] + ([b] if b is not None else []) + [own]
    for a in adapters:
        leaves += [a.a, a.b] + ([a.b_bias] if a.b_bias is not None else [])
    return leaves


def test_gradients_in_float64_by_gradcheck():
    x, weight, b, adapters, own = _tensors(torch.float64, torch.float64)
    leaves = _leaves(x, weight, b, adapters, own)
    assert torch.autograd.gradcheck(lambda *_: linear_with_adapters(x, weight, b, adapters), leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_plain_autograd_with_float32_adapters(dtype):
    results = []
    for fn in (linear_with_adapters, _composed):
        x, weight, b, adapters, own = _tensors(dtype, torch.float32)
        out = fn(x, weight, b, adapters)
        out.float().pow(2).sum().backward()
        results.append((out, [t.grad for t in _leaves(x, weight, b, adapters, own)]))
    (out, grads), (want, want_grads) = results
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    for got, ref in zip(grads, want_grads):
        assert got.dtype == ref.dtype
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() <= tol


def test_only_what_needs_a_gradient_gets_one():
    x, weight, b, adapters, own = _tensors(torch.float32, torch.float32)
    weight.requires_grad_(False)
    b.requires_grad_(False)
    x_frozen = x.detach()
    linear_with_adapters(x_frozen, weight, b, adapters).sum().backward()
    assert weight.grad is None and b.grad is None
    assert all(a.a.grad is not None and a.b.grad is not None for a in adapters)


def test_autocast_computes_as_the_unfused_layers_would():
    x, weight, b, adapters, own = _tensors(torch.float32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_with_adapters(x, weight, b, adapters)
        want = _composed(x, weight, b, adapters)
    assert out.dtype == want.dtype == torch.bfloat16
    assert torch.equal(out, want)
    out.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and adapters[0].a.grad is not None


def test_no_adapters_is_the_plain_linear_and_bad_shapes_are_errors():
    x, weight, b, adapters, _ = _tensors(torch.float32, torch.float32)
    assert torch.equal(linear_with_adapters(x, weight, b, []), F.linear(x, weight, b))
    wide = Adapter(20, adapters[0].a, adapters[0].b, 1.0)  # 8 columns from 20 do not fit 24
    with pytest.raises(ValueError, match="does not fit"):
        linear_with_adapters(x, weight, b, [wide])
    wrong_rank = Adapter(0, adapters[0].a, adapters[1].b, 1.0)
    with pytest.raises(ValueError, match="do not compose"):
        linear_with_adapters(x, weight, b, [wrong_rank])
