"""Mixture-of-experts blocks over block-FP8 experts (transformers' ``FP8Experts``: stacked e4m3
``gate_up_proj``/``down_proj`` with one float32 scale per block), fused into ``moe_experts_fp8``.

transformers has FP8 kernels on CUDA only (and dequantises FP8 checkpoints on a CPU), so these tests
build the FP8 modules directly and run the stock ones with transformers' ``fp8_linear`` computing
what transformers computes where it dequantises: ``F.linear`` with the weight times its blocks' scales
(``_dequantize_fp8_weight``). The fused op dequantises per block at run time too, never keeping a copy."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import transfuse
from transfuse.ops.moe import ExpertsSpec, moe_experts_fp8
from transfuse.ops.quantized.fp8_blocks import quantize_blocks
from transfuse.tiny import tiny_model

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def dequantised(weight, weight_scale_inv, block_size, dtype) -> torch.Tensor:
    """FP8 weights as transformers dequantises them: each weight times its block's scale, in ``dtype``."""
    weight, scale = weight.to(dtype), weight_scale_inv.to(dtype)
    if block_size is not None:
        rows, cols = weight.shape[-2:]
        scale = scale.repeat_interleave(block_size[0], -2)[..., :rows, :].repeat_interleave(block_size[1], -1)[..., :cols]
    return weight * scale


def _dequantised_linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None, *args, **kwargs):
    """``fp8_linear`` on dequantised weights (the options of its kernels, ``allow_deepgemm``, aside)."""
    out = F.linear(input, dequantised(weight, weight_scale_inv, block_size, input.dtype))
    return out + bias if bias is not None else out


@pytest.fixture
def dequantising_fp8(monkeypatch):
    """transformers' FP8 layers and experts computing as transformers computes FP8 weights it dequantises."""
    monkeypatch.setattr(fp8, "fp8_linear", _dequantised_linear)


def fp8_model(model, block=(32, 32)):
    """``model`` with transformers' FP8 layers and experts in place of its linear layers and experts (the
    replacement transformers makes for a fine-grained FP8 checkpoint), holding its weights quantized."""
    from transformers import FineGrainedFP8Config

    weights = {k: v.clone() for k, v in model.state_dict().items()}
    config = FineGrainedFP8Config(weight_block_size=block, modules_to_not_convert=["lm_head"])
    fp8.replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=config)
    for name, module in model.named_modules():
        if isinstance(module, fp8.FP8Linear):
            pairs = [("weight", "weight_scale_inv")]
        elif isinstance(module, fp8.FP8Experts):
            pairs = [("gate_up_proj", "gate_up_proj_scale_inv"), ("down_proj", "down_proj_scale_inv")]
        else:
            continue
        for tensor, scale in pairs:
            q, s = quantize_blocks(weights[f"{name}.{tensor}"], block)
            setattr(module, tensor, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, scale, torch.nn.Parameter(s, requires_grad=False))
    # transformers' FP8 experts loop over the experts as written: its grouped and batched forms are CUDA kernels
    model.config._experts_implementation = "eager"
    return model


def _experts(hidden=64, intermediate=32, experts=8, block=(32, 32)):
    config = tiny_model("qwen3_moe").config
    config.hidden_size, config.moe_intermediate_size, config.num_experts = hidden, intermediate, experts
    module = fp8.FP8Experts(config, block_size=block)
    generator = torch.Generator().manual_seed(0)
    for tensor, shape in (("gate_up_proj", (experts, 2 * intermediate, hidden)), ("down_proj", (experts, hidden, intermediate))):
        q, s = quantize_blocks(torch.randn(shape, generator=generator), block)
        setattr(module, tensor, torch.nn.Parameter(q, requires_grad=False))
        setattr(module, f"{tensor}_scale_inv", torch.nn.Parameter(s * (1 + torch.rand(s.shape, generator=generator)), requires_grad=False))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 32, 8, (32, 32)), (96, 48, 6, (32, 64))], ids=["whole-blocks", "ragged-blocks"])
