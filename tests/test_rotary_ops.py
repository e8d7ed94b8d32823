"""rotary: the native op against transformers' ``apply_rotary_pos_emb`` bit for bit, and the triton
provider against native, forward and backward, on odd shapes in float32, float16 and bfloat16.

q and k are laid out as a fused attention's are: the transposed head views of column slices of one
merged q/k/v projection (non-contiguous, not dense), with fewer key heads than query heads (GQA).
On a GPU the kernels must be native's bits exactly, forward and backward, and lay their outputs out
with native's strides. Under Triton's CPU interpreter float32 and float16 are still exact (NumPy
rounds to nearest), but a float32 to bfloat16 cast truncates (see ``test_kernels.py``): there the
bfloat16 forward must be bit for bit native's formula with truncating casts at the same points
(which a kernel rounding anywhere else fails), and its gradients are held to ``test_kernels_backward``'s
error factor against a float64 reference. New tensors start as NaN (``poisoned_allocations``), so an
element a kernel never writes cannot pass.

Under the interpreter every launch runs each program in Python, so there the shapes are a covering
subset of the GPU's full product.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import transfuse.fusers  # noqa: F401 - installs the proof the op checks ``original`` with
from transfuse import ops
from transfuse.ops import rotary_native

from .test_kernels import DEVICE, DTYPES, INTERPRETED, _rounds_like_torch, poisoned_allocations  # noqa: F401
from .test_kernels_backward import _error, _factor, _floor, seeded, triton_first  # noqa: F401 (fixtures)

HQ, HK = 4, 2
DIMS = [1, 2]
# (batch, seq, cos batch, head_dim, layout): every combination on a GPU; under the interpreter a
# subset that still has each batch, length, cos batch, width and layout.
_FULL = [
    (b, s, cb, d, layout)
    for b, s, d, layout in itertools.product([1, 2], [1, 7], [8, 64, 128], ["merged", "separate"])
    for cb in sorted({1, b})
]
_INTERPRETED = [
    (1, 1, 1, 8, "merged"),
    (2, 7, 2, 64, "merged"),
    (1, 7, 1, 128, "merged"),
    (2, 1, 2, 128, "merged"),
    (2, 7, 1, 8, "separate"),
    (2, 1, 1, 64, "separate"),
    (1, 7, 1, 64, "separate"),
    (2, 7, 2, 128, "separate"),
]
# On a GPU also a long sequence, which takes blocks of several positions.
CASES = _INTERPRETED if INTERPRETED else [*_FULL, (1, 2048, 1, 128, "merged"), (2, 300, 2, 64, "separate")]
BACKWARD_CASES = _INTERPRETED[:5] if INTERPRETED else CASES


def _heads(qkv: torch.Tensor, start: int, heads: int, d: int, dim: int) -> torch.Tensor:
    """Heads ``start:start + heads`` of a ``[B, S, heads * d]`` projection, as ``[B, H, S, D]`` (dim 1)
    or ``[B, S, H, D]`` (dim 2): a view."""
    b, s, _ = qkv.shape
    x = qkv[..., start * d : (start + heads) * d].view(b, s, heads, d)
    return x.transpose(1, 2) if dim == 1 else x


def _qk(source: torch.Tensor, d: int, dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k from ``source`` (``[B, S, (HQ + 2 HK) d]``): slices of it ("merged", as a merged
    projection's), or each head view over its own tensor ("separate", as separate projections')."""
    if layout == "merged":
        return _heads(source, 0, HQ, d, dim), _heads(source, HQ, HK, d, dim)
    q_part, k_part = source[..., : HQ * d].contiguous(), source[..., HQ * d : (HQ + HK) * d].contiguous()
    return _heads(q_part, 0, HQ, d, dim), _heads(k_part, 0, HK, d, dim)


