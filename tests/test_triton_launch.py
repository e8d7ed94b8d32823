"""The fast Triton launch path (``transfuse.ops.triton.launch``): its key, and on a GPU, that a
second call with the same specialisation skips Triton's binding and still computes the same."""

from __future__ import annotations

import pytest
import torch

from transfuse import ops
from transfuse.ops import RMSNormSpec, rms_norm_native, silu_and_mul_native
from transfuse.ops.triton.launch import _arg_key

CUDA = torch.cuda.is_available()


def test_the_key_tells_apart_what_triton_specialises_on():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    aligned, shifted = buffer[:32], buffer[1:33]  # 0 and 2 bytes past a 16-byte boundary
    assert _arg_key(aligned, True, True) != _arg_key(shifted, True, True)
    assert _arg_key(aligned, True, False) == _arg_key(shifted, True, False)  # do_not_specialize_on_alignment
    assert _arg_key(aligned, True, True) != _arg_key(aligned.float(), True, True)  # dtype
    assert len({_arg_key(v, True, True) for v in (1, 16, 17, 32, 2**31, 2**63)}) == 5  # 16 and 32 alike
    assert _arg_key(16, True, True) == _arg_key(32, True, True)
    assert _arg_key(1, False, True) == _arg_key(16, False, True) != _arg_key(2**31, False, True)
    assert _arg_key(True, True, True) == _arg_key(False, True, True) != _arg_key(1, True, True)
    assert _arg_key(0.5, True, True) == _arg_key(3.0, True, True)
    assert _arg_key(None, True, True) is None
    with pytest.raises(TypeError):
        _arg_key("text", True, True)


def test_an_empty_hook_chain_is_no_hook():
    from transfuse.ops.triton.launch import _hook_set

    class Chain:  # newer Triton keeps launch hooks in a chain object that is never None
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_set(None) and not _hook_set(Chain([]))
    assert _hook_set(Chain([print])) and _hook_set(print)


