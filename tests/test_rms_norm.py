"""The RMSNorm fusion: real transformers models, every written form, refusals, rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transfuse
from tests import toys
from transfuse.ops import RMSNorm
from transfuse.tiny import tiny_model

ACCEPTANCE = [
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo2", "granite", "mixtral", "qwen3_moe", "deepseek_v3",
]  # fmt: skip


def _norm_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and not isinstance(m, RMSNorm)]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type", ACCEPTANCE)
def test_every_rmsnorm_of_real_models_is_replaced_and_logits_match(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    paths = _norm_paths(model)
    assert paths
    assert transfuse.rewrite(model, fusions=["rms_norm"]) is model
    after = _logits(model, ids)
    assert (after - before).abs().max().item() <= 1e-5
    report = transfuse.report(model)
    assert sorted(f.path for f in report.fusions if f.kind == "rms_norm") == sorted(paths)
    assert all(isinstance(model.get_submodule(p), RMSNorm) for p in paths)
    assert not any(s.kind == "rms_norm" for s in report.skipped), report


@pytest.mark.parametrize("model_type", ["llama", "gemma", "olmo2", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_of_each_variant_is_reproduced_exactly_in_low_precision(model_type, dtype):
    """Llama casts before the weight, Gemma adds 1 in float32 and casts last, OLMo 2 casts last:
    in bf16 and fp16 the fused model's logits are bit-identical only if each cast is where the model has it."""
    model = tiny_model(model_type, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids)
    transfuse.rewrite(model, fusions=["rms_norm"])
    assert transfuse.report(model).counts()["rms_norm"] == len(_norm_paths(tiny_model(model_type)))
    assert torch.equal(_logits(model, ids), before)


def test_state_dict_keys_and_weights_are_unchanged_and_shared():
    model = tiny_model("llama")
    weight = model.model.norm.weight
    keys = {k: v.shape for k, v in model.state_dict().items()}
    transfuse.rewrite(model)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    assert model.model.norm.weight is weight  # the same Parameter, no copy


def _assert_as_before(after, before, dtype):
    """float32 within 1e-6 (summation order); in 16 bits bit for bit (the rounding reproduced)."""
    if dtype == torch.float32:
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    else:
        assert torch.equal(after, before)


FUSING_TOYS = [
    (toys.LlamaStyleNorm, (32,)),
    (toys.GemmaStyleNorm, (32,)),
    (toys.SquareRsqrtPowNorm, (32,)),
    (toys.OperatorSpellingNorm, ()),
    (toys.PowOperatorNorm, (32,)),
    (toys.DecoratedNorm, (32,)),
    (nn.RMSNorm, (32,)),
]


@pytest.mark.parametrize("cls, args", FUSING_TOYS, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_written_form_fuses_with_equal_numbers(cls, args, dtype):
    torch.manual_seed(0)
    norm = cls(*args, eps=1e-5) if cls is nn.RMSNorm else cls(*args)
    if cls is nn.RMSNorm:
        nn.init.normal_(norm.weight)
    model = toys.TinyNormModel(norm).to(dtype)
    x = torch.randn(3, 7, 32, dtype=dtype)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert isinstance(model.norm, RMSNorm), transfuse.report(model)
    with torch.no_grad():
        after = model(x)
    _assert_as_before(after, before, dtype)


REFUSED_TOYS = [
    (toys.LayerNormMath(32), "rms_norm.mean-subtracted"),
    (toys.TrailingComputeNorm(32), "rms_norm.trailing-compute"),
    (toys.WrongDimNorm(), "rms_norm.reduce-dim"),
    (toys.LiteralEpsNorm(), "rms_norm.eps-source"),
    (toys.BufferEpsNorm(), "rms_norm.eps-source"),
    (toys.HelperShapeBranchNorm(32), "rms_norm.control-flow"),
]  # toys.BranchingRMSNorm's `if self.skip` is decided per instance: tests/test_rms_norm_branches.py


@pytest.mark.parametrize("norm, tag", REFUSED_TOYS, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else v)
def test_non_rms_norms_are_refused_with_a_reason(norm, tag):
    model = toys.TinyNormModel(norm)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert model.norm is norm
    (skip,) = [s for s in transfuse.report(model).skipped if s.cls == type(norm).__name__]
    assert skip.tag == tag and skip.kind == "rms_norm" and skip.reason
    assert skip.where and ".py:" in skip.where
    with torch.no_grad():
        assert torch.equal(model(x), before)


class _GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = toys.GatedRMSNorm(32)

    def forward(self, x):
        return self.norm(x, x.flip(-1))


def test_a_norm_gated_before_it_is_refused():
    model = _GatedModel()
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 4, 32),))
    assert isinstance(model.norm, toys.GatedRMSNorm)
    (skip,) = transfuse.report(model).skipped
    assert skip.tag == "rms_norm.inputs" and "two" in skip.reason and "before the norm" in skip.reason


