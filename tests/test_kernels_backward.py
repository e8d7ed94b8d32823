"""The kernels' backward (the providers' ``autograd``) against native autograd, on odd shapes in
float32, float16 and bfloat16, every rounding of rms_norm, with and without a weight.

Each gradient is judged against a float64 run of the native op: its relative error (``|g - ref|
/ |ref|``) must be at most ``FACTOR`` times native autograd's own in that dtype, plus a floor.
The kernels compute in float32 throughout, so on a GPU they are at least as accurate as native
(``FACTOR`` 1.5). Under Triton's CPU interpreter a float32 to bfloat16 cast truncates where GPUs
round to nearest (see ``test_kernels.py``), which doubles the rounding error of every bfloat16
store (and of the activation the up gradient reads): there the factor is 4. New tensors start as NaN (``poisoned_allocations``), so a gradient
element that is never written cannot pass.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from transfuse import ops
from transfuse.ops import conformance
from transfuse.ops import fused_add_rms_norm_native, gelu_and_mul_native, rms_norm_native, silu_and_mul_native

from .test_kernels import DEVICE, DTYPES, INTERPRETED, poisoned_allocations  # noqa: F401 (the fixture)

SHAPES = [(1, 33), (7, 40), (2, 3, 257)] + ([(4096, 4096)] if DEVICE == "cuda" else [])
ALL_FLAGS = list(itertools.product([True, False], repeat=5))


def _factor(dtype: torch.dtype) -> float:
    return 4.0 if INTERPRETED and dtype == torch.bfloat16 else 1.5


def _floor(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 1e-4


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not got.isnan().any(), "gradient elements were never written"
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _grads(fn, inputs, grads_out, dtype):
    """Gradients of ``fn`` at ``inputs`` cast to ``dtype``, for output gradients ``grads_out``."""
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads_out)])
    return [t.grad for t in leaves if t is not None]


def _compare(kernel, native, reference, inputs, grads_out, dtype, what):
    with ops.trace() as calls:
        got = _grads(kernel, inputs, grads_out, dtype)
    assert calls and all(c.provider == "triton" and c.grad for c in calls), calls
    want = _grads(native, inputs, grads_out, dtype)
    exact = _grads(reference, inputs, grads_out, torch.float64)
    for i, (g, w, r) in enumerate(zip(got, want, exact)):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        limit = _factor(dtype) * _error(w, r) + _floor(dtype)
        assert _error(g, r) <= limit, f"{what}, input {i}: {_error(g, r):.3g} against native's {_error(w, r):.3g}"


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # the errors compared are statistics of random inputs: the same ones every run


@pytest.fixture
def triton_first():
    """Triton first for every op, run without conformance checks: these tests compare it with
    native themselves, at their own shapes."""
    ops.set_priority(["triton"])
    with conformance.assumed():
        yield
    ops.set_priority(None)


def _rms_norm(flags):
    return lambda x, w: ops.get_op("rms_norm")(x, w, 1e-6, *flags)


def _rms_norm_native(flags):
    return lambda x, w: rms_norm_native(x, w, 1e-6, *flags)


def _exact_rms_norm(flags):
    offset = flags[2]
    return lambda x, w: rms_norm_native(x, w, 1e-6, False, False, offset, False, False)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", ALL_FLAGS, ids=lambda f: "".join(str(int(b)) for b in f))
def test_rms_norm_backward(triton_first, flags, dtype, shape):
    x = torch.randn(shape, device=DEVICE) * 2
    w = torch.randn(shape[-1], device=DEVICE) * 0.5 + (0 if flags[2] else 1)
    dy = torch.randn(shape, device=DEVICE)
    what = f"rms_norm {flags} {dtype} {shape}"
    _compare(_rms_norm(flags), _rms_norm_native(flags), _exact_rms_norm(flags), [x, w], [dy], dtype, what)


@pytest.mark.parametrize("layout", ["heads", "three-levels"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_backward_of_rows_in_levels(triton_first, dtype, layout):
    """The input a head-wise norm of a merged projection gets (rows in two levels of strides, read
    in place) and one that needs three (copied first), with an output gradient that is itself a
    transposed view, as rotary's backward hands it on."""
    flags = (True, True, False, False, False)
    width = 40
    if layout == "heads":
        make = lambda x: x[..., : 4 * width].view(2, 3, 4, width)  # noqa: E731
        source = torch.randn(2, 3, 5 * width, device=DEVICE) * 2
    else:
        make = lambda x: x[:, 1:4, 1:3, :width]  # noqa: E731
        source = torch.randn(2, 5, 4, width + 8, device=DEVICE) * 2
    w = torch.randn(width, device=DEVICE) * 0.5 + 1
    dy = torch.randn(2, make(source).shape[2], 3, width, device=DEVICE).transpose(1, 2)
    kernel = lambda s, w: ops.get_op("rms_norm")(make(s), w, 1e-6, *flags)  # noqa: E731
    native = lambda s, w: rms_norm_native(make(s), w, 1e-6, *flags)  # noqa: E731
    exact = lambda s, w: rms_norm_native(make(s), w, 1e-6, *([False] * 5))  # noqa: E731
    _compare(kernel, native, exact, [source, w], [dy], dtype, f"rms_norm of {layout} rows {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_backward_without_weight(triton_first, dtype):
    flags = (True, True, False, False, False)
    x, dy = torch.randn(5, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE)
    kernel = lambda x: ops.get_op("rms_norm")(x, None, 1e-6, *flags)  # noqa: E731
    native = lambda x: rms_norm_native(x, None, 1e-6, *flags)  # noqa: E731
    exact = lambda x: rms_norm_native(x, None, 1e-6, *([False] * 5))  # noqa: E731
    _compare(kernel, native, exact, [x], [dy], dtype, f"rms_norm without weight {dtype}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", [(True, True, False, False, False), (True, False, True, True, True)], ids=["llama", "gemma"])
def test_fused_add_rms_norm_backward(triton_first, spec, dtype, shape):
    x, residual = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE) * 2
    w = torch.randn(shape[-1], device=DEVICE) * 0.5
    grads_out = [torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)]
    op = ops.get_op("fused_add_rms_norm")
    kernel = lambda x, r, w: op(x, r, w, 1e-6, *spec)  # noqa: E731
    native = lambda x, r, w: fused_add_rms_norm_native(x, r, w, 1e-6, *spec)  # noqa: E731
    exact = lambda x, r, w: fused_add_rms_norm_native(x, r, w, 1e-6, False, False, spec[2], False, False)  # noqa: E731
    _compare(kernel, native, exact, [x, residual, w], grads_out, dtype, f"fused_add_rms_norm {spec} {dtype} {shape}")


