"""QKV and gate/up GLU fusion: real families, toy idioms, refusals, weights round trip, compile."""

from __future__ import annotations

import copy

import inspect

import pytest
import torch
from torch import nn

import transfuse
from tests import toys
from transfuse.ops import LinearPart, MergedProjection
from transfuse.rewriter.apply import rewrite_model
from transfuse.rewriter.wrappers import chain
from transfuse.tiny import tiny_model

ACCEPTANCE = [
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
    "olmo2", "granite", "ernie4_5", "cohere", "mixtral", "qwen3_moe", "olmoe",
]  # fmt: skip


def _attention_paths(model):
    """Modules with q/k/v/o-style projections: three linears of one width family plus an output."""
    return [p for p, m in model.named_modules() if all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj"))]


def _dense_glu_paths(model):
    return [p for p, m in model.named_modules() if all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))]


def _ids(model, batch=2, seq=10, seed=0):
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ACCEPTANCE)
def test_every_attention_and_dense_glu_is_fused_and_outputs_match(model_type):
    model = tiny_model(model_type)
    attention, glu = _attention_paths(model), _dense_glu_paths(model)
    assert attention
    ids = _ids(model)
    prompt = ids[:1, :4]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    generated = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert sorted(f.path for f in report.fusions if f.kind == "qkv") == sorted(attention)
    assert sorted(f.path for f in report.fusions if f.kind == "gate_up") == sorted(glu)
    assert all(isinstance(model.get_submodule(p).qkv_proj, MergedProjection) for p in attention)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert (after - before).abs().max().item() <= 1e-5
    assert torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0), generated)


@pytest.mark.parametrize("model_type", ["phi3", "glm"])
def test_models_that_already_merge_projections_are_left_alone_or_fused_correctly(model_type):
    model = tiny_model(model_type)
    ids = _ids(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    transfuse.rewrite(model)
    with torch.no_grad():
        assert (model(input_ids=ids).logits - before).abs().max().item() <= 1e-5
    report = transfuse.report(model)
    kinds = report.counts()
    # Their MLPs already run one gate_up_proj: its activation and product become act_and_mul.
    merged_glu = [p for p, m in model.named_modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Linear)]
    assert sorted(f.path for f in report.fusions if f.kind == "gate_up") == sorted(merged_glu)
    assert {f.into for f in report.fusions if f.kind == "gate_up"} == {"act_and_mul"}
    assert kinds.get("qkv", 0) == len(_attention_paths(tiny_model(model_type)))


def test_rewritten_instance_keeps_its_class_and_attributes():
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    cls, head_dim = type(attention), attention.head_dim
    transfuse.rewrite(model)
    assert type(attention) is cls and attention.head_dim == head_dim
    assert isinstance(attention.qkv_proj, MergedProjection) and attention.qkv_proj.split_sizes == (64, 32, 32)
    # The originals stay under their names as views of the merged rows: no parameters of their own.
    assert isinstance(attention.q_proj, LinearPart) and list(attention.q_proj.parameters()) == []
    assert attention.k_proj.weight.data_ptr() == attention.qkv_proj.weight[64:].data_ptr()
    # The new forward runs under the original file name, from the original line on.
    code = inspect.unwrap(attention.forward).__code__
    assert code.co_filename == inspect.getsourcefile(cls)
    assert code.co_firstlineno == inspect.unwrap(cls.forward).__code__.co_firstlineno
    # The decorators of the original forward wrap the new one (transformers' @deprecate_kwarg
    # maps past_key_values to its new name where it has one), under the one wrapper of the rewrite's
    # own (which follows a class changed after the rewrite).
    assert len(chain(attention.forward.__func__)) == len(chain(cls.forward)) + 1
    hidden = torch.randn(1, 3, 64)
    cos_sin = model.model.rotary_emb(hidden, torch.arange(3)[None])
    with torch.no_grad():
        out, _ = attention(hidden, position_embeddings=cos_sin, attention_mask=None, past_key_values=None)
    assert out.shape == (1, 3, 64)
    # Other instances of the class (in another model) are untouched.
    assert not hasattr(tiny_model("llama").model.layers[0].self_attn, "qkv_proj")


def test_decorators_survive_the_rewrite():
    model = toys.Wrapper(toys.RenamedKwargAttention())
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        expected = model.inner(x, scale=3.0)
    transfuse.rewrite(model, example_inputs=(x,))
    assert transfuse.report(model).counts() == {"qkv": 1}
    with torch.no_grad():
        torch.testing.assert_close(model.inner(x, scale_by=3.0), expected, rtol=0, atol=1e-6)


