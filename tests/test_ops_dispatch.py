"""Dispatch: priority, overrides, autograd rule, tracing of provider choice, and the rms_norm op."""

from __future__ import annotations

import itertools

import pytest
import torch

from transfuse import ops
from transfuse.ops import RMSNormSpec, rms_norm, rms_norm_native
from transfuse.ops.dispatch import Op, Provider, _load_plugins

SPECS = [RMSNormSpec(*flags) for flags in itertools.product([True, False], repeat=5)]


@pytest.fixture
def scratch_op():
    """A throwaway op with two extra providers, removed afterwards."""
    name = "scratch_double"
    op = Op(name, lambda x: x * 2)
    op.register(Provider("fast", lambda x: x * 2 + 0, supports_args=lambda x: x.dim() == 2))
    op.register(Provider("other", lambda x: x + x))
    yield op
    from transfuse.ops import dispatch

    dispatch._OPS.pop(name)
    dispatch._USER_PRIORITY.pop(name, None)


def _provider_for(op, *args):
    with ops.trace() as log:
        op(*args)
    return log[-1].provider


def test_priority_order_native_last_and_argument_checks(scratch_op):
    ops.set_priority(["fast", "other"], op=scratch_op.name)
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "fast"
    assert _provider_for(scratch_op, torch.ones(2, 2, 2)) == "other"  # fast refuses 3-D
    ops.set_priority(["fast"], op=scratch_op.name)
    assert _provider_for(scratch_op, torch.ones(2, 2, 2)) == "native"
    assert [p.name for p in scratch_op.order()] == ["fast", "native"]


def test_a_deferring_provider_runs_only_when_no_later_one_can(scratch_op):
    # "shy" can run any input but prefers to leave 2-D inputs to a later provider.
    scratch_op.register(Provider("shy", lambda x: x * 2, defers=lambda x: x.dim() == 2))
    ops.set_priority(["shy", "fast"], op=scratch_op.name)
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "fast"
    assert _provider_for(scratch_op, torch.ones(2, 2, 2)) == "shy"  # does not defer 3-D
    ops.set_priority(["shy"], op=scratch_op.name)
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "shy"  # nothing after it but native
    ops.set_priority(["shy", "other"], op=scratch_op.name)
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "other"


def test_environment_overrides(scratch_op, monkeypatch):
    monkeypatch.setenv("TRANSFUSE_OP_PRIORITY", f"{scratch_op.name}=other,fast")
    ops.refresh()
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "other"
    monkeypatch.setenv("TRANSFUSE_FORCE_NATIVE", "1")
    ops.refresh()
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "native"
    ops.set_priority(["fast"], op=scratch_op.name)  # Python wins over the environment
    assert _provider_for(scratch_op, torch.ones(2, 2)) == "fast"


def test_malformed_environment_priority_is_a_clear_error(scratch_op, monkeypatch):
    monkeypatch.setenv("TRANSFUSE_OP_PRIORITY", "rms_norm")
    ops.refresh()
    with pytest.raises(ValueError, match="op=provider"):
        scratch_op(torch.ones(2, 2))


def test_provider_without_backward_is_skipped_when_autograd_needs_one(scratch_op):
    ops.set_priority(["fast"], op=scratch_op.name)
    x = torch.ones(2, 2, requires_grad=True)
    assert _provider_for(scratch_op, x) == "native"
    with torch.no_grad():
        assert _provider_for(scratch_op, x) == "fast"
    assert _provider_for(scratch_op, x.detach()) == "fast"


def test_unknown_op_and_duplicate_op_are_errors():
    with pytest.raises(KeyError, match="rms_norm"):
        ops.get_op("no_such_op")
    with pytest.raises(ValueError, match="already defined"):
        Op("rms_norm", lambda x: x)


def test_platform_is_detected_once():
    assert ops.current_platform() is ops.current_platform()
    assert ops.current_platform().name == ("cuda" if torch.cuda.is_available() else "cpu")


