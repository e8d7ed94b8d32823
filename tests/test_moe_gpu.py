"""The Triton fused MoE on a CUDA GPU, at the sizes models use: against the native op (both paths,
every layout, float32 fitted to shared memory), every kernel configuration, and real
transformers blocks in bf16. Needs a GPU: elsewhere these tests
are skipped (the same kernels are covered under the interpreter by test_moe_ops.py)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import transfuse
from transfuse.ops import ExpertsSpec, MoE, RoutingSpec, moe_experts_native, moe_route_native
from transfuse.ops.triton import moe_configs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from transfuse.ops.triton import moe as triton_moe

# Qwen3-30B-A3B's expert shapes: hidden 2048, 128 experts, top-8, expert intermediate 768.
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _poison_allocator() -> None:
    """Fill the caching allocator's free memory with NaN, so that an unwritten output shows."""
    block = torch.empty(1 << 28, dtype=torch.float32, device="cuda").fill_(float("nan"))
    del block


def _case(tokens: int, dtype, spec: ExpertsSpec, bias: bool = False, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") * 0.02).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") * 0.02).to(dtype)
    if spec.w13_transposed:
        w13 = w13.transpose(1, 2).contiguous()
    if spec.w2_transposed:
        w2 = w2.transpose(1, 2).contiguous()
    b13 = (torch.randn(EXPERTS, 2 * INTER, generator=g, device="cuda") * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(EXPERTS, HIDDEN, generator=g, device="cuda") * 0.1).to(dtype) if bias else None
    logits = torch.randn(tokens, EXPERTS, generator=g, device="cuda")
    weights, ids = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return x, weights.to(dtype), ids, w13, w2, b13, b2


