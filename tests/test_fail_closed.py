"""Fail closed: a fusion is exact (as accurate as the original, in every dtype) or refused with a
reason. Each test here reproduces a way a fusion could be wrong and checks that it is refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import transfuse
from tests import toys
from transfuse.ops import get_op, register_provider, set_priority, unregister_provider
from transfuse.rewriter import apply as apply_module
from transfuse.rewriter import checking
from transfuse.rewriter.capture import ProbeUnavailable
from transfuse.rewriter.fusion import Fuser
from transfuse.rewriter.tracer import trace_module
from transfuse.rewriter.verify import judge_model
from transfuse.tiny import tiny_config, tiny_model

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The op a wrong provider replaces, the fusion kind whose modules call it, and a family that has it.
WRONG = [("rms_norm", "rms_norm", "llama"), ("silu_and_mul", "gate_up", "llama"), ("moe_experts", "moe", "qwen3_moe")]


@pytest.fixture
def wrong_provider():
    """Registers a provider that returns native times ``scale`` and gives it top priority."""
    chosen = []

    def install(op: str, scale: float) -> None:
        native = get_op(op).native.impl
        register_provider(op, "wrong", lambda *a, **k: native(*a, **k) * scale, differentiable=True)
        set_priority(["wrong"], op=op)
        chosen.append(op)

    yield install
    for op in chosen:
        set_priority(None, op=op)
        unregister_provider(op, "wrong")


def _ids(model, seq=8, seed=1):
    return torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seed))


# ---- a wrong kernel is caught in every dtype ---------------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("scale", [1.01, 1.003], ids=["1%", "0.3%"])
@pytest.mark.parametrize("op,kind,model_type", WRONG, ids=[w[0] for w in WRONG])
def test_a_slightly_wrong_kernel_is_caught(wrong_provider, op, kind, model_type, scale, dtype, device):
    """Judged against the op's native definition before it runs: refused, and the fusion made with
    the next provider."""
    model = tiny_model(model_type, dtype=dtype).to(device)
    ids = _ids(model).to(device)
    with torch.no_grad():
        before = model(ids).logits
    wrong_provider(op, scale)
    transfuse.rewrite(model)
    report = transfuse.report(model)
    caught = [v for v in report.providers if v.op == op and v.provider == "wrong"]
    assert caught and not any(v.passed for v in caught) and all(v.tag == "verify.provider" for v in caught)
    assert kind in report.counts()
    with transfuse.ops.trace() as calls, torch.no_grad():
        after = model(ids).logits
    assert {c.provider for c in calls if c.op == op} and "wrong" not in {c.provider for c in calls}
    if device == "cpu":
        assert torch.equal(after, before)  # on the CPU every other fusion is bit-identical
    else:
        assert judge_model(after, before).passed  # on a GPU the other fusions' kernels round their own way


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_honest_fusions_pass_in_every_dtype(dtype, device):
    """The rule is no stricter than rounding: the same models fuse everything in every dtype (on a
    GPU through the Triton and CUDA kernels, which round unlike native)."""
    expected = {
        "llama": {"rms_norm", "add_rms_norm", "qkv", "gate_up", "rotary"},
        "gemma2": {"rms_norm", "add_rms_norm", "qkv", "gate_up", "rotary"},
        "qwen3_moe": {"rms_norm", "add_rms_norm", "qkv", "moe", "rotary"},
        "gpt_oss": {"rms_norm", "add_rms_norm", "qkv", "moe"},
    }
    for model_type, kinds in expected.items():
        model = tiny_model(model_type, dtype=dtype).to(device)
        transfuse.rewrite(model)
        report = transfuse.report(model)
        assert not [s for s in report.skipped if s.tag.startswith("verify.")], report
        assert set(report.counts()) == kinds
        assert all("against a float" in f.check for f in report.fusions), [f.check for f in report.fusions]


# ---- a probe that cannot run means no fusion --------------------------------------------


def _fused_modules(model):
    return [m for m in model.modules() if transfuse.rewriter.apply.is_fused(m)]


def test_example_inputs_of_the_wrong_type_are_an_error():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="not str"):
        transfuse.rewrite(model, example_inputs="hello")
    assert _fused_modules(model) == []


def test_example_inputs_the_model_rejects_raise_and_change_nothing():
    model = tiny_model("llama")
    with pytest.raises(transfuse.ExampleInputsError, match=r"rejected example_inputs.*input_ids"):
        transfuse.rewrite(model, example_inputs={"input_idz": torch.zeros(1, 4, dtype=torch.long)})
    assert _fused_modules(model) == []


def test_a_default_probe_that_cannot_run_leaves_the_model_unchanged():
    model = toys.TinyNormModel(toys.LlamaStyleNorm(32))  # no config.vocab_size: no probe can be made
    with pytest.warns(UserWarning, match="was not rewritten"):
        transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.fusions == [] and _fused_modules(model) == []
    assert "example_inputs" in report.not_rewritten and "not rewritten" in str(report)


class _FussyLlama(nn.Module):
    """A causal LM whose loss rejects the token ids as labels, and whose forward builds a cache
    it cannot serve unless told ``use_cache=False`` (which it takes through ``**kwargs`` only)."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_model("llama")
        self.config = self.inner.config

    def forward(self, input_ids, labels=None, **kwargs):
        if labels is not None:
            raise ValueError("labels must count the image tokens")
        if kwargs.get("use_cache", True):
            raise ValueError("this layout has no attention cache")
        return self.inner(input_ids=input_ids, use_cache=False)