def _inputs(b, s, cb, d, dtype):
    qkv = torch.randn(b, s, (HQ + 2 * HK) * d, device=DEVICE).to(dtype)
    cos = torch.randn(cb, s, d, device=DEVICE).to(dtype)
    sin = torch.randn(cb, s, d, device=DEVICE).to(dtype)
    return qkv, cos, sin


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """float32 to bfloat16 by truncation, as Triton's interpreter casts (finite values)."""
    return (x.float().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _truncating_native(q, k, cos, sin, dim):
    """Native's formula with its roundings to bfloat16 done by truncation: what a kernel that
    rounds where native rounds gives under the interpreter."""
    cos, sin = cos.unsqueeze(dim).float(), sin.unsqueeze(dim).float()

    def one(x):
        x = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return _truncated(_truncated(x * cos).float() + _truncated(rotated * sin).float())

    return one(q), one(k)


def _case_id(case) -> str:
    b, s, cb, d, layout = case
    return f"B{b}-S{s}-cos{cb}-D{d}-{layout}"


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_is_transformers_apply_rotary_pos_emb_bit_for_bit(dtype, dim):
    for b, s, cb, d, layout in [(2, 7, 2, 64, "merged"), (1, 5, 1, 128, "separate"), (2, 3, 1, 8, "merged")]:
        qkv, cos, sin = _inputs(b, s, cb, d, dtype)
        q, k = _qk(qkv, d, dim, layout)
        got, want = rotary_native(q, k, cos, sin, dim), apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and g.stride() == w.stride(), (dtype, dim, b, s, d, layout)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rotary_matches_native(triton_first, dtype, dim):
    provider = ops.get_op("rotary").providers["triton"]
    assert provider.supported()
    for case in CASES:
        b, s, cb, d, layout = case
        qkv, cos, sin = _inputs(b, s, cb, d, dtype)
        q, k = _qk(qkv, d, dim, layout)
        what = f"rotary {dtype} dim {dim} {_case_id(case)}"
        assert provider.supports_args(q, k, cos, sin, dim), f"{what}: refused"
        with ops.trace() as calls:
            got = ops.rotary(q, k, cos, sin, dim)
        assert [c.provider for c in calls] == ["triton"], f"{what}: {calls}"
        want = rotary_native(q, k, cos, sin, dim)
        exact = want if _rounds_like_torch(dtype) else _truncating_native(q, k, cos, sin, dim)
        for name, g, w, e in zip("qk", got, want, exact):
            assert g.stride() == w.stride(), f"{what} {name}: strides {g.stride()}, native's {w.stride()}"
            assert not g.isnan().any(), f"{what} {name}: elements never written"
            assert torch.equal(g, e), f"{what} {name}: not native's bits (off by {(g.double() - e.double()).abs().max()})"


# Launch variants the default shapes do not reach on small inputs: blocks of several positions
# (taken beyond a few hundred rows), with a partial last block; forced predicates; one head a block;
# 64-bit offsets (taken past 2**31 elements); a half width that is no power of two.
TUNINGS = [
    ({"block_s": 4}, 7, 64),
    ({"block_s": 2}, 8, 64),
    ({"block_s": 4, "masked": True}, 8, 8),
    ({"block_h": 1}, 3, 64),
    ({"index_64": True}, 3, 16),
    ({}, 5, 24),
]


@pytest.mark.parametrize("tuning,seq,d", TUNINGS, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_triton_rotary_launch_variants_forward_and_backward(triton_first, tuning, seq, d):
    from transfuse.ops.triton import rotary as kernels

    dtype = torch.float16  # exact under the interpreter too
    qkv, cos, sin = _inputs(2, seq, 2, d, dtype)
    q, k = _qk(qkv, d, 1, "merged")
    grads_out = [torch.randn(2, HQ, seq, d, device=DEVICE), torch.randn(2, HK, seq, d, device=DEVICE)]
    kernels.TUNING.update(tuning)
    try:
        got = kernels.rotary(q, k, cos, sin, 1)
        got_grads = _grads(ops.rotary, qkv, cos, sin, grads_out, dtype, d, 1, "merged")
    finally:
        kernels.TUNING.clear()
    for g, w in zip(got, rotary_native(q, k, cos, sin, 1)):
        assert torch.equal(g, w) and g.stride() == w.stride()
    for g, w in zip(got_grads, _grads(rotary_native, qkv, cos, sin, grads_out, dtype, d, 1, "merged")):
        assert torch.equal(g, w)


def _grads(fn, qkv, cos, sin, grads_out, dtype, d, dim, layout):
    """The gradient of the q and k columns of the projection ``qkv`` (in ``dtype``), through ``fn``."""
    leaf = qkv.detach().to(dtype).requires_grad_()
    q, k = _qk(leaf, d, dim, layout)
    outs = fn(q, k, cos.to(dtype), sin.to(dtype), dim)
    torch.autograd.backward(outs, [g.to(dtype) for g in grads_out])
    grad = leaf.grad
    return grad[..., : HQ * d], grad[..., HQ * d : (HQ + HK) * d]


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rotary_backward_matches_native(triton_first, dtype, dim):
    for case in BACKWARD_CASES:
        b, s, cb, d, layout = case
        qkv, cos, sin = _inputs(b, s, cb, d, dtype)
        shape_q, shape_k = ((b, HQ, s, d), (b, HK, s, d)) if dim == 1 else ((b, s, HQ, d), (b, s, HK, d))
        grads_out = [torch.randn(shape_q, device=DEVICE), torch.randn(shape_k, device=DEVICE)]
        what = f"rotary backward {dtype} dim {dim} {_case_id(case)}"
        with ops.trace() as calls:
            got = _grads(ops.rotary, qkv, cos, sin, grads_out, dtype, d, dim, layout)
        assert [(c.provider, c.grad) for c in calls] == [("triton", True)], f"{what}: {calls}"
        want = _grads(rotary_native, qkv, cos, sin, grads_out, dtype, d, dim, layout)
        exact = _grads(rotary_native, qkv.double(), cos.double(), sin.double(), grads_out, torch.float64, d, dim, layout)
        for name, g, w, r in zip("qk", got, want, exact):
            assert not g.isnan().any(), f"{what} {name}: gradient elements never written"
            if _rounds_like_torch(dtype):
                assert torch.equal(g, w), f"{what} {name}: not native autograd's bits"
            limit = _factor(dtype) * _error(w, r) + _floor(dtype)
            assert _error(g, r) <= limit, f"{what} {name}: {_error(g, r):.3g} against native's {_error(w, r):.3g}"


def test_an_unused_output_gives_its_input_no_gradient(triton_first):
    qkv, cos, sin = _inputs(1, 3, 1, 8, torch.float32)
    q, k = (t.detach().requires_grad_() for t in _qk(qkv, 8, 1, "merged"))
    with ops.trace() as calls:
        q_embed, _ = ops.rotary(q, k, cos, sin)
    q_embed.sum().backward()
    assert calls[-1].provider == "triton"
    assert k.grad is None and q.grad is not None


def test_cos_with_a_gradient_falls_back_to_native(triton_first):
    qkv, cos, sin = _inputs(1, 3, 1, 8, torch.float32)
    q, k = _qk(qkv, 8, 1, "merged")
    cos.requires_grad_()
    with ops.trace() as calls:
        q_embed, k_embed = ops.rotary(q, k, cos, sin)
    assert [(c.provider, c.grad) for c in calls] == [("native", True)]
    (q_embed.sum() + k_embed.sum()).backward()
    assert cos.grad is not None
    with torch.no_grad(), ops.trace() as calls:  # no gradient to compute: the kernel may run
        ops.rotary(q, k, cos, sin)
    assert calls[-1].provider == "triton"


def test_arguments_the_kernel_refuses(triton_first):
    provider = ops.get_op("rotary").providers["triton"]
    qkv, cos, sin = _inputs(2, 3, 1, 8, torch.float32)
    q, k = _qk(qkv, 8, 1, "merged")
    assert provider.supports_args(q, k, cos, sin, 1)
    refused = {
        "2-D cos": (q, k, cos[0], sin[0], 1),
        "mixed dtypes": (q, k, cos.double(), sin.double(), 1),
        "another unsqueeze_dim": (q, k, cos, sin, 0),
        "cos of another batch": (q, k, cos.expand(3, -1, -1), sin.expand(3, -1, -1), 1),
        "odd head_dim": (q[..., :7], k[..., :7], cos[..., :7], sin[..., :7], 1),
        "strided head_dim": (q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2], 1),
        "k of another length": (q, k[:, :, :2], cos, sin, 1),
    }
    for what, args in refused.items():
        assert not provider.supports_args(*args), what


class _Rope(nn.Module):
    def forward(self, q, k, cos, sin):
        return ops.rotary(q, k, cos, sin)


@pytest.mark.parametrize("mode", ["native", "library"])
def test_rotary_compiles_fullgraph_in_both_modes(mode):
    torch._dynamo.reset()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    qkv, cos, sin = _inputs(2, 3, 1, 8, torch.float32)
    q, k = _qk(qkv, 8, 1, "merged")
    ops.set_compile_mode(mode, "rotary")
    try:
        with torch.no_grad():
            got = torch.compile(_Rope(), fullgraph=True, backend=recording_backend)(q, k, cos, sin)
    finally:
        ops.set_compile_mode(None, "rotary")
        torch._dynamo.reset()
    for g, w in zip(got, rotary_native(q, k, cos, sin)):
        assert torch.equal(g, w)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert ("transfuse.rotary" in targets) == (mode == "library"), targets


def test_rotary_backward_native_is_autograds_gradient():
    torch.manual_seed(0)
    qkv, cos, sin = _inputs(2, 5, 1, 8, torch.float64)
    for dim in (1, 2):
        q, k = (t.detach().requires_grad_() for t in _qk(qkv, 8, dim, "merged"))
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        out_q, out_k = rotary_native(q, k, cos, sin, dim)
        torch.autograd.backward((out_q, out_k), (gq, gk))
        got = ops.rotary_backward_native(gq, gk, cos, sin, dim)
        torch.testing.assert_close(got[0], q.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], k.grad, rtol=1e-12, atol=1e-12)


