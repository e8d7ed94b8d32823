"""Every kernel provider (triton, cuda) against the native op: many shapes, three dtypes, every output written.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET=1``); with one, the same tests run them on the GPU, and the CUDA C++
kernels too (marked ``gpu``). New tensors are filled with NaN while these tests run, so an
output element a kernel never writes cannot pass.

Tolerances are per input dtype, the precision the op rounds to: float32 results differ from
native only by summation order (``FLOAT32_TOLERANCE``); float16 and bfloat16 results by at
most ``ULPS`` units in the last place of that dtype (an intermediate rounding and the final
one). Tolerance alone cannot tell whether a kernel rounds where the model rounds (a one-ulp
effect), so where a kernel must reproduce native's rounding, at least ``EXACT_SHARE`` of the
elements must be bit-identical in the input dtype: dropping or adding one rounding step
leaves only 70-85% identical (measured on random data). Two known differences are exempt
from the bit-identity check, and only from it:

* Triton's interpreter casts float32 to bfloat16 by truncation, where GPUs round to nearest
  even (``cast_impl`` in ``triton/runtime/interpreter.py``): bfloat16 under the interpreter.
* PyTorch's CPU ``rsqrt`` of a float16/bfloat16 tensor rounds the square root before the
  reciprocal, so native's in-dtype variant (``upcast=False``) can be one ulp off in rstd.
"""

from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch

from transfuse import ops
from transfuse.ops import (
    RMSNormSpec,
    fused_add_rms_norm_native,
    gated_rms_norm_native,
    gelu_and_mul_native,
    rms_norm_native,
    silu_and_mul_native,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = not CUDA
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

FLOAT32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# Units in the last place allowed: two on a GPU. On CPU four, as CPU rsqrt rounds twice, and
# six in bfloat16, where the interpreter truncates at each of up to four roundings (residual sum,
# normalised value, 1 + weight, product). Elements within ABSOLUTE_FLOOR pass too: gelu of a
# large negative input is a float32 cancellation (1 + erf), as inexact in native as in any
# kernel, on values far below the output's scale.
ULPS = {torch.float16: 4, torch.bfloat16: 6} if INTERPRETED else {torch.float16: 2, torch.bfloat16: 2}
# The in-dtype variant (upcast=False) rounds five times (squares' mean, + eps, rsqrt, product, weight).
IN_DTYPE_EXTRA_ULPS = 2
ABSOLUTE_FLOOR = 2**-14
EXACT_SHARE = 0.95

SPECS = {
    "llama": RMSNormSpec(upcast=True, cast_before_weight=True),
    "gemma": RMSNormSpec(upcast=True, cast_before_weight=False, offset=True, weight_fp32=True, cast_output=True),
    "offset-in-dtype": RMSNormSpec(upcast=True, cast_before_weight=True, offset=True),
    "olmo2": RMSNormSpec(upcast=True, cast_before_weight=False, cast_output=True),
    "builtin": RMSNormSpec(upcast=True, cast_before_weight=False, weight_fp32=True, cast_output=True),
    "in-dtype": RMSNormSpec(upcast=False, cast_before_weight=False),
}
ALL_FLAGS = list(itertools.product([True, False], repeat=5))

# (layout, width): one row; several rows; rows with a gap between them; 3-D input whose
# leading dimensions collapse into rows; 3-D input whose leading dimensions do not (copied).
# "heads": [B, S, heads, D] cut from a wider projection, two levels of rows (Qwen3's q_norm of a
# merged q/k/v); "three-levels": rows that need three strides (the kernels copy them first).
LAYOUTS = ["one-row", "rows", "strided-rows", "3d", "3d-uncollapsible", "heads", "three-levels"]
WIDTHS = [33, 256, 999] + ([4096, 8192] if CUDA else [])
CASES = [(layout, width) for layout in LAYOUTS for width in WIDTHS] + ([("many-rows", 4096)] if CUDA else [])


def _random(shape, dtype, scale=2.0):
    return (torch.randn(shape, device=DEVICE) * scale).to(dtype)


def _input(layout: str, width: int, dtype: torch.dtype) -> torch.Tensor:
    if layout == "one-row":
        return _random((1, width), dtype)
    if layout == "rows":
        return _random((7, width), dtype)
    if layout == "many-rows":
        return _random((2048, width), dtype)
    if layout == "strided-rows":
        return _random((6, width + 24), dtype)[:, :width]
    if layout == "3d":
        return _random((2, 3, width), dtype)
    if layout == "3d-uncollapsible":
        return _random((2, 5, width + 8), dtype)[:, 1:4, :width]
    if layout == "heads":
        return _random((2, 3, 5 * width), dtype)[..., : 4 * width].view(2, 3, 4, width)
    if layout == "three-levels":
        return _random((2, 5, 4, width + 8), dtype)[:, 1:4, 1:3, :width]
    raise ValueError(f"unknown layout {layout!r}")


@pytest.fixture(autouse=True)
def poisoned_allocations():
    """While a test runs, new float tensors (kernel outputs included) start as NaN."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def test_new_outputs_start_as_nan():
    x = torch.ones(3, 8, device=DEVICE, dtype=torch.bfloat16)
    assert x.new_empty(x.shape).isnan().all() and x.new_empty((3, 4), dtype=torch.float32).isnan().all()


def _rounds_like_torch(dtype: torch.dtype) -> bool:
    return not (INTERPRETED and dtype == torch.bfloat16)


def _ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|out - ref| in units in the last place of ``dtype`` at ``ref`` (subnormal spacing below its tiny)."""
    finfo = torch.finfo(dtype)
    _, exponent = torch.frexp(ref.double())  # |ref| = m * 2**exponent with m in [0.5, 1)
    exponent = exponent.clamp(min=round(math.log2(finfo.tiny)) + 1)
    mantissa_bits = -round(math.log2(finfo.eps))
    return (out.double() - ref.double()).abs() / torch.ldexp(
        torch.ones_like(ref, dtype=torch.double), exponent - 1 - mantissa_bits
    )


def _check(out, ref, dtype: torch.dtype, exact: bool, what: str, extra_ulps: int = 0) -> None:
    """``out`` matches ``ref`` to the tolerance of ``dtype``, the op's input dtype; where ``exact``,
    it also rounds as ``ref`` does."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (
        f"{what}: {out.dtype} {out.shape} vs {ref.dtype} {ref.shape}"
    )
    assert not out.isnan().any(), f"{what}: {int(out.isnan().sum())} output elements were never written"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **FLOAT32_TOLERANCE, msg=lambda m: f"{what}: {m}")
        return
    ulps = _ulps(out, ref, dtype)
    allowed = ULPS[dtype] + extra_ulps
    far = (ulps > allowed) & ((out.double() - ref.double()).abs() > ABSOLUTE_FLOOR)
    assert not far.any(), (
        f"{what}: {int(far.sum())} elements are more than {allowed} ulps of {dtype} from native "
        f"(worst {ulps.max().item():.1f}: {out[far][:3].tolist()} against {ref[far][:3].tolist()})"
    )
    if exact and _rounds_like_torch(dtype):
        share = (out.to(dtype) == ref.to(dtype)).float().mean().item()
        assert share >= EXACT_SHARE, f"{what}: only {share:.2%} of the elements round exactly as native"


def _provider(op: str, name: str):
    provider = ops.get_op(op).providers[name]
    assert provider.supported(), f"the {name} provider of {op} is unavailable here"
    return provider


PROVIDERS = ["triton", pytest.param("cuda", marks=pytest.mark.gpu)]
# The CUDA kernels normalise in float32 and keep the weight and output in the input dtype.
CUDA_SPECS = [name for name, spec in SPECS.items() if spec.upcast]


def _spec_cases(provider: str):
    names = CUDA_SPECS if provider == "cuda" else list(SPECS)
    return [(provider, name) for name in names]


PROVIDER_SPECS = [pytest.param(*case, marks=pytest.mark.gpu) for case in _spec_cases("cuda")] + _spec_cases("triton")


@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("provider,spec_name", PROVIDER_SPECS)
def test_rms_norm_matches_native(provider, spec_name, dtype, weighted):
    torch.manual_seed(0)
    kernel = _provider("rms_norm", provider)
    spec = SPECS[spec_name]
    for layout, width in CASES:
        x = _input(layout, width, dtype)
        weight = _random((width,), dtype, scale=1.0) if weighted else None
        args = (x, weight, 1e-6, *spec.flags())
        what = f"{provider} rms_norm {spec_name} {layout} width {width} {dtype}"
        assert kernel.supports_args(*args), f"{what}: refused"
        extra = 0 if spec.upcast else IN_DTYPE_EXTRA_ULPS
        _check(kernel.impl(*args), rms_norm_native(*args), dtype, spec.upcast, what, extra)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rms_norm_every_rounding_variant_and_float32_weight(dtype):
    torch.manual_seed(1)
    kernel = _provider("rms_norm", "triton")
    x = _input("3d", 100, dtype)
    for flags, weight_dtype in itertools.product(ALL_FLAGS, {dtype, torch.float32}):
        args = (x, _random((100,), weight_dtype, scale=1.0), 1e-5, *flags)
        what = f"triton rms_norm flags {flags} {dtype} weight {weight_dtype}"
        assert kernel.supports_args(*args), f"{what}: refused"
        extra = 0 if flags[0] else IN_DTYPE_EXTRA_ULPS
        _check(kernel.impl(*args), rms_norm_native(*args), dtype, flags[0], what, extra)


# The gated norms of linear-attention blocks: qwen3_next's (the norm cast back, a weight in the
# input dtype) and kimi_linear's (everything float32 until the end).
GATED_SPECS = {
    "llama": SPECS["llama"],
    "float32-weight": RMSNormSpec(cast_before_weight=False, weight_fp32=True),
    "cast-output": SPECS["olmo2"],  # the norm rounds to the input dtype last, then the gate
}


@pytest.mark.parametrize("activation", ["silu", "sigmoid", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec_name", GATED_SPECS)
def test_triton_gated_rms_norm_matches_native(spec_name, dtype, activation):
    torch.manual_seed(4)
    kernel = _provider("gated_rms_norm", "triton")
    spec = GATED_SPECS[spec_name]
    for layout, width in CASES:
        x, gate = _input(layout, width, dtype), _input(layout, width, dtype)
        args = (x, gate, _random((width,), dtype, scale=1.0), 1e-6, *spec.flags(), activation)
        what = f"triton gated_rms_norm {spec_name} {activation} {layout} width {width} {dtype}"
        assert kernel.supports_args(*args), f"{what}: refused"
        out = kernel.impl(*args)
        assert out.dtype == dtype and out.shape == x.shape, what
        # One more rounding than the plain norm: the gate's product, cast to the input dtype. Exact
        # rounding is not asked of gelu: 1 + erf of a negative gate cancels in float32 in both.
        _check(out, gated_rms_norm_native(*args), dtype, spec.upcast and "gelu" not in activation, what, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("provider,spec_name", PROVIDER_SPECS)
def test_fused_add_rms_norm_matches_native(provider, spec_name, dtype):
    torch.manual_seed(2)
    kernel = _provider("fused_add_rms_norm", provider)
    spec = SPECS[spec_name]
    for layout, width in CASES:
        x, residual = _input(layout, width, dtype), _input(layout, width, dtype)
        args = (x, residual, _random((width,), dtype, scale=1.0), 1e-6, *spec.flags())
        what = f"{provider} fused_add_rms_norm {spec_name} {layout} width {width} {dtype}"
        assert kernel.supports_args(*args), f"{what}: refused"
        out, new_residual = kernel.impl(*args)
        ref, ref_residual = fused_add_rms_norm_native(*args)
        _check(out, ref, dtype, spec.upcast, what, 0 if spec.upcast else IN_DTYPE_EXTRA_ULPS)
        _check(new_residual, ref_residual, dtype, exact=True, what=f"{what} (residual)")
        if _rounds_like_torch(dtype):
            assert torch.equal(new_residual, ref_residual), f"{what}: residual + x differs from native"


ACT_CASES = [
    ("triton", "silu"),
    ("triton", "gelu"),
    ("triton", "gelu_tanh"),
    pytest.param("cuda", "silu", marks=pytest.mark.gpu),
]


def _act_native_and_args(activation: str, x: torch.Tensor):
    if activation == "silu":
        return "silu_and_mul", silu_and_mul_native, (x,)
    return "gelu_and_mul", gelu_and_mul_native, (x, "tanh" if activation == "gelu_tanh" else "none")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("provider,activation", ACT_CASES)
def test_act_and_mul_matches_native(provider, activation, dtype):
    torch.manual_seed(3)
    for layout, width in CASES:
        x = _input(layout, 2 * width, dtype)
        op, native, args = _act_native_and_args(activation, x)
        kernel = _provider(op, provider)
        what = f"{provider} {activation}_and_mul {layout} width {width} {dtype}"
        assert kernel.supports_args(*args), f"{what}: refused"
        _check(kernel.impl(*args), native(*args), dtype, exact=True, what=what)


@pytest.mark.parametrize("tuning", [{"index_64": True}, {"masked": True}, {"block": 512, "num_warps": 4}],
                         ids=["64-bit offsets", "predicated", "tiny-row launch"])  # fmt: skip
def test_act_and_mul_variants_the_default_launch_leaves_to_large_or_odd_inputs(tuning, monkeypatch):
    """The Triton kernel's compile-time variants that the shapes above may not reach by default: 64-bit
    offsets (taken past 2**31 elements), predicated loads on exact tiles, and the few-row launch on many rows."""
    from transfuse.ops.triton import act_and_mul as triton_act

    monkeypatch.setattr(triton_act, "TUNING", tuning)
    torch.manual_seed(5)
    for layout, width in [("rows", 256), ("strided-rows", 999), ("3d", 256), ("one-row", 33)]:
        x = _input(layout, 2 * width, torch.bfloat16)
        for activation in ("silu", "gelu_tanh"):
            op, native, args = _act_native_and_args(activation, x)
            what = f"triton {activation}_and_mul {tuning} {layout} width {width}"
            _check(_provider(op, "triton").impl(*args), native(*args), torch.bfloat16, exact=True, what=what)


def test_act_and_mul_launch_shapes_fit_the_row_and_follow_the_measured_rule():
    import triton

    from transfuse.ops.triton.act_and_mul import _launch_shape

    for rows, d, size in itertools.product((1, 4, 5, 1024, 1025), (1, 33, 64, 1000, 4096, 14336), (2, 4)):
        block, warps = _launch_shape(rows, d, size)
        assert block <= triton.next_power_of_2(d) and 1 <= warps <= 16, (rows, d, size, block, warps)
        assert warps == 1 or 32 * warps <= block, f"more threads than elements: {(rows, d, size, block, warps)}"
    # The shapes measured fastest on an H200 in bf16 at 4096 wide (triton/act_and_mul.py).
    assert [_launch_shape(rows, 4096, 2) for rows in (1, 16, 256, 4096)] == [(256, 4), (1024, 8), (1024, 8), (4096, 16)]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_dispatch_runs_the_provider_unless_autograd_needs_a_backward(provider):
    x = _input("rows", 64, torch.float16)
    weight = _random((64,), torch.float16)
    ops.set_priority([provider])
    try:
        with ops.trace() as log, ops.conformance.assumed():
            ops.rms_norm(x, weight, 1e-6)
            ops.fused_add_rms_norm(x, x, weight, 1e-6)
            ops.act_and_mul(x, "silu")
            ops.rms_norm(x.requires_grad_(), weight, 1e-6).sum().backward()
    finally:
        ops.set_priority(None)
    # Triton brings its own backward (Provider.autograd); the CUDA kernels have none.
    backward = "triton" if provider == "triton" else "native"
    assert [(entry.provider, entry.grad) for entry in log] == [
        (provider, False), (provider, False), (provider, False), (backward, True),
    ]  # fmt: skip
    assert x.grad is not None and not x.grad.isnan().any()


@pytest.mark.gpu
def test_cuda_extension_builds():
    from transfuse.ops.cuda.build import extension, unavailable_reason

    assert unavailable_reason() is None
    assert extension() is not None


@pytest.mark.gpu
def test_cuda_refuses_what_it_was_not_written_for_and_triton_takes_it():
    x = _input("rows", 4097, torch.bfloat16)  # wider than 4096 and not a multiple of 8: no vector path
    weight = _random((4097,), torch.bfloat16)
    cases = [
        (x, weight, SPECS["llama"]),
        (x[:, :64], weight[:64], SPECS["in-dtype"]),
        (x[:, :64], weight[:64].float(), SPECS["llama"]),
    ]
    for x_case, w_case, spec in cases:
        with ops.trace() as log:
            ops.rms_norm(x_case, w_case, 1e-6, spec)
        assert log[-1].provider == "triton", (tuple(x_case.shape), w_case.dtype, spec)


@pytest.mark.parametrize("programs_per_sm", [None, 1], ids=["a-program-a-block", "looping-programs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_scale_matches_native_bit_for_bit(dtype, programs_per_sm, monkeypatch):
    """The in-place scale of linear_cross_entropy's saved gradients: sizes that end mid-block,
    several programs, a float32 scale for a low-precision tensor (rounded to its dtype first, as
    ``mul_`` rounds it), a scale in the tensor's own dtype, and scales that round to one (which
    leave the tensor as it was). Bit for bit where Triton rounds as torch does."""
    from transfuse.ops.linear_cross_entropy import scale_native

    kernel = _provider("scale_", "triton")
    tuning = importlib.import_module("transfuse.ops.triton.cross_entropy").TUNING
    monkeypatch.setitem(tuning, "scale_block", 256)
    monkeypatch.setitem(tuning, "scale_programs_per_sm", programs_per_sm)  # 1: one program (here) loops over all
    torch.manual_seed(0)
    for shape in [(1,), (255,), (3, 1000), (7, 33, 5)]:
        # One, and one plus a float16 ulp (one in bfloat16): the kernel skips what rounds to one.
        scales = (0.3721, 1 / 41, 1.0, 1 + 2**-10)
        for scale in [torch.tensor(s, device=DEVICE) for s in scales] + [torch.tensor(1 / 41, device=DEVICE).to(dtype)]:
            x = _random(shape, dtype)
            what = f"triton scale_ {shape} {dtype} scale {scale.dtype}"
            assert kernel.supports_args(x, scale), f"{what}: refused"
            got, want = x.clone(), x.clone()
            assert kernel.impl(got, scale) is got, f"{what}: not in place"
            scale_native(want, scale)
            if scale.to(dtype) == 1:
                assert torch.equal(got, x), f"{what}: a scale of one changed x"
            if _rounds_like_torch(dtype):
                assert torch.equal(got, want), f"{what}: {(got.float() - want.float()).abs().max().item()} from native"
            else:  # the interpreter truncates to bfloat16: the scale's and the product's roundings
                assert _ulps(got, want, dtype).max() <= 2, f"{what}: {_ulps(got, want, dtype).max().item()} ulps"
    assert not kernel.supports_args(_random((4, 6), dtype).t(), torch.tensor(0.5, device=DEVICE)), "a strided tensor"


@pytest.mark.parametrize("block", [None, 256], ids=["default-block", "blocks-of-256"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_cross_entropy_grad_matches_native(dtype, block, monkeypatch):
    """Losses, and the logits overwritten by their gradient, on odd vocabularies (several blocks
    a row), rows with a gap between them and ignored rows: no tolerance floor, gradients are small."""
    from transfuse.ops.linear_cross_entropy import cross_entropy_grad_native

    kernel = _provider("cross_entropy_grad", "triton")
    if block is not None:
        monkeypatch.setitem(importlib.import_module("transfuse.ops.triton.cross_entropy").TUNING, "block", block)
    torch.manual_seed(0)
    for vocab, strided in [(33, False), (999, True), (5000, False)]:
        logits = _random((7, vocab + (24 if strided else 0)), dtype, scale=3.0)[:, :vocab]
        targets = torch.randint(0, vocab, (7,), device=DEVICE)
        targets[2] = -100
        scale = torch.tensor(0.7, device=DEVICE)
        what = f"triton cross_entropy_grad vocab {vocab} {dtype}"
        assert kernel.supports_args(logits, targets, scale, -100), f"{what}: refused"
        got_grad, want_grad = logits.clone(), logits.clone()
        got = kernel.impl(got_grad, targets, scale, -100)
        want = cross_entropy_grad_native(want_grad, targets, scale, -100)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} losses: {m}")
        assert got[2] == 0 and not got_grad[2].any(), f"{what}: an ignored row has a loss or a gradient"
        if dtype == torch.float32:
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-8, msg=lambda m: f"{what}: {m}")
            continue
        ulps = _ulps(got_grad, want_grad, dtype)
        assert ulps.max() <= ULPS[dtype], f"{what}: {ulps.max().item():.1f} ulps from native"
        if _rounds_like_torch(dtype):
            share = (got_grad == want_grad).float().mean().item()
            assert share >= EXACT_SHARE, f"{what}: only {share:.2%} of the gradients round exactly as native"


def test_row_levels_reads_heads_of_a_wider_projection_in_place_and_gives_up_beyond_two_levels():
    from transfuse.ops.triton.rms_norm import row_levels

    width = 8
    heads = torch.zeros(2, 3, 5 * width)[..., : 4 * width].view(2, 3, 4, width)
    assert row_levels(heads) == (4, 5 * width, width)  # row r: (r // 4) * 40 + (r % 4) * 8
    assert row_levels(torch.zeros(6, width)) == (1, width, width)
    assert row_levels(torch.zeros(6, width + 2)[:, :width]) == (1, width + 2, width + 2)
    assert row_levels(torch.zeros(2, 3, width)) == (1, width, width)  # collapses to one level
    assert row_levels(torch.zeros(1, 1, width)) == (1, width, width)
    assert row_levels(torch.zeros(2, 5, 4, width + 2)[:, 1:4, 1:3, :width]) is None
    assert row_levels(torch.zeros(width, 3).t()) is None  # the last dimension strided
    for x in (heads, torch.zeros(2, 5, width + 2)[:, 1:4, :width]):
        inner, outer, row = row_levels(x)
        starts = [(r // inner) * outer + (r % inner) * row for r in range(x.numel() // width)]
        rows = itertools.product(*map(range, x.shape[:-1]))  # where each row starts, from x's own strides
        assert starts == [(x[idx].data_ptr() - x.data_ptr()) // x.element_size() for idx in rows]