def test_a_made_probe_the_model_rejects_is_retried_simpler_and_said_so():
    model = _FussyLlama()
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.inner(input_ids=ids, use_cache=False).logits
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.not_rewritten is None and report.counts()["qkv"] == 2, report
    assert any("without labels and with use_cache=False" in note for note in report.notes), report.notes
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, want)


def test_verify_false_is_the_only_way_to_fuse_unverified():
    model = toys.TinyNormModel(toys.LlamaStyleNorm(32))
    transfuse.rewrite(model, verify=False)
    report = transfuse.report(model)
    assert report.counts() == {"rms_norm": 1}
    assert report.verification.startswith("unverified") and "verify=False" in str(report)
    assert all(f.check == report.verification for f in report.fusions)


def test_the_drop_in_loader_warns_and_returns_the_stock_model(monkeypatch):
    config = tiny_config("llama")
    stock = transfuse.AutoModelForCausalLM.from_config(config, verify=False).__class__  # noqa: F841 (warm import)

    def no_probe(*args, **kwargs):
        raise ProbeUnavailable("no probe here")

    monkeypatch.setattr(apply_module, "make_probe", no_probe)
    with pytest.warns(UserWarning, match="not rewritten"):
        model = transfuse.AutoModelForCausalLM.from_config(config)
    assert _fused_modules(model) == []


def test_the_drop_in_loader_survives_a_rewrite_that_fails(monkeypatch):
    def broken(model, probe):
        raise RuntimeError("the whole-model check broke")

    monkeypatch.setattr(apply_module, "check_model", broken)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="loaded unchanged.*whole-model check broke"):
        model = transfuse.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert _fused_modules(model) == []
    torch.manual_seed(0)
    stock = tiny_model("llama")
    ids = _ids(stock)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)


# ---- modules the probe never reached -------------------------------------------------------


def test_unreached_modules_borrow_inputs_of_their_class_or_are_refused():
    model = toys.SpareNormModel()
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    report = transfuse.report(model)
    fused = {f.path: f for f in report.fusions}
    assert set(fused) == {"norm", "spare"}
    assert "on the inputs of norm" in fused["spare"].check
    assert [(s.path, s.tag) for s in report.skipped] == [("unused", "verify.not-reached")]
    assert isinstance(model.unused, toys.GemmaStyleNorm)


# ---- shape-dependent control flow ----------------------------------------------------------


def test_a_shape_branch_in_a_helper_is_a_guard_in_the_trace():
    norm = toys.HelperShapeBranchNorm(16)
    trace = trace_module(norm, ((torch.randn(2, 3, 16, device="meta"),), {}))
    assert not trace.partial
    assert len(trace.shape_guards) == 1
    assert "dim()" in trace.shape_guards[0].describe() and "toys.py" in trace.shape_guards[0].describe()


@pytest.mark.parametrize("norm_class", [toys.HelperShapeBranchNorm, toys.InlineShapeBranchNorm])
def test_a_norm_that_branches_on_its_input_shape_is_refused(norm_class):
    model = toys.TinyNormModel(norm_class(32))
    flat = torch.randn(1, 32)
    with torch.no_grad():
        want = model(flat)
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    report = transfuse.report(model)
    assert report.fusions == []
    assert [s.tag for s in report.skipped] == ["rms_norm.control-flow"]
    with torch.no_grad():
        assert torch.equal(model(flat), want)  # 2-D inputs still take their own path


def test_a_moe_block_that_branches_on_the_token_count_is_refused():
    model = toys.TinyMoEModel(toys.ShapeBranchMoE())
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    report = transfuse.report(model)
    assert "moe" not in report.counts()
    assert [s.tag for s in report.skipped if s.kind == "moe"] == ["moe.control-flow"]


def test_shape_reads_without_a_branch_are_no_guard():
    trace = trace_module(toys.ShapeUnpacking(16, 2), ((torch.randn(2, 3, 16, device="meta"),), {}))
    assert trace.shape_guards == []