def test_fp8_experts_op_computes_what_transformers_fp8_experts_compute(dequantising_fp8, dtype, shape):
    hidden, intermediate, experts, block = shape
    module = _experts(hidden, intermediate, experts, block)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(11, hidden, generator=generator).to(dtype)
    ids = torch.rand(11, experts, generator=generator).topk(2, dim=-1).indices
    ids[:, 0] = ids[:, 0].clamp(max=experts - 2)  # an expert no token reaches
    ids[ids == experts - 1] = 0
    weights = torch.rand(11, 2, generator=generator).softmax(-1).to(dtype)
    with torch.no_grad():
        want = module(x, ids, weights)
        got = moe_experts_fp8(
            x, weights, ids, module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj,
            module.down_proj_scale_inv, block, ExpertsSpec("silu"),
        )  # fmt: skip
    assert got.dtype == want.dtype and got.abs().max() > 0
    # Each expert's rows the same F.linear on the same dequantised weight; the k outputs of a token
    # summed in another order (the stock loop adds them into float32 zeros one expert at a time).
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


def test_fp8_experts_op_refuses_scales_that_are_not_per_block():
    module = _experts()
    x, ids, weights = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2) / 2
    with pytest.raises(ValueError, match=r"not one scale per 64x32 block"):
        moe_experts_fp8(x, weights, ids, module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj,
                        module.down_proj_scale_inv, (64, 32))  # fmt: skip


def test_a_qwen3_moe_block_over_fp8_experts_is_fused_into_the_fp8_experts_op(dequantising_fp8):
    from transfuse.ops.moe_layer import MoE

    stock, model = (fp8_model(tiny_model("qwen3_moe")) for _ in range(2))
    model.load_state_dict(stock.state_dict())
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(2))
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.counts().get("moe") == model.config.num_hidden_layers, report
    block = model.model.layers[0].mlp
    assert isinstance(block, MoE) and block.plan.experts.w13_scale == "experts.gate_up_proj_scale_inv"
    experts = block.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn  # the FP8 experts themselves, not a copy
    with torch.no_grad():
        want = stock(ids).logits
        got = model(ids).logits
    assert got.abs().max() > 0
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert list(model.state_dict()) == list(stock.state_dict())
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)
               for a, b in zip(model.state_dict().values(), stock.state_dict().values()))


# Under Triton's interpreter (no GPU) bfloat16 casts truncate (a consistent scale error of a few percent
# through the kernels' roundings), so there the kernels are checked in float32 and float16; on a GPU in bfloat16 too.
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 32, 8, (32, 32), 1), (96, 48, 6, (32, 64), 5)], ids=["decode", "ragged-blocks"])
def test_the_triton_fp8_experts_compute_the_native_definition(dtype, shape):
    triton_fp8 = pytest.importorskip("transfuse.ops.triton.moe_fp8", reason="triton is part of the dev dependencies")
    from transfuse.ops.moe import moe_experts_fp8_native

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, intermediate, experts, block, tokens = shape
    module = _experts(hidden, intermediate, experts, block)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    ids = torch.rand(tokens, experts, generator=generator).topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=generator).softmax(-1).to(dtype)
    args = [x, weights, ids, module.gate_up_proj.data, module.gate_up_proj_scale_inv.data, module.down_proj.data,
            module.down_proj_scale_inv.data, *block, "silu", False, True, 1.0, float("inf")]  # fmt: skip
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    want = moe_experts_fp8_native(*args)
    got = triton_fp8.moe_experts_fp8(*args)
    assert got.dtype == want.dtype and want.abs().max() > 0
    # the same roundings; the products summed in another order (float32 accumulators)
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


def test_fp8_experts_with_static_activation_scales_are_refused_with_the_reason(dequantising_fp8):
    model = fp8_model(tiny_model("qwen3_moe"))
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.activation_scheme = "static"  # one input scale per expert and projection, as static checkpoints hold
        experts.gate_up_proj_activation_scale = torch.nn.Parameter(torch.ones(experts.num_experts))
        experts.down_proj_activation_scale = torch.nn.Parameter(torch.ones(experts.num_experts))
    transfuse.rewrite(model)
    report = transfuse.report(model)
    refused = [s for s in report.skipped if s.kind == "moe"]
    assert "moe" not in report.counts() and refused, report
    assert {s.tag for s in refused} == {"moe.quantized"}
    # (from the trace, where the projection is seen taking a scale, or from the instance check, where the
    # class's trace was made on an instance with dynamic scales)
    assert all(re.search(r"static (per-expert )?activation scale", s.reason) for s in refused), refused
