"""torch.compile(fullgraph=True) of a module using every op, in both compile modes, runs without
graph breaks and matches eager; in "library" mode the graph holds the ``torch.ops.transfuse`` ops
(traced through their fake implementations), in "native" mode their plain torch code."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from transfuse import ops
from transfuse.ops import RMSNormSpec

LIBRARY_OPS = {"transfuse.rms_norm", "transfuse.fused_add_rms_norm", "transfuse.silu_and_mul", "transfuse.gelu_and_mul"}


class ResidualGatedBlock(nn.Module):
    """Add the residual and normalise (Llama rounding), both gated activations, a zero-centred norm."""

    def __init__(self, width: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(width))
        self.w_out = nn.Parameter(torch.randn(width))

    def forward(self, x, residual):
        h, residual = ops.fused_add_rms_norm(x, residual, self.w_in, 1e-6, RMSNormSpec())
        gate_up = torch.cat([h, h.flip(-1)], dim=-1)
        a = ops.act_and_mul(gate_up, "silu") + ops.act_and_mul(gate_up, "gelu") + ops.act_and_mul(gate_up, "gelu_tanh")
        return ops.rms_norm(a, self.w_out, 1e-6, RMSNormSpec(offset=True, cast_output=True)), residual


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 5, 32), torch.randn(2, 5, 32)


def _call_targets(graphs) -> set[str]:
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


@pytest.fixture
def compile_mode(request):
    torch._dynamo.reset()
    ops.set_compile_mode(request.param)
    yield request.param
    ops.set_compile_mode(None)
    torch._dynamo.reset()


@pytest.mark.parametrize("compile_mode", ["native", "library"], indirect=True)
def test_every_op_compiles_fullgraph_and_matches_eager(compile_mode):
    block, (x, residual) = ResidualGatedBlock(32), _inputs()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, fullgraph=True, backend=recording_backend)
    with torch.no_grad():
        got, expected = compiled(x, residual), block(x, residual)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    targets = _call_targets(graphs)
    if compile_mode == "library":
        assert LIBRARY_OPS <= targets, targets
    else:
        assert not LIBRARY_OPS & targets, targets


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode", ["library"], indirect=True)
def test_library_ops_compile_under_inductor(compile_mode):
    block, (x, residual) = ResidualGatedBlock(32), _inputs()
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        got, expected = compiled(x, residual), block(x, residual)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# Ops whose library op carries a backward of its own (the providers' backward kernels): under
# autograd they stay library calls in library mode; the others inline their native code.
WITH_BACKWARD = {"transfuse.silu_and_mul", "transfuse.gelu_and_mul"}


@pytest.mark.parametrize("backend", ["recording", "aot_eager"])
def test_compiling_with_autograd_calls_only_the_library_ops_with_a_backward(backend):
    torch._dynamo.reset()
    block, (x, residual) = ResidualGatedBlock(32), _inputs()
    x.requires_grad_()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ops.set_compile_mode("library")
    try:
        compiled = torch.compile(block, fullgraph=True, backend=recording_backend if backend == "recording" else backend)
        out, res = compiled(x, residual)
        (out.square().sum() + res.sum()).backward()
    finally:
        ops.set_compile_mode(None)
        torch._dynamo.reset()
    got = (x.grad, block.w_in.grad, block.w_out.grad)
    x.grad = block.w_in.grad = block.w_out.grad = None
    with torch.no_grad():
        want_out, want_res = block(x, residual)
    torch.testing.assert_close(out, want_out)
    out, res = block(x, residual)
    (out.square().sum() + res.sum()).backward()
    for g, w in zip(got, (x.grad, block.w_in.grad, block.w_out.grad)):
        assert g is not None and g.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if backend == "recording":
        targets = _call_targets(graphs)
        assert WITH_BACKWARD <= targets and not (LIBRARY_OPS - WITH_BACKWARD) & targets, targets


def test_compiling_with_autograd_inlines_native_code_by_default_without_backward_kernels():
    """On the CPU (no Triton interpreter) no provider has backward kernels: native code is inlined,
    for Inductor to fuse with its neighbours, as it always is in native mode."""
    torch._dynamo.reset()
    block, (x, residual) = ResidualGatedBlock(32), _inputs()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for mode in (None, "native"):
        ops.set_compile_mode(mode)
        try:
            out, _ = torch.compile(block, fullgraph=True, backend=recording_backend)(x, residual)
            out.sum().backward()
        finally:
            ops.set_compile_mode(None)
            torch._dynamo.reset()
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not LIBRARY_OPS & _call_targets(graphs)
    assert block.w_in.grad is not None and block.w_out.grad is not None


def test_act_and_mul_backward_native_is_autograds_gradient():
    torch.manual_seed(0)
    x, grad = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True), torch.randn(3, 5, 8, dtype=torch.float64)
    for activation, approximate in (("silu", None), ("gelu", "none"), ("gelu_tanh", "tanh")):
        x.grad = None
        ops.act_and_mul(x, activation).backward(grad)
        got = ops.act_and_mul_backward_native(grad, x.detach(), approximate)
        torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-12)


def test_the_default_under_autograd_takes_the_library_op_only_for_plain_tensors(monkeypatch):
    """Where backward kernels run, plain tensors take the library op with its backward; a tensor
    subclass (a DTensor under tensor parallelism) keeps the native code, which it knows how to run."""
    from transfuse.ops import dispatch

    monkeypatch.setattr(dispatch, "_backward_kernels_run_on", lambda op, device: True)

    class Sub(torch.Tensor):
        pass

    plain = torch.randn(2, 8, requires_grad=True)
    sub = torch.randn(2, 8).as_subclass(Sub).requires_grad_()
    assert dispatch.under_compile_use_library_op("silu_and_mul", (plain,), backward=True)
    assert not dispatch.under_compile_use_library_op("silu_and_mul", (sub,), backward=True)
    assert not dispatch.under_compile_use_library_op("silu_and_mul", (plain,))  # no backward of its own
    with torch.no_grad():
        assert not dispatch.under_compile_use_library_op("silu_and_mul", (plain,), backward=True)  # native mode
