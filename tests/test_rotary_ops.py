"""rotary and rotary_one: the native ops against transformers' functions bit for bit (the default
layout against ``apply_rotary_pos_emb``, each other layout against a modeling file written in it), and
the triton providers against native, forward and backward, on odd shapes in float32, float16 and
bfloat16, in every layout; a layout the kernels cannot take runs native, and conformance judges
each layout on its own.

q and k are laid out as a fused attention's are: the transposed head views of column slices of one
merged q/k/v projection (non-contiguous, not dense), with fewer key heads than query heads (GQA).
On a GPU the kernels must be native's bits exactly, forward and backward, and lay their outputs out
with native's strides. Under Triton's CPU interpreter float32 and float16 are still exact (NumPy
rounds to nearest), but a float32 to bfloat16 cast truncates (see ``test_kernels.py``): there the
bfloat16 forward must be bit for bit native's formula with truncating casts at the same points
(which a kernel rounding anywhere else fails), and its gradients are held to ``test_kernels_backward``'s
error factor against a float64 reference; the layouts' tests hold forward and gradients to native
run with every bfloat16 rounding truncated (``_TruncatingBfloat16``), bit for bit. New tensors start
as NaN (``poisoned_allocations``), so an element a kernel never writes cannot pass.

Under the interpreter every launch runs each program in Python, so there the shapes are a covering
subset of the GPU's full product.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from transfuse import ops
from transfuse.fusers.rotary import rotary_layout  # (importing it installs the op's proof)
from transfuse.ops import rotary_native
from transfuse.ops.rotary import FOUR, ONE_SIN_FIRST, table_width

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
    rotary fuser's proof, which importing the fuser installs)."""

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


# ---- the layouts (``RotaryLayout``) and the one-tensor op -----------------------------------------

# Beside the default, each layout parameter at each of its values (the idiom each stands for).
LAYOUTS = {
    "pairs": dict(interleaved=True),
    "pairs, half tables (GPT-J)": dict(interleaved=True, expand="repeat_interleave"),
    "halves, half tables repeated (gpt-oss)": dict(expand="repeat"),
    "pairs, first half widened (Helium)": dict(interleaved=True, expand="repeat_interleave", first_half=True),
    "partial (NeoX, Nemotron)": dict(partial=True),
    "pairs, first half widened, partial (GLM)": dict(interleaved=True, expand="repeat_interleave", first_half=True,
                                                     partial=True),
    "first half, partial": dict(first_half=True, partial=True),
    "pairs in float32 (Cohere)": dict(interleaved=True, upcast=True),
    "halves cast back (OLMo)": dict(cast=True),
}
# (batch, seq, layout, unsqueeze_dim): a decode step of strided heads, a prompt of separate ones, and
# strided heads of another batch, each dimension.
LAYOUT_CASES = [(2, 1, "merged", 1), (1, 5, "separate", 2), (2, 3, "merged", 2)]


def _layout_inputs(layout: dict, b: int, s: int, kind: str, dim: int, dtype):
    """The q/k/v projection's output (HQ, HK and HK heads of 16 channels, 8 of them rotated where the
    layout is partial), cos and sin of the width that layout reads."""
    d = 16
    width = 8 if layout.get("partial") else d
    table = table_width(width, layout.get("expand", "none"), layout.get("first_half", False))
    qkv = torch.randn(b, s, (HQ + 2 * HK) * d, device=DEVICE).to(dtype)
    cos, sin = (torch.randn(b, s, table, device=DEVICE).to(dtype) for _ in range(2))
    return qkv, cos, sin


class _TruncatingBfloat16(TorchDispatchMode):
    """bfloat16 arithmetic as Triton's interpreter does it: each sum or product in float32, then
    truncated to bfloat16 (a cast from float32 too), where PyTorch rounds to nearest. Under it a native
    definition gives what a kernel rounding where it rounds gives under the interpreter."""

    ARITHMETIC = (torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16):
            return out
        if func in self.ARITHMETIC:
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return _truncated(func(*wide, **kwargs))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32:
            return _truncated(args[0])
        return out