class _RopeOf(nn.Module):
    """The rewritten forward's call: the model's own function passed as ``original`` (proved by the
    rotary fuser's proof, which importing the fusers installs)."""

    def forward(self, q, k, cos, sin):
        return ops.rotary(q, k, cos, sin, original=apply_rotary_pos_emb)


@pytest.mark.parametrize("backend", ["recording", "aot_eager"])
def test_rotary_compiled_with_autograd_in_library_mode_calls_the_op_and_its_backward(backend):
    """Under autograd in library mode, the library op runs with its registered backward (the
    providers' backward kernel), also for a call that names the model's function; the gradients
    of q and k (slices of one merged projection) are native autograd's."""
    torch._dynamo.reset()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    qkv, cos, sin = _inputs(2, 3, 1, 8, torch.float32)
    qkv.requires_grad_()
    ops.set_compile_mode("library", "rotary")
    try:
        compiled = torch.compile(_RopeOf(), fullgraph=True, backend=recording_backend if backend == "recording" else backend)
        q, k = _qk(qkv, 8, 1, "merged")
        out_q, out_k = compiled(q, k, cos, sin)
        (out_q.square().sum() + (out_k * 3).sum()).backward()
    finally:
        ops.set_compile_mode(None, "rotary")
        torch._dynamo.reset()
    got, qkv.grad = qkv.grad, None
    q, k = _qk(qkv, 8, 1, "merged")
    want_q, want_k = rotary_native(q, k, cos, sin)
    torch.testing.assert_close(out_q, want_q)
    (want_q.square().sum() + (want_k * 3).sum()).backward()
    torch.testing.assert_close(got, qkv.grad, rtol=1e-6, atol=1e-6)
    assert got[..., (HQ + HK) * 8 :].abs().sum() == 0 and got[..., : HQ * 8].abs().sum() > 0
    if backend == "recording":
        targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
        assert "transfuse.rotary" in targets, targets