def test_zero_argument_super_works_in_a_rewritten_forward():
    model = toys.Wrapper(toys.SuperCallingAttention())
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        expected = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert transfuse.report(model).counts() == {"qkv": 1}
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)


FUSING = [
    (toys.WqWkWvAttention, "qkv", ("wq", "wk", "wv")),
    (toys.QueryKeyValueAttention, "qkv", ("query", "key", "value")),
    (toys.FourReaders, "qkv", ("q", "k", "v", "gate")),
    (toys.FunctionalSiluMLP, "gate_up", ("w1", "w3")),
    (toys.TorchMulGeluTanhMLP, "gate_up", ("gate", "up")),
]


@pytest.mark.parametrize("cls, kind, parts", FUSING, ids=lambda v: getattr(v, "__name__", str(v)))
def test_toy_idioms_fuse_by_dataflow_whatever_the_names(cls, kind, parts):
    torch.manual_seed(0)
    model = toys.Wrapper(cls())
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    (fusion,) = transfuse.report(model).fusions
    assert (fusion.kind, fusion.replaced, fusion.path) == (kind, parts, "inner")
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_a_self_or_cross_attention_class_fuses_on_the_self_attention_path_and_keeps_the_other():
    """bart's idiom: with ``memory`` None the forward is specialised (the flag, its branches and the
    selected source fold) and q, k, v merge there. The merged instance still runs the cross path as
    written, through views of the merged weights; the instance traced on that path merges k and v."""
    torch.manual_seed(0)
    model = toys.SelfThenCross()
    stock = toys.SelfOrCrossAttention()
    stock.load_state_dict(model.self_attn.state_dict())
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    report = transfuse.report(model)
    fused = sorted((f.path, f.replaced) for f in report.fusions)
    assert fused == [("cross_attn", ("k", "v")), ("self_attn", ("q", "k", "v"))], report
    assert report.skipped == []
    diff = transfuse.diff(model)
    assert "if memory is None:" in diff and "self.qkv_proj(x)" in diff and "source = x" in diff
    assert "pass" not in diff  # a branch left empty by the folds, on a test with no effect, goes
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)
        memory = torch.randn(2, 3, 32)
        reuse = {"reuse": True, "k": torch.randn(2, 4, 3, 8), "v": torch.randn(2, 4, 3, 8)}
        for kwargs in ({}, {"cache": {}}, {"memory": memory}, {"memory": memory, "cache": {}},
                       {"memory": memory, "cache": reuse}):  # fmt: skip
            torch.testing.assert_close(model.self_attn(x, **kwargs), stock(x, **kwargs), rtol=0, atol=1e-6)
    # Gradients through the specialised path are the stock ones, the merged weight's by its parts.
    model.self_attn(x).sum().backward()
    stock(x).sum().backward()
    merged = model.self_attn.qkv_proj.weight.grad
    torch.testing.assert_close(merged, torch.cat([stock.q.weight.grad, stock.k.weight.grad, stock.v.weight.grad]))


REFUSED = [
    (toys.ProjectionUsedTwice, "qkv.called-twice"),
    (toys.InputMutatedBetween, "qkv.input-mutated"),
    (toys.AliasedInputs, "qkv.inputs-differ"),
    (toys.RebindsOptionalArgument, "qkv.inputs-differ"),
    (toys.make_closure_attention(0.5), "source.closure"),
    (toys.NameMangledAttention, "source.name-mangled"),
    (toys.InPlaceBetweenGLU, "gate_up.input-mutated"),
    (toys.CastInputPair, "qkv.inputs-differ"),
]


def _refused_once(make):
    """``make()`` rewritten inside a wrapper: nothing fused, one refusal (returned), outputs unchanged."""
    torch.manual_seed(0)
    model = toys.Wrapper(make())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    report = transfuse.report(model)
    assert report.fusions == []
    (skip,) = report.skipped
    with torch.no_grad():
        assert torch.equal(model(x), before)
    return skip, model


def test_linears_in_a_list_are_refused_by_the_list():
    skip, _ = _refused_once(toys.LinearsInAList)
    assert (skip.kind, skip.tag, skip.cls) == ("qkv", "qkv.module-list", "ModuleList") and skip.reason.endswith(".")