def _reference(dtype):
    """Where native's bits are what a kernel must give: as it is, or truncating as the interpreter does."""
    return contextlib.nullcontext() if _rounds_like_torch(dtype) else _TruncatingBfloat16()


def _layout_grads(fn, qkv, cos, sin, grads_out, dim, kind, **layout):
    leaf = qkv.detach().requires_grad_()
    q, k = _qk(leaf, 16, dim, kind)
    torch.autograd.backward(fn(q, k, cos, sin, dim, **layout), grads_out)
    return leaf.grad


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_computes_every_layout_as_native_does_forward_and_backward(triton_first, dtype, name):
    """Both ops, forward and the gradients of q and k, at a decode step and on strided heads, bit for
    bit native's (under the interpreter, bfloat16 against native with its roundings truncated)."""
    layout = LAYOUTS[name]
    for b, s, kind, dim in LAYOUT_CASES:
        what = f"{name} {dtype} B{b} S{s} {kind} dim {dim}"
        qkv, cos, sin = _layout_inputs(layout, b, s, kind, dim, dtype)
        q, k = _qk(qkv, 16, dim, kind)
        with ops.trace() as calls:
            got = ops.get_op("rotary")(q, k, cos, sin, dim, **layout)
            got_one = ops.get_op("rotary_one")(k, cos, sin, dim, **layout)
        assert [c.provider for c in calls] == ["triton", "triton"], f"{what}: {calls}"
        with _reference(dtype):
            want, want_one = ops.rotary_native(q, k, cos, sin, dim, **layout), ops.rotary_one_native(k, cos, sin, dim, **layout)
        grads_out = [torch.randn(w.shape, device=DEVICE).to(dtype) for w in want]
        with ops.trace() as calls:
            grad = _layout_grads(ops.get_op("rotary"), qkv, cos, sin, grads_out, dim, kind, **layout)
        assert [(c.provider, c.grad) for c in calls] == [("triton", True)], f"{what}: {calls}"
        with _reference(dtype):
            grad_want = _layout_grads(ops.rotary_native, qkv, cos, sin, grads_out, dim, kind, **layout)
        for part, g, w in [*zip("qk", got, want), ("one", got_one, want_one), ("grad", grad, grad_want)]:
            assert g.dtype == w.dtype and not g.isnan().any(), f"{what} {part}: dtype, or elements never written"
            assert torch.equal(g, w), f"{what} {part}: off by {(g.double() - w.double()).abs().max()}"


def test_a_layout_the_kernels_cannot_take_runs_native_and_says_so(triton_first):
    """Tables of float32 for tensors of bfloat16 (a model that casts back computes in the wider
    dtype): the kernels take one dtype, so dispatch records native for those calls."""
    qkv, cos, sin = _layout_inputs({"cast": True}, 1, 3, "merged", 1, torch.bfloat16)
    q, k = _qk(qkv, 16, 1, "merged")
    with ops.trace() as calls:
        got = ops.rotary(q, k, cos.float(), sin.float(), cast=True)
        one = ops.rotary_one(q, cos.float(), sin.float(), cast=True)
    assert [(c.op, c.provider) for c in calls] == [("rotary", "native"), ("rotary_one", "native")]
    want = ops.rotary_native(q, k, cos.float(), sin.float(), cast=True)
    assert all(torch.equal(g, w) and g.dtype == torch.bfloat16 for g, w in zip(got, want))
    assert torch.equal(one, want[0])
    with ops.trace() as calls:  # the same layout with one dtype: the kernel
        ops.rotary(q, k, cos, sin, cast=True)
    assert [c.provider for c in calls] == ["triton"]