class _CountingJIT:
    """Stands in for a Kernel's jit function and counts the launches that go through Triton."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.fn[grid]


@pytest.fixture
def counted(monkeypatch):
    from transfuse.ops.triton import act_and_mul, rms_norm

    kernels = {}
    for name, kernel in (("rms_norm", rms_norm._rms_norm_kernel), ("act_and_mul", act_and_mul._act_and_mul_kernel)):
        monkeypatch.setattr(kernel, "fn", _CountingJIT(kernel.fn))
        monkeypatch.setattr(kernel, "_compiled", {})
        kernels[name] = kernel
    return kernels


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_repeated_calls_skip_triton_binding_and_match_native(counted):
    torch.manual_seed(0)
    provider = ops.get_op("rms_norm").providers["triton"]
    flags = RMSNormSpec(upcast=True, cast_before_weight=True).flags()
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 1, 7, 7, 7):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        args = (x, weight, 1e-6, *flags)
        torch.testing.assert_close(provider.impl(*args), rms_norm_native(*args), rtol=0, atol=2 ** -6)
    # One Triton launch per specialisation (the row count is not specialised on), the rest direct.
    assert counted["rms_norm"].fn.calls == 1 and len(counted["rms_norm"]._compiled) == 1

    silu = ops.get_op("silu_and_mul").providers["triton"]
    for _ in range(3):
        x = torch.randn(5, 2 * 1024, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(silu.impl(x), silu_and_mul_native(x), rtol=0, atol=2 ** -8)
    assert counted["act_and_mul"].fn.calls == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_misaligned_input_compiles_its_own_specialisation(counted):
    torch.manual_seed(0)
    silu = ops.get_op("silu_and_mul").providers["triton"]
    flat = torch.randn(3 * 2048 + 1, device="cuda", dtype=torch.bfloat16)
    aligned = flat[: 3 * 2048].view(3, 2048)
    shifted = flat[1:].view(3, 2048)  # starts 2 bytes past a 16-byte boundary
    for x in (aligned, shifted, aligned, shifted):
        torch.testing.assert_close(silu.impl(x), silu_and_mul_native(x), rtol=0, atol=2 ** -6)
    assert counted["act_and_mul"].fn.calls == 2 and len(counted["act_and_mul"]._compiled) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_specialisation_first_compiled_inside_a_graph_capture_replays_correctly():
    # In a capture, dispatch prefers Triton, so a kernel's first call may happen there.
    torch.manual_seed(0)
    silu = ops.get_op("silu_and_mul").providers["triton"]
    x = torch.randn(3, 2 * 1544, device="cuda", dtype=torch.bfloat16)  # a width no other test uses
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu.impl(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, silu_and_mul_native(x), rtol=0, atol=2 ** -6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_eager_calls_take_the_cuda_kernels_and_captured_ones_triton():
    from transfuse.ops.cuda.build import extension

    if extension() is None:
        pytest.skip("the CUDA extension did not build here")
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    with ops.trace() as eager:
        ops.rms_norm(x, weight, 1e-6)
        ops.act_and_mul(x, "silu")
    graph = torch.cuda.CUDAGraph()
    with ops.trace() as captured, torch.cuda.graph(graph):
        ops.rms_norm(x, weight, 1e-6)
        ops.act_and_mul(x, "silu")
    assert [e.provider for e in eager] == ["cuda", "cuda"]
    assert [e.provider for e in captured] == ["triton", "triton"]


class _Param:
    def __init__(self, name, constexpr=False, default=None, do_not_specialize=False):
        self.name, self.is_constexpr = name, constexpr
        self.do_not_specialize, self.do_not_specialize_on_alignment = do_not_specialize, False
        self.has_default, self.default = default is not None, default
        self.annotation_type = ""


class _FakeJIT:
    """Triton's JITFunction as the launcher sees it: params, and ``fn[grid](...)`` that compiles
    (here: records the call) and returns the compiled kernel."""

    params = [_Param("x_ptr"), _Param("n", do_not_specialize=True), _Param("stride"), _Param("eps"),
              _Param("BLOCK", constexpr=True), _Param("FLAG", constexpr=True, default=7)]  # fmt: skip

    def __init__(self):
        self.calls, self.runs = [], []
        jit = self

        class Compiled:
            function, packed_metadata = "function", "metadata"

            def run(self, *launch_args):
                jit.runs.append(launch_args)

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled

        return call


def test_the_launcher_reuses_a_compiled_kernel_only_for_the_same_specialisation(monkeypatch):
    from transfuse.ops.triton import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 1234)
    jit = _FakeJIT()
    kernel = launch.Kernel(jit)
    buffer = torch.randn(64)
    x, other_x, shifted = buffer[:16], torch.randn(16), buffer[1:17]

    kernel[(4,)](x, 5, 32, 1e-6, BLOCK=128, num_warps=4)  # compiled through Triton
    kernel[(2, 3)](other_x, 9, 48, 1e-5, BLOCK=128, num_warps=4)  # same specialisation: direct
    assert len(jit.calls) == 1
    assert jit.runs == [(2, 3, 1, 1234, "function", "metadata", None, None, None, other_x, 9, 48, 1e-5, 128, 7)]

    for args, kwargs in [
        ((shifted, 5, 32, 1e-6), {"BLOCK": 128, "num_warps": 4}),  # misaligned pointer
        ((x, 5, 33, 1e-6), {"BLOCK": 128, "num_warps": 4}),  # stride no longer a multiple of 16
        ((x, 5, 1, 1e-6), {"BLOCK": 128, "num_warps": 4}),  # stride 1
        ((x, 5, 32, 1e-6), {"BLOCK": 256, "num_warps": 4}),  # another constexpr
        ((x, 5, 32, 1e-6), {"BLOCK": 128, "num_warps": 8}),  # another launch option
    ]:
        before = len(jit.calls)
        kernel[(1,)](*args, **kwargs)
        assert len(jit.calls) == before + 1, (args, kwargs)
    kernel[(1,)](x, 6, 32, 1e-6, BLOCK=128, num_warps=4)  # n is not specialised on: direct
    assert len(jit.calls) == 6 and len(jit.runs) == 2

    kernel[lambda meta: (1,)](x, 5, 32, 1e-6, BLOCK=128, num_warps=4)  # a callable grid
    kernel[(1,)](x, 5, 32, eps=1e-6, BLOCK=128, num_warps=4)  # a runtime argument by keyword
    kernel[(1,)](x, 5, 32, 1e-6, BLOCK=[128], num_warps=4)  # an unhashable constexpr
    monkeypatch.setattr(launch, "FAST", False)
    kernel[(1,)](x, 5, 32, 1e-6, BLOCK=128, num_warps=4)
    assert len(jit.calls) == 10 and len(jit.runs) == 2