# ---- failures part-way -----------------------------------------------------------------------


def test_a_whole_model_check_that_raises_undoes_everything():
    model = toys.ReadsChildWeightModel()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = model(x)
    with pytest.raises(transfuse.RewriteError, match="every fusion was undone") as info:
        transfuse.rewrite(model, example_inputs=(x,))
    assert isinstance(info.value.__cause__, KeyError)
    assert _fused_modules(model) == [] and isinstance(model.attn.wq, nn.Linear)
    with torch.no_grad():
        assert torch.equal(model(x), want)


class _BrokenMatcher(Fuser):
    kind = "broken"  # its own kind: verdicts are cached per class and kind

    def match(self, analysis):
        raise KeyError("a bug")

    def fuse(self, module, found):
        raise AssertionError("never reached")


def test_a_matcher_that_fails_refuses_its_class_instead_of_the_rewrite():
    model = tiny_model("llama")
    report = apply_module.rewrite_model(model, [_BrokenMatcher()])
    assert report.fusions == []
    assert {s.tag for s in report.skipped} == {"broken.internal-error"}
    assert "KeyError" in report.skipped[0].reason


def _needs_model_type(model_type: str) -> None:
    """Some families are newer than the oldest transformers we support (the GPU machine has 5.17)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")


def test_longcat_flash_is_refused_with_a_reason_not_a_crash():
    _needs_model_type("longcat_flash")
    model = tiny_model("longcat_flash")
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.counts().get("rms_norm")
    assert [s.tag for s in report.skipped if s.kind == "moe"] == ["moe.control-flow"]
    assert not [s for s in report.skipped if s.tag.endswith("internal-error")]


def test_granitemoe_swa_attention_checks_on_a_fresh_copy_of_its_cache():
    """Its attention is handed a cache even without use_cache; re-running it on the recorded
    (and since grown) cache raised a size mismatch, and the exact qkv fusion was undone."""
    _needs_model_type("granitemoe_swa")
    model = tiny_model("granitemoe_swa")
    ids = _ids(model)
    with torch.no_grad():
        before = model(ids).logits
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.counts().get("qkv") == 2 and not [s for s in report.skipped if s.tag == "verify.mismatch"]
    with torch.no_grad():
        assert (model(ids).logits - before).abs().max() <= 1e-5 * before.abs().max()


def test_a_rewrite_under_the_meta_device_leaves_later_rewrites_working():
    """In a fresh process, so that nothing before it has filled transfuse's caches."""
    script = textwrap.dedent(
        """
        import torch, transfuse
        from transformers import AutoModelForCausalLM
        from transfuse.tiny import tiny_config, tiny_model
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(tiny_config("llama"))
            transfuse.rewrite(meta)
        assert transfuse.report(meta).counts() == {"rms_norm": 5, "add_rms_norm": 2, "qkv": 2, "gate_up": 2, "rotary": 2}, transfuse.report(meta)
        model = tiny_model("llama")
        transfuse.rewrite(model)
        report = transfuse.report(model)
        assert report.counts() == {"rms_norm": 5, "add_rms_norm": 2, "qkv": 2, "gate_up": 2, "rotary": 2}, report
        assert report.verification == "verified"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ---- no global state left behind ---------------------------------------------------------------


def _global_state():
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.llama import modeling_llama

    return (
        nn.Module.__call__,
        AttentionInterface.get_interface,
        AttentionInterface.__getitem__,
        dict(vars(modeling_llama)),
    )


def test_rewrites_leave_no_global_state_behind():
    before = _global_state()
    transfuse.rewrite(tiny_model("llama"))
    transfuse.rewrite(toys.TinyNormModel(toys.HelperShapeBranchNorm(32)), example_inputs=(torch.randn(2, 5, 32),))
    trace_module(toys.DataDependentBranch(8), ((torch.randn(2, 8),), {}))  # a trace that stops part-way
    after = _global_state()
    assert after[:3] == before[:3]
    assert after[3].keys() == before[3].keys()
    assert all(after[3][k] is v for k, v in before[3].items())


def test_rewritten_forwards_see_later_patches_of_their_module(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    transfuse.rewrite(model)
    assert transfuse.report(model).counts().get("qkv") == 2
    seen = []
    original = modeling_llama.apply_rotary_pos_emb

    def counting(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", counting)
    with torch.no_grad():
        model(_ids(model))
    assert len(seen) == 2  # both rewritten attention layers called the patched function


def test_rewritten_model_compiles_with_fullgraph():
    model = tiny_model("llama")
    transfuse.rewrite(model)
    ids = _ids(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(ids).logits, model(ids).logits, atol=1e-5)