@pytest.mark.parametrize("cls, tag", REFUSED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_rule_refuses_with_its_reason(cls, tag):
    skip, model = _refused_once(cls)
    assert skip.tag == tag and skip.cls == cls.__name__ and skip.reason.endswith(".")
    assert transfuse.diff(model) == ""


@pytest.mark.parametrize(
    "cls", [toys.ReluGLU, toys.CastAroundGLU, toys.ScaledGateGLU, toys.ActivatedGateInAVariable], ids=lambda c: c.__name__
)
def test_a_glu_the_fused_op_does_not_compute_merges_its_projections_alone(cls):
    """Casts around the activation, a scale on the gate, an activation the op does not have, the
    activated gate in a variable: one merged matmul, the arithmetic after it as written, the same
    outputs and gradients (the merged weight's gradient is the parts' gradients stacked)."""
    torch.manual_seed(0)
    stock = cls()
    model = toys.Wrapper(copy.deepcopy(stock))
    x = torch.randn(2, 5, 32)
    transfuse.rewrite(model, example_inputs=(x,))
    report = transfuse.report(model)
    assert [(f.kind, f.cls) for f in report.fusions] == [("gate_up", cls.__name__)] and report.skipped == []
    assert "self.gate_up_proj(x).split(" in transfuse.diff(model)
    assert "transfuse.ops" not in transfuse.diff(model)  # no fused op called
    assert torch.equal(model.inner(x), stock(x))
    model.inner(x).sum().backward()
    stock(x).sum().backward()
    merged = model.inner.gate_up_proj.weight.grad
    torch.testing.assert_close(merged, torch.cat([stock.gate.weight.grad, stock.up.weight.grad]), rtol=0, atol=1e-6)


def test_state_dict_keeps_original_keys_and_load_state_dict_of_an_original_checkpoint_works():
    model = tiny_model("qwen2")  # q/k/v with biases
    original = {k: v.clone() for k, v in model.state_dict().items()}
    transfuse.rewrite(model)
    state = model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in original)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(original)
    assert all(torch.equal(model.state_dict()[k], original[k]) for k in original)


def test_save_pretrained_round_trip_loads_in_stock_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    ids = _ids(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    transfuse.rewrite(model)
    model.save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, MergedProjection) for m in stock.modules())
    with torch.no_grad():
        assert torch.equal(stock(input_ids=ids).logits, expected)


class _SwappedKV:
    """A deliberately wrong QKV rewrite: k and v trade places in the merged split."""

    @staticmethod
    def make():
        from transfuse.fusers.qkv import QKVFuser, QKVMatch

        class SwappedKV(QKVFuser):
            def match(self, analysis):
                found = super().match(analysis)
                if isinstance(found, QKVMatch):
                    q, k, v = found.parts
                    return QKVMatch((q, v, k), found.into, found.linears)
                return found

            def edit(self, tree, found, context):
                q, v, k = found.parts
                return super().edit(tree, QKVMatch((q, k, v), found.into, found.linears), context)

        return SwappedKV()


def test_verification_undoes_a_wrong_source_rewrite():
    from transfuse.rewriter.analysis import clear_cache

    clear_cache()
    model = tiny_model("llama", num_key_value_heads=4)  # k and v of equal width, so the swap runs
    ids = _ids(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = rewrite_model(model, [_SwappedKV.make()])
    clear_cache()
    assert report.fusions == [] and {s.tag for s in report.skipped} == {"verify.mismatch"}
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, nn.Linear) and "forward" not in vars(attention)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.slow
def test_torch_compile_of_a_rewritten_model_matches_the_original():
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids = _ids(model, batch=1, seq=6)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    transfuse.rewrite(model)
    compiled = torch.compile(model)
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    assert (got - expected).abs().max().item() <= 1e-5


def test_a_part_called_in_training_after_an_evaluation_passes_its_gradient_to_the_merged_tensors():
    """Forwards that keep a path calling the original projections (a shared self/cross-attention
    class, a layer that shares its keys) call the ``LinearPart``s: their views of the merged rows,
    first made under ``no_grad`` (an evaluation, a rewrite's check), must not cut the gradient."""
    stock, fused = tiny_model("llama"), tiny_model("llama")
    fused.load_state_dict(stock.state_dict())
    transfuse.rewrite(fused)
    attention, original = fused.model.layers[0].self_attn, stock.model.layers[0].self_attn
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        attention.k_proj(x)  # the views made with gradients off
    for module in (attention.k_proj, original.k_proj):
        (module(x) * torch.arange(x.shape[1])[None, :, None]).sum().backward()
    rows = slice(*attention.k_proj._rows)
    torch.testing.assert_close(attention.qkv_proj.weight.grad[rows], original.k_proj.weight.grad)
    assert attention.qkv_proj.weight.grad[: rows.start].abs().sum() == 0  # q's rows: nothing