class _GateAfterModel(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.norm = norm

    def forward(self, x):
        h, gate = self.inp(x).chunk(2, dim=-1)
        return self.norm(h, gate=gate)  # the gate by keyword, as some callers pass it


GATED = [(toys.NormThenGate, "silu"), (toys.Float32NormThenSigmoidGate, "sigmoid"), (toys.UnweightedNormThenGate, "gelu")]


@pytest.mark.parametrize("cls, activation", GATED, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_gated_after_it_fuses_into_one_op_with_equal_numbers(cls, activation, dtype):
    from transfuse.ops import GatedRMSNorm

    torch.manual_seed(0)
    model = _GateAfterModel(cls(32)).to(dtype)
    x = torch.randn(3, 7, 32, dtype=dtype)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert isinstance(model.norm, GatedRMSNorm) and model.norm.activation == activation, transfuse.report(model)
    with torch.no_grad():
        after = model(x)
    _assert_as_before(after, before, dtype)
    # Under autograd the native definition runs: the gradients are stock's.
    stock = _GateAfterModel(cls(32)).to(dtype)
    stock.load_state_dict(model.state_dict())
    for m in (model, stock):
        m(x).float().pow(2).sum().backward()
    for name, p in stock.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, msg=name)


class _PositionalGateModel(_GateAfterModel):
    def forward(self, x):
        return self.norm(*self.inp(x).chunk(2, dim=-1))


def test_a_gated_norm_takes_a_gate_that_broadcasts_as_the_models_product_does():
    from transfuse.ops import GatedRMSNorm, RMSNormSpec

    torch.manual_seed(0)
    norm, x, gate = toys.NormThenGate(32), torch.randn(3, 7, 32), torch.randn(3, 1, 32)
    fused = GatedRMSNorm(norm.weight, norm.variance_epsilon, RMSNormSpec(), activation="silu")
    with torch.no_grad():
        torch.testing.assert_close(fused(x, gate), norm(x, gate), rtol=0, atol=1e-6)


def test_a_gated_norm_whose_inputs_keyword_callers_could_not_name_is_refused():
    model = _PositionalGateModel(toys.GateNamedZ(32))
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 4, 32),))
    (skip,) = transfuse.report(model).skipped
    assert skip.tag == "rms_norm.inputs" and "(x, z)" in skip.reason


def test_eps_is_read_per_instance():
    class TwoNorms(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = toys.LlamaStyleNorm(16, eps=1e-6)
            self.b = toys.LlamaStyleNorm(16, eps=0.5)

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = TwoNorms()
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert (model.a.eps, model.b.eps) == (1e-6, 0.5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_unmatched_rmsnorm_class_is_listed_with_its_reason():
    class LooksLikeRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.eps = 1e-6

        def forward(self, x):
            return x / (x.abs().mean(-1, keepdim=True) + self.eps)

    model = toys.TinyNormModel(LooksLikeRMSNorm())
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 32),))
    (skip,) = transfuse.report(model).skipped
    assert skip.cls == "LooksLikeRMSNorm" and skip.tag.startswith("rms_norm.")


@pytest.mark.parametrize("model_type", ["llama", "mamba2"])
def test_the_fused_norm_answers_to_the_original_epsilon_and_keeps_the_modules_numbers(model_type):
    """Code outside a norm reads its attributes (Mamba-2's CUDA path hands ``norm.variance_epsilon``
    and ``norm.weight`` to its own kernel): the fused layer has them, and a changed epsilon changes
    its answer as it changes the original's."""
    torch.manual_seed(0)
    stock = tiny_model(model_type).eval()
    fused = transfuse.rewrite(tiny_model(model_type).eval())
    pairs = [
        (name, module, dict(fused.named_modules())[name])
        for name, module in stock.named_modules()
        if hasattr(module, "variance_epsilon") and isinstance(dict(fused.named_modules())[name], RMSNorm)
    ]
    assert pairs, "no fused norm with the original's epsilon name"
    for name, original, layer in pairs:
        for key, value in vars(original).items():
            if not key.startswith("_") and type(value) in (int, float, bool, str):
                assert getattr(layer, key) == value, f"{name}.{key}"
        assert layer.weight is not None and layer.weight.shape == original.weight.shape
    ids = torch.randint(0, stock.config.vocab_size, (2, 9))
    for _, original, layer in pairs:
        original.variance_epsilon = layer.variance_epsilon = 0.5
        assert layer.eps == 0.5
    with torch.no_grad():
        changed = fused(ids).logits
        torch.testing.assert_close(changed, stock(ids).logits, rtol=1e-5, atol=1e-5)
        for _, original, layer in pairs:
            original.variance_epsilon = layer.variance_epsilon = 1e-6
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(changed, fused(ids).logits)  # the epsilon mattered
