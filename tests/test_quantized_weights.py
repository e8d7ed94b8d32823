"""Quantized weights (tensor subclasses and quantized linear modules transfuse has no adapter for) never
make a rewrite fail: what can be verified fuses (merged projections too, where a scheme has an adapter), the rest is refused with a reason, and the model's
output stays the quantized stock model's. A module holding weights that cannot be upcast (quanto's
refuse a change of dtype, torchao's keep their own) is judged against its own output, and says so."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import transfuse
from transfuse.rewriter.verify import judge_model
from transfuse.tiny import tiny_model


def _quanto(weights):
    from transformers import QuantoConfig

    return QuantoConfig(weights=weights)


def _torchao_int8():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def _bnb(bits):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=bits == 8, load_in_4bit=bits == 4)


SCHEMES = {
    "quanto-int8": ("optimum.quanto", lambda: _quanto("int8")),
    "quanto-int4": ("optimum.quanto", lambda: _quanto("int4")),
    "torchao-int8": ("torchao", _torchao_int8),
    "bnb-8bit": ("bitsandbytes", lambda: _bnb(8)),
    "bnb-4bit": ("bitsandbytes", lambda: _bnb(4)),
}
# Where the weights are tensor subclasses whose dtype does not change.
NOT_UPCAST = {"quanto-int8", "quanto-int4", "torchao-int8"}
# Where the projections cannot merge in the scheme's storage (``transfuse.ops.quantized``), and why.
UNMERGED = {"quanto-int4": "optimum-quanto: q_proj is optimum-quanto qint4 WeightQBitsTensor: its PackedTensor"}


@pytest.fixture(autouse=True)
def quanto_unpacks_without_its_extension(monkeypatch):
    """optimum-quanto unpacks int4 codes on the CPU with a C++ extension that it compiles on first
    use (a minute or more, in every fresh environment); its own Python definition of that op
    (``quanto::unpack``'s default kernel) gives the same codes, and runs here instead."""
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        return
    import optimum.quanto  # noqa: F401 (registers the op and the extension)
    from optimum.quanto.library.extensions import get_extension

    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    unpack = lambda codes, bits: torch.ops.quanto.unpack.default.redispatch(default, codes, bits)  # noqa: E731
    monkeypatch.setattr(get_extension("quanto_cpp"), "_lib", SimpleNamespace(unpack=unpack))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def _quantized(checkpoint, scheme):
    package, config = SCHEMES[scheme]
    if importlib.util.find_spec(package.partition(".")[0]) is None:
        pytest.skip(f"{package} is not installed")
    return AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config(), device_map="cpu").eval()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_quantized_model_rewrites_fusing_what_it_can_verify(checkpoint, scheme):
    model = _quantized(checkpoint, scheme)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert {"rms_norm", "add_rms_norm", "rotary"} <= set(report.counts()), report
    assert all(s.tag and s.reason for s in report.skipped), report.skipped
    if scheme in UNMERGED:  # refused, naming the scheme and why
        assert {s.kind for s in report.skipped} == {"qkv", "gate_up"}, report.skipped
        assert any(s.reason.startswith(UNMERGED[scheme]) for s in report.skipped), report.skipped
    else:  # merged in the scheme's own storage
        assert report.skipped == [], report.skipped
        assert report.counts()["qkv"] == report.counts()["gate_up"] == 2, report
    with torch.no_grad():
        got = model(ids)
    verdict = judge_model(got, want)
    assert verdict.passed, verdict.reason
    layer = next(f for f in report.fusions if f.kind == "add_rms_norm")
    if scheme in NOT_UPCAST:
        assert "against the original's own output (self_attn.q_proj.weight (" in layer.check, layer.check
    else:
        assert "against a float64 run of the original" in layer.check, layer.check


def test_only_norms_and_rotary_asked_for_on_quanto_weights(checkpoint):
    model = _quantized(checkpoint, "quanto-int8")
    transfuse.rewrite(model, fusions=["rms_norm", "rotary"])
    assert set(transfuse.report(model).counts()) == {"rms_norm", "rotary"}
    assert transfuse.report(model).skipped == []