def _reference(x, weight, eps, spec):
    """The formula written out in float64 with the spec's casts, as an independent reference."""
    dtype = x.dtype
    h = x.double() if spec.upcast else x
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(torch.float32 if spec.upcast else dtype)
    if spec.cast_before_weight:
        h = h.to(dtype)
    if weight is not None:
        w = weight.float() if spec.weight_fp32 else weight
        h = (1.0 + w if spec.offset else w) * h
    return h.to(dtype) if spec.cast_output else h


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "".join("01"[f] for f in s.flags()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rms_norm_follows_each_spec(spec, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    out = rms_norm_native(x, w, 1e-6, *spec.flags())
    ref = _reference(x, w, 1e-6, spec)
    assert out.dtype == ref.dtype
    tol = 1e-6 if out.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "".join("01"[f] for f in s.flags()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_builtin_is_used_only_where_it_rounds_alike(spec, dtype):
    torch.manual_seed(1)
    x = torch.randn(4, 128, dtype=dtype) * 3
    w = torch.randn(128, dtype=dtype)
    with ops.trace() as log:
        out = rms_norm(x, w, 1e-5, spec)
    native = rms_norm_native(x, w, 1e-5, *spec.flags())
    if log[0].provider == "torch":
        assert torch.equal(out, native), f"F.rms_norm was picked for {spec} but rounds differently"
    else:
        assert log[0].provider == "native"


def test_rms_norm_backward_matches_native():
    torch.manual_seed(2)
    x = torch.randn(3, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    spec = RMSNormSpec()
    rms_norm(x, w, 1e-6, spec).square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    rms_norm_native(x, w, 1e-6, *spec.flags()).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


@pytest.mark.parametrize("mode", ["native", "library"])
def test_rms_norm_layer_compiles_without_graph_breaks(mode):
    torch._dynamo.reset()
    layer = ops.RMSNorm(torch.nn.Parameter(torch.randn(48)), 1e-6, RMSNormSpec(offset=True, cast_output=True))
    x = torch.randn(2, 5, 48)
    ops.set_compile_mode(mode)
    try:
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), layer(x))
    finally:
        ops.set_compile_mode(None)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0


def test_library_op_is_registered_with_a_fake_implementation():
    x = torch.randn(2, 8, device="meta", dtype=torch.bfloat16)
    out = torch.ops.transfuse.rms_norm(x, None, 1e-6, True, True, False, False, False)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == x.shape


def test_plugins_load_once_without_error():
    _load_plugins()
    _load_plugins()


@pytest.mark.parametrize("spec", [RMSNormSpec(), RMSNormSpec(False, False, True, True, True)], ids=["llama", "in-dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_add_rms_norm_is_the_residual_sum_then_rms_norm(spec, dtype):
    torch.manual_seed(3)
    x, residual, w = torch.randn(4, 3, 64, dtype=dtype), torch.randn(4, 3, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    with ops.trace() as log:
        out, new_residual = ops.fused_add_rms_norm(x, residual, w, 1e-6, spec)
    assert log[0].op == "fused_add_rms_norm" and log[0].provider in ("torch", "native")
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(out, rms_norm_native(residual + x, w, 1e-6, *spec.flags()))


def test_fused_add_rms_norm_backward_runs_natively():
    torch.manual_seed(4)
    x, residual, w = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in [(3, 16), (3, 16), (16,)])
    spec = RMSNormSpec(upcast=False, cast_before_weight=False)  # float64 throughout, for gradcheck
    with ops.trace() as log:
        torch.autograd.gradcheck(lambda *a: ops.fused_add_rms_norm(*a, 1e-6, spec), (x, residual, w))
    assert {entry.provider for entry in log} == {"native"}


def test_fused_add_rms_norm_library_op_has_a_fake_implementation():
    x = torch.randn(2, 8, device="meta", dtype=torch.bfloat16)
    out, residual = torch.ops.transfuse.fused_add_rms_norm(x, x, None, 1e-6, True, True, False, False, False)
    assert out.device.type == residual.device.type == "meta"
    assert out.shape == residual.shape == x.shape and out.dtype == residual.dtype == torch.bfloat16


def test_the_cuda_kernels_defer_to_triton_where_the_gpu_time_decides(monkeypatch):
    from transfuse.ops import cuda

    capturing = [False]
    monkeypatch.setattr(cuda, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    few, many = torch.ones(16, 64), torch.ones(4096, 64)
    # Eagerly, few rows are host-bound: the extension runs; many rows: where Triton's kernel is faster.
    assert not cuda._rms_norm_defers(few) and not cuda._fused_add_rms_norm_defers(few)
    assert cuda._rms_norm_defers(many) and cuda._silu_and_mul_defers(many)
    assert not cuda._fused_add_rms_norm_defers(many)  # the extension's fused add is the faster one there
    capturing[0] = True  # in a graph the host cost is paid once: Triton below 2048 rows for all three
    assert cuda._rms_norm_defers(few) and cuda._fused_add_rms_norm_defers(few) and cuda._silu_and_mul_defers(few)
    assert not cuda._fused_add_rms_norm_defers(many)
    monkeypatch.setattr(cuda, "triton_available", lambda: False)
    assert not cuda._rms_norm_defers(many) and not cuda._silu_and_mul_defers(few)