def test_the_layouts_native_definitions_are_the_modeling_files_functions_bit_for_bit():
    """Each layout against a transformers function written in it (the layout the fuser's proof finds),
    in float32 and bfloat16, on heads transposed out of a projection's output: values and strides."""
    import importlib

    for model in ("cohere", "olmo2", "glm", "helium", "ernie4_5", "phi3", "nemotron", "gptj"):
        function = importlib.import_module(f"transformers.models.{model}.modeling_{model}").apply_rotary_pos_emb
        form = ONE_SIN_FIRST if model == "gptj" else FOUR
        layout = rotary_layout(function, form)
        assert layout is not None, model
        for dtype in (torch.float32, torch.bfloat16):
            qkv, cos, sin = _layout_inputs(layout._asdict(), 2, 5, "merged", layout.unsqueeze_dim, dtype)
            q, k = _qk(qkv, 16, layout.unsqueeze_dim, "merged")
            if form == ONE_SIN_FIRST:
                pairs = [(ops.rotary_one_native(q, cos, sin, *layout), function(q, sin, cos))]
            else:
                pairs = zip(ops.rotary_native(q, k, cos, sin, *layout), function(q, k, cos, sin))
            for g, w in pairs:
                assert torch.equal(g, w) and g.dtype == w.dtype and g.stride() == w.stride(), (model, dtype)


def test_the_conformance_check_judges_each_layout_on_its_own():
    """A provider that computes the default layout whatever it is asked: conformance passes it for
    the default layout and refuses it for interleaved pairs (inputs made in the call's layout), and
    dispatch runs native there."""
    from transfuse.ops import conformance

    def ignores_layout(q, k, cos, sin, unsqueeze_dim=1, *layout):
        return ops.rotary_native(q, k, cos, sin, unsqueeze_dim)

    def ignores_layout_one(x, cos, sin, unsqueeze_dim=1, *layout):
        return ops.rotary_one_native(x, cos, sin, unsqueeze_dim)

    qkv, cos, sin = _layout_inputs({}, 1, 3, "merged", 1, torch.float32)
    q, k = _qk(qkv, 16, 1, "merged")
    ops.register_provider("rotary", "ignores_layout", ignores_layout)
    ops.register_provider("rotary_one", "ignores_layout", ignores_layout_one)
    try:
        with ops.trace() as calls:
            ops.rotary(q, k, cos, sin)
            ops.rotary(q, k, cos, sin, interleaved=True)
            ops.rotary_one(q, cos, sin)
            ops.rotary_one(q, cos, sin, interleaved=True)
    finally:
        ops.unregister_provider("rotary", "ignores_layout")
        ops.unregister_provider("rotary_one", "ignores_layout")
    assert [c.provider for c in calls] == ["ignores_layout", "native", "ignores_layout", "native"]
    assert not conformance.checking()


class _Rope(nn.Module):
    def __init__(self, **layout):
        super().__init__()
        self.layout = layout

    def forward(self, q, k, cos, sin):
        return ops.rotary(q, k, cos, sin, **self.layout), ops.rotary_one(q, cos, sin, **self.layout)


@pytest.mark.parametrize("layout", [{}, LAYOUTS["pairs, first half widened, partial (GLM)"], LAYOUTS["pairs in float32 (Cohere)"]],
                         ids=["default", "glm", "cohere"])  # fmt: skip
@pytest.mark.parametrize("mode", ["native", "library"])
def test_rotary_compiles_fullgraph_in_both_modes(mode, layout):
    torch._dynamo.reset()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    qkv, cos, sin = _layout_inputs(layout, 2, 3, "merged", 1, torch.float32)
    q, k = _qk(qkv, 16, 1, "merged")
    ops.set_compile_mode(mode)
    try:
        with torch.no_grad():
            (got, got_one) = torch.compile(_Rope(**layout), fullgraph=True, backend=recording_backend)(q, k, cos, sin)
    finally:
        ops.set_compile_mode(None)
        torch._dynamo.reset()
    for g, w in zip((*got, got_one), (*rotary_native(q, k, cos, sin, **layout), ops.rotary_one_native(q, cos, sin, **layout))):
        assert torch.equal(g, w)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert ("transfuse.rotary" in targets and "transfuse.rotary_one" in targets) == (mode == "library"), targets