SPECS = [
    (ExpertsSpec("silu"), False),
    (ExpertsSpec("clamped_swiglu", interleaved=True, w13_transposed=True, w2_transposed=True), True),
]
# Largest error over the reference's largest magnitude, per dtype.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _check(tokens, dtype, spec, bias, config=None):
    args = _case(tokens, dtype, spec, bias)
    want = moe_experts_native(*args, *spec.flags(), 1.702, 7.0)
    _poison_allocator()
    with moe_configs.using_config(config) if config is not None else contextlib.nullcontext():
        got = triton_moe.moe_experts(*args, *spec.flags(), 1.702, 7.0)
    assert not got.isnan().any()
    assert _relative_error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("tokens", [1, 8, 16, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec, bias", SPECS, ids=["silu", "gpt-oss"])
def test_triton_experts_equal_native_at_model_sizes(tokens, dtype, spec, bias):
    _check(tokens, dtype, spec, bias)


def test_the_shared_memory_limit_is_read_from_the_device():
    limit = moe_configs.shared_memory_limit(torch.cuda.current_device())
    assert limit != moe_configs.FALLBACK_SHARED_MEMORY and limit >= 64 * 1024


@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_float32_experts_fit_the_shared_memory_and_equal_native(tokens):
    """float32 tiles take twice the shared memory of bf16 ones: fitted, they compile and agree."""
    _check(tokens, torch.float32, ExpertsSpec("silu"), False)


# Every layout the decode path reads: halves or interleaved, [E, 2I, H] or [E, H, 2I], w2 either way.
DECODE_LAYOUTS = [
    (ExpertsSpec("silu"), False),
    (ExpertsSpec("silu", interleaved=True), True),
    (ExpertsSpec("gelu", gate_first=False, w13_transposed=True), True),
    (ExpertsSpec("gelu_tanh", w2_transposed=True), False),
    (ExpertsSpec("clamped_swiglu", interleaved=True, w13_transposed=True, w2_transposed=True), True),
]


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec, bias", DECODE_LAYOUTS, ids=lambda v: v.describe() if isinstance(v, ExpertsSpec) else "")
def test_decode_path_equals_native_in_every_layout(tokens, dtype, spec, bias):
    assert moe_configs.regime(tokens, TOP_K, EXPERTS) == "decode"
    _check(tokens, dtype, spec, bias)


def _sweep_configs(kind) -> list:
    candidates = {c for configs in moe_configs.TUNING_CANDIDATES.values() for c in configs}
    return sorted((c for c in candidates | set(moe_configs.CONFIGS.values()) if isinstance(c, kind)), key=str)


@pytest.mark.parametrize(
    "tokens, kind", [(5, moe_configs.DecodeConfig), (16, moe_configs.MoEConfig), (512, moe_configs.MoEConfig)]
)
def test_every_kernel_configuration_compiles_and_agrees(tokens, kind):
    """Each configuration the defaults or the benchmark's sweep may pick fits the GPU and is correct."""
    spec = ExpertsSpec("silu")
    args = _case(tokens, torch.bfloat16, spec)
    want = moe_experts_native(*args, *spec.flags(), 1.0, 7.0)
    failures = []
    for config in _sweep_configs(kind):
        with moe_configs.using_config(config):
            got = triton_moe.moe_experts(*args, *spec.flags(), 1.0, 7.0)
        if _relative_error(got, want) > 1e-2:
            failures.append(config.describe())
    assert not failures


ROUTINGS = [
    (RoutingSpec("softmax", renormalize=True), {}),
    (RoutingSpec("topk_softmax", float32=False), {}),
    (RoutingSpec("topk_sigmoid"), {}),
    (RoutingSpec("sigmoid", correction_bias=True, grouped=True, renormalize=True, scaled=True),
     dict(n_group=8, topk_group=4, renorm_eps=1e-20, scale=2.5)),
]  # fmt: skip


@pytest.mark.parametrize("spec, numbers", ROUTINGS, ids=lambda v: v.describe() if isinstance(v, RoutingSpec) else "")
def test_triton_routing_equals_native_at_model_sizes(spec, numbers):
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(4096, EXPERTS, generator=g, device="cuda")
    bias = torch.randn(EXPERTS, generator=g, device="cuda") * 0.1 if spec.correction_bias else None
    args = (logits, bias, TOP_K, spec.scoring, spec.float32, spec.grouped, numbers.get("n_group", 1),
            numbers.get("topk_group", 1), spec.renormalize, numbers.get("renorm_eps"), None, numbers.get("scale"), None)  # fmt: skip
    want_w, want_ids = moe_route_native(*args)
    got_w, got_ids = triton_moe.moe_route(*args)
    same = (got_ids.sort(-1)[0] == want_ids.sort(-1)[0]).all(-1)
    assert same.float().mean().item() >= 0.999  # near-ties may break either way
    order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
    torch.testing.assert_close(
        got_w.gather(1, order_got)[same], want_w.gather(1, order_want)[same], rtol=1e-4, atol=1e-5
    )


FAMILIES = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "mixtral", "granitemoe"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fused_models_match_in_bf16_on_the_gpu_with_the_triton_kernels(model_type):
    """The fused bf16 model is at least about as close to a float64 copy of itself as transformers'
    own bf16 computation is (both round differently; neither is the truth)."""
    from transfuse.tiny import tiny_model

    model = tiny_model(model_type, dtype=torch.bfloat16).cuda()
    exact = copy.deepcopy(model).double()  # bf16 weights are exact in float64
    for module in exact.modules():  # the eager experts loop: grouped_mm has no float64
        if getattr(module, "config", None) is not None:
            module.config._experts_implementation = "eager"
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        reference = exact(input_ids=ids).logits
        before = model(input_ids=ids).logits
    transfuse.rewrite(model, fusions=["moe"])
    assert transfuse.report(model).counts().get("moe", 0) >= 1, transfuse.report(model)
    with torch.no_grad(), transfuse.ops.trace() as calls:
        after = model(input_ids=ids).logits
    assert {c.provider for c in calls if c.op.startswith("moe_")} == {"triton"}
    assert _relative_error(after, reference) <= 1.5 * _relative_error(before, reference) + 1e-3


def test_qwen3_shaped_block_matches_transformers():
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    exact = copy.deepcopy(block).double()
    holder = torch.nn.Sequential(block)
    x = torch.randn(1, 256, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = exact(x.double())
        want = block(x)
    transfuse.rewrite(holder, example_inputs=(x,), fusions=["moe"])
    assert isinstance(holder[0], MoE), transfuse.report(holder)
    with torch.no_grad():
        got = holder[0](x)
    # As close to float64 as transformers' own bf16 block is, give or take rounding.
    assert _relative_error(got, reference) <= 1.5 * _relative_error(want, reference) + 1e-3

@pytest.mark.parametrize("tokens", [5, 48, 300])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_in_halves_at_small_widths(tokens, weights_dtype):
    """minimax_m3's experts: gate and up as halves of an [E, 2I, H] tensor, the clamped SwiGLU,
    float32 routing weights, hidden 64 and intermediate 128 (its tiny config), every configuration."""
    g = torch.Generator(device="cuda").manual_seed(3)
    spec, experts, hidden, inter, top_k = ExpertsSpec("clamped_swiglu"), 8, 64, 128, 2
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") * 0.2).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") * 0.2).bfloat16()
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g, device="cuda").sigmoid(), top_k, dim=-1)
    args = (x, weights.to(weights_dtype), ids, w13, w2, None, None, *spec.flags(), 1.702, 7.0)
    want = moe_experts_native(*args)
    failures = {}
    for config in [None, *_sweep_configs(moe_configs.DecodeConfig), *_sweep_configs(moe_configs.MoEConfig)]:
        if config is None:
            got = triton_moe.moe_experts(*args)
        else:
            with moe_configs.using_config(config):
                got = triton_moe.moe_experts(*args)
        error = _relative_error(got, want)
        if error > 2e-2:
            failures[config.describe() if config is not None else "default"] = round(error, 4)
    assert not failures, failures
