"""rewrite() and report(): in place, idempotent, filtered, verified with undo, on meta models."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import transfuse
from tests import toys
from transfuse.fusers import RMSNormFuser
from transfuse.ops import RMSNorm
from transfuse.rewriter.apply import rewrite_model
from transfuse.rewriter.fusion import Fused
from transfuse.tiny import tiny_config, tiny_model


def test_rewrite_is_in_place_and_a_second_rewrite_changes_nothing():
    model = tiny_model("llama")
    assert transfuse.rewrite(model) is model
    first = transfuse.report(model)
    modules = dict(model.named_modules())
    transfuse.rewrite(model)
    second = transfuse.report(model)
    assert dict(model.named_modules()) == modules
    assert second.fusions == first.fusions


def test_fusions_filter_and_unknown_kind():
    model = tiny_model("llama")
    transfuse.rewrite(model, fusions=[])
    assert transfuse.report(model).fusions == []
    with pytest.raises(ValueError, match=r"Unknown fusion kind\(s\) 'rmsnorm'; the kinds are: rms_norm"):
        transfuse.rewrite(model, fusions=["rmsnorm"])
    with pytest.raises(TypeError, match="list of kind names"):
        transfuse.rewrite(model, fusions="rms_norm")


def test_report_of_a_model_never_rewritten_is_an_error():
    with pytest.raises(ValueError, match="has not been rewritten"):
        transfuse.report(tiny_model("llama"))


def test_model_without_vocabulary_needs_example_inputs():
    model = toys.TinyNormModel(toys.LlamaStyleNorm(32))
    with pytest.warns(UserWarning, match="example_inputs"):
        transfuse.rewrite(model)
    assert transfuse.report(model).fusions == []
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 3, 32),))
    assert transfuse.report(model).counts() == {"rms_norm": 1}


def test_report_table_lists_fusions_and_refusals():
    model = tiny_model("cohere")
    transfuse.rewrite(model)
    text = str(transfuse.report(model))
    assert "refused" in text and "CohereLayerNorm" in text and "rms_norm.mean-subtracted" in text


class _OffByOnePercent(RMSNormFuser):
    """A deliberately wrong fusion: the right match, a fused layer that scales by 1.01."""

    def fuse(self, module, found):
        fused = super().fuse(module, found)
        wrong = _Scaled(fused.replacement)
        return Fused(fused.replaced, "Scaled", replacement=wrong)


class _Scaled(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.01


def test_verification_undoes_a_fusion_whose_numbers_differ():
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = rewrite_model(model, [_OffByOnePercent()])
    assert report.fusions == []
    assert len(report.skipped) == 5 and {s.tag for s in report.skipped} == {"verify.mismatch"}
    assert all("less accurate than the original" in s.reason for s in report.skipped)
    assert all(s.path for s in report.skipped)
    assert not any(isinstance(m, (_Scaled, RMSNorm)) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_without_verification_a_wrong_fusion_stays():
    model = tiny_model("llama")
    report = rewrite_model(model, [_OffByOnePercent()], verify=False)
    assert len(report.fusions) == 5


def test_training_flags_survive_the_probe():
    model = tiny_model("llama").train()
    transfuse.rewrite(model)
    assert model.training and model.model.layers[0].training


def test_meta_device_model_rewrites_quickly_without_verification():
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", num_hidden_layers=32, hidden_size=1024, intermediate_size=2816, num_attention_heads=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    start = time.perf_counter()
    transfuse.rewrite(model)
    elapsed = time.perf_counter() - start
    report = transfuse.report(model)
    assert report.counts() == {"rms_norm": 65, "add_rms_norm": 32, "qkv": 32, "gate_up": 32, "rotary": 32}
    assert any("meta device" in n for n in report.notes)
    assert elapsed < 30  # about 1 s on 2 CPU cores; generous for slow CI machines


@pytest.mark.parametrize("training", [True, False], ids=["layers-train", "layers-eval"])
def test_modules_a_fusion_creates_take_the_training_flag_of_what_they_fuse_into(training):
    from transfuse.ops import MoE

    model = tiny_model("qwen3_moe").train()
    for layer in model.model.layers:
        layer.train(training)  # the root stays in training mode: only the flags of the layers count
    transfuse.rewrite(model)
    fused = [m for m in model.modules() if isinstance(m, MoE)]
    assert fused, transfuse.report(model)
    assert model.training
    for layer in model.model.layers:
        assert [m for m in layer.modules() if m.training != training] == []


def test_a_rewritten_model_is_freed_when_dropped():
    """Analyses are cached per class; they must not keep the instance they traced (and its weights) alive."""
    import gc
    import weakref

    model = tiny_model("qwen3_moe")
    transfuse.rewrite(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_composite_models_probe_takes_its_text_vocabulary():
    """gemma3's vocabulary is in text_config: the probe is its token ids (the vision tower, which
    token ids never reach, is refused as not reached, its attention's projections too)."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    model = tiny_model("gemma3", text_config=text, vision_config=vision)
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.not_rewritten is None and {"rms_norm", "qkv", "gate_up"} <= set(report.counts())
    assert all(s.tag.startswith(("verify.not-reached", "moe.", "qkv.not-reached")) for s in report.skipped), report