ACTIVATIONS = {
    "silu": (lambda x: ops.get_op("silu_and_mul")(x), silu_and_mul_native),
    "gelu": (lambda x: ops.get_op("gelu_and_mul")(x, "none"), lambda x: gelu_and_mul_native(x, "none")),
    "gelu_tanh": (lambda x: ops.get_op("gelu_and_mul")(x, "tanh"), lambda x: gelu_and_mul_native(x, "tanh")),
}


@pytest.mark.parametrize("shape", [(1, 2 * 33), (7, 2 * 40), (2, 3, 2 * 1000)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_act_and_mul_backward(triton_first, activation, dtype, shape):
    kernel, native = ACTIVATIONS[activation]
    x = torch.randn(shape, device=DEVICE) * 3
    dy = torch.randn((*shape[:-1], shape[-1] // 2), device=DEVICE)
    _compare(kernel, native, native, [x], [dy], dtype, f"{activation}_and_mul {dtype} {shape}")


def test_calls_without_grad_take_the_plain_kernels(triton_first):
    x = torch.randn(4, 64, device=DEVICE)
    with ops.trace() as calls, torch.no_grad():
        ops.get_op("silu_and_mul")(x.requires_grad_())
    assert [(c.provider, c.grad) for c in calls] == [("triton", False)]


def test_a_provider_without_backward_is_skipped_when_autograd_needs_one():
    op = ops.get_op("silu_and_mul")
    ops.register_provider("silu_and_mul", "forward_only", lambda x: silu_and_mul_native(x.detach()))
    ops.set_priority(["forward_only"], op="silu_and_mul")
    try:
        x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
        assert op.select(x).name == "native"
        assert op.select(x.detach()).name == "forward_only"
    finally:
        ops.set_priority(None, op="silu_and_mul")
        ops.unregister_provider("silu_and_mul", "forward_only")


def test_a_consumable_input_takes_its_gradient_in_place_and_others_are_untouched(triton_first):
    from transfuse.ops.act_and_mul import CONSUMABLE

    op = ops.get_op("silu_and_mul")
    leaf = torch.randn(6, 2 * 40, device=DEVICE, requires_grad=True)
    dy = torch.randn(6, 40, device=DEVICE)
    results = []
    for consumable in (False, True):
        x = leaf * 1.0  # a temporary, as a projection's output is
        kept = x.detach().clone()
        if consumable:
            setattr(x, CONSUMABLE, True)
        (grad,) = torch.autograd.grad(op(x), x, dy)
        results.append(grad)
        if consumable:
            assert torch.equal(x.detach(), grad)  # written over the input
        else:
            assert torch.equal(x.detach(), kept)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    y = op(leaf)  # a leaf is never consumable
    y.backward(dy)
    assert leaf.grad is not None and not torch.equal(leaf.detach(), leaf.grad)
    x = leaf * 1.0
    setattr(x, CONSUMABLE, True)
    out = op(x)
    out.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(dy)  # a second backward would read the gradient: autograd refuses it


# ---- act_and_mul_linear: a GLU's product and its down projection, the product recomputed ----


def _run_saving(fn):
    """``fn()`` and the shapes of the tensors autograd saved for its backward."""
    shapes = []

    def pack(tensor):
        # By elements and last width: autograd may keep a flattened view ([tokens, width]).
        shapes.append((tensor.numel(), tensor.shape[-1] if tensor.dim() else 0))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        return fn(), shapes


def _glu_linear_step(linear, x0, dout, activation, fused, x_grad=True):
    """Output, gradients (x, weight, bias) and saved shapes of ``linear(act_and_mul(x))``."""
    linear.zero_grad(set_to_none=True)
    x = x0.detach().clone().requires_grad_(x_grad)
    if fused:
        out, saved = _run_saving(lambda: ops.act_and_mul_linear(linear, x, activation))
    else:
        out, saved = _run_saving(lambda: linear(ops.act_and_mul(x, activation)))
    out.backward(dout)
    bias = linear.bias.grad if linear.bias is not None else None
    return out.detach(), x.grad, linear.weight.grad, bias, saved


@pytest.mark.parametrize("provider", ["native", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_linear_gives_the_two_calls_numbers_and_keeps_no_product(provider, activation, dtype):
    ops.set_priority([provider])
    try:
        with conformance.assumed():  # this test judges the kernels itself
            _act_and_mul_linear_matches(activation, dtype, provider)
    finally:
        ops.set_priority(None)


def _act_and_mul_linear_matches(activation, dtype, provider):
    from torch import nn

    width, outputs = 40, 24
    for bias in (False, True):
        linear = nn.Linear(width, outputs, bias=bias, device=DEVICE, dtype=dtype)
        x0 = (torch.randn(2, 5, 2 * width, device=DEVICE) * 3).to(dtype)
        dout = torch.randn(2, 5, outputs, device=DEVICE).to(dtype)
        with ops.trace() as calls:
            fused = _glu_linear_step(linear, x0, dout, activation, fused=True)
        assert {c.provider for c in calls} == {provider}, calls
        plain = _glu_linear_step(linear, x0, dout, activation, fused=False)
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=0)  # the same kernels, the same numbers
        for got, want in zip(fused[1:4], plain[1:4]):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, **tolerance)
        product = (2 * 5 * width, width)
        assert product in plain[4], plain[4]  # autograd keeps the product for the weight's gradient ...
        assert product not in fused[4], fused[4]  # ... act_and_mul_linear does not


def test_act_and_mul_linear_recomputes_the_forwards_product_bit_for_bit(triton_first):
    from transfuse.ops.triton.act_and_mul import gelu_and_mul_backward_and_output, silu_and_mul_backward_and_output

    x = torch.randn(3, 2 * 1000, device=DEVICE).to(torch.bfloat16) * 3
    dy = torch.randn(3, 1000, device=DEVICE).to(torch.bfloat16)
    cases = [(silu_and_mul_backward_and_output, (), silu_and_mul_native)]
    cases += [(gelu_and_mul_backward_and_output, (a,), lambda t, a=a: gelu_and_mul_native(t, a)) for a in ("none", "tanh")]
    for backward_and_output, args, native in cases:
        grad, product = backward_and_output(dy, x, *args)
        forward = ops.get_op("gelu_and_mul" if args else "silu_and_mul")(x, *args)
        assert torch.equal(product, forward)
        leaf = x.detach().requires_grad_()
        (want,) = torch.autograd.grad(native(leaf), leaf, dy)
        assert _error(grad, want) < 2e-2


def test_act_and_mul_linear_calls_a_watched_or_wrapped_linear_as_it_is(triton_first):
    from torch import nn

    linear = nn.Linear(16, 8, device=DEVICE)
    x0 = torch.randn(4, 32, device=DEVICE)
    dout = torch.randn(4, 8, device=DEVICE)
    seen = []
    handle = linear.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape))
    try:
        hooked = _glu_linear_step(linear, x0, dout, "silu", fused=True)
    finally:
        handle.remove()
    assert seen == [(4, 16)]  # the hook saw the product: the layer was called
    assert (4 * 16, 16) in hooked[4]
    # A frozen input, a trained layer: the product is recomputed for the weight's gradient alone.
    fused = _glu_linear_step(linear, x0, dout, "silu", fused=True, x_grad=False)
    plain = _glu_linear_step(linear, x0, dout, "silu", fused=False, x_grad=False)
    assert fused[1] is None and (4 * 16, 16) not in fused[4]
    torch.testing.assert_close(fused[2], plain[2])
    torch.testing.assert_close(fused[3], plain[3])
    # A frozen layer (LoRA elsewhere): the input's gradient alone, the product not rebuilt.
    linear.requires_grad_(False)
    fused = _glu_linear_step(linear, x0, dout, "silu", fused=True)
    plain = _glu_linear_step(linear, x0, dout, "silu", fused=False)
    assert fused[2] is None and (4 * 16, 16) not in fused[4]
    torch.testing.assert_close(fused[1], plain[1])


def test_the_backward_gives_the_product_only_when_asked(triton_first):
    from transfuse.ops.triton.act_and_mul import silu_and_mul_backward_and_output

    x = torch.randn(3, 64, device=DEVICE)
    dy = torch.randn(3, 32, device=DEVICE)
    with_product, product = silu_and_mul_backward_and_output(dy, x)
    alone, none = silu_and_mul_backward_and_output(dy, x, output=False)
    assert none is None and torch.equal(product, ops.get_op("silu_and_mul")(x))
    assert torch.equal(alone, with_product)


def test_act_and_mul_linear_takes_a_consumable_inputs_gradient_in_place(triton_first):
    from torch import nn

    from transfuse.ops.act_and_mul import CONSUMABLE

    linear = nn.Linear(40, 12, device=DEVICE)
    leaf = torch.randn(6, 80, device=DEVICE, requires_grad=True)
    dout = torch.randn(6, 12, device=DEVICE)
    grads = []
    for consumable in (False, True):
        x = leaf * 1.0
        if consumable:
            setattr(x, CONSUMABLE, True)
        out = ops.act_and_mul_linear(linear, x, "silu")
        (grad,) = torch.autograd.grad(out, x, dout, retain_graph=True)
        grads.append(grad)
        if consumable:
            assert torch.equal(x.detach(), grad)  # written over the input
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(out, x, dout)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