def test_a_model_without_get_input_embeddings_is_probed_from_its_config():
    model = tiny_model("llama")

    def not_implemented():
        raise NotImplementedError

    model.get_input_embeddings = not_implemented  # as remote code that never implemented it
    transfuse.rewrite(model)
    assert transfuse.report(model).counts() == {"rms_norm": 5, "add_rms_norm": 2, "qkv": 2, "gate_up": 2, "rotary": 2}


class _NoVocabularyAnywhere(nn.Module):
    """Remote code at its barest: a config without ``vocab_size`` (nor a text config) and a
    ``get_input_embeddings`` that was never implemented. The token embeddings are only found
    among the modules."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = SimpleNamespace(hidden_size=inner.config.hidden_size)

    def get_input_embeddings(self):
        raise NotImplementedError

    def forward(self, input_ids, labels=None):
        return self.inner(input_ids=input_ids, labels=labels, use_cache=False).logits


def test_a_model_without_vocabulary_on_config_or_get_input_embeddings_is_probed_from_its_modules():
    from transfuse.rewriter.capture import make_probe

    model = _NoVocabularyAnywhere(tiny_model("llama"))
    with pytest.raises(NotImplementedError):
        model.get_input_embeddings()
    assert not hasattr(model.config, "vocab_size")
    probe = make_probe(model)  # the vocabulary of the nn.Embedding the model holds
    assert probe.kwargs["input_ids"].max().item() >= 128 and probe.kwargs["input_ids"].max().item() < 256
    transfuse.rewrite(model)
    assert transfuse.report(model).counts() == {"rms_norm": 5, "add_rms_norm": 2, "qkv": 2, "gate_up": 2, "rotary": 2}
    stock = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_the_drop_in_loads_and_rewrites_a_model_whose_class_lacks_get_input_embeddings(model_type, tmp_path, monkeypatch):
    import warnings

    from transformers import AutoModelForCausalLM

    saved = tiny_model(model_type)
    saved.save_pretrained(tmp_path)

    def not_implemented(self):
        raise NotImplementedError  # as remote code that never implemented it

    monkeypatch.setattr(type(saved), "get_input_embeddings", not_implemented)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(NotImplementedError):
        stock.get_input_embeddings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = transfuse.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not [w for w in caught if "transfuse" in str(w.message)], [str(w.message) for w in caught]
    kinds = set(transfuse.report(model).counts())
    assert {"rms_norm", "qkv"} <= kinds and ("moe" in kinds) == (model_type == "qwen3_moe")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
