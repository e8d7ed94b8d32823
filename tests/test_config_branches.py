"""Branches in third-party forwards: a weight-slicing arm for ``pretraining_tp > 1`` decided by the
traced instance's configuration and guarded at run time, and a GLU written alike in both arms of a
dtype test, fused in each. The modules are loaded from their file as remote code is, not imported
from transformers or from transfuse's tests package."""

from __future__ import annotations

import copy

import pytest
import torch

import transfuse


def _calls(module: torch.nn.Module) -> list[int]:
    count = [0]
    module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def test_slicing_branch_on_a_config_value_is_decided_fused_and_guarded(remote):
    torch.manual_seed(0)
    model = remote.Decoder(remote.config(pretraining_tp=1), remote.SlicingAttention, remote.SlicingMLP)
    original = copy.deepcopy(model)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    report = transfuse.report(model)
    assert report.counts().get("qkv") == 2 and report.counts().get("gate_up") == 2
    assert not [s for s in report.skipped if s.kind in ("qkv", "gate_up")]
    taken = [n for n in report.notes if "fused on the branch taken" in n]
    assert any("SlicingAttention" in n and "not (self.config.pretraining_tp > 1)" in n for n in taken)
    assert any("SlicingMLP" in n and "not (self.pretraining_tp > 1)" in n for n in taken)
    with torch.no_grad():
        after = model(x)
    assert (after - before).abs().max().item() <= 1e-5 * before.abs().max().item()

    merged = [_calls(layer.self_attn.qkv_proj) for layer in model.layers]
    merged += [_calls(layer.mlp.gate_up_proj) for layer in model.layers]
    with torch.no_grad():
        model(x)
    assert [c[0] for c in merged] == [1, 1, 1, 1]

    # The value changes after the rewrite: the guard sends every forward back to the original
    # code, which slices the (merged) weights, and the numbers are the unrewritten model's.
    for m in (model, original):
        m.config.pretraining_tp = 2
        for layer in m.layers:
            layer.mlp.pretraining_tp = 2
    with torch.no_grad():
        sliced, expected = model(x), original(x)
    assert [c[0] for c in merged] == [1, 1, 1, 1]  # the merged projections did not run
    assert torch.equal(sliced, expected)


def test_glu_in_both_arms_of_a_dtype_test_is_fused_in_each(remote):
    torch.manual_seed(0)
    model = remote.Decoder(remote.config(rotary=True), remote.QueryKeyValueAttention, remote.DtypeArmsMLP)
    x = torch.randn(2, 5, 32)
    original = copy.deepcopy(model)
    transfuse.rewrite(model, example_inputs=(x,))
    assert transfuse.report(model).counts().get("gate_up") == 2
    assert not [s for s in transfuse.report(model).skipped if s.kind == "gate_up"]
    calls = [_calls(layer.mlp.gate_up_proj) for layer in model.layers]
    for dtype in (torch.float32, torch.float16):  # the else arm, then the float16 arm
        model.to(dtype), original.to(dtype)
        with torch.no_grad():
            got, want = model(x.to(dtype)), original(x.to(dtype))
        scale = want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2) * scale
    assert [c[0] for c in calls] == [2, 2]  # each arm ran the merged projection


def _analysis(module, *args):
    from transfuse.rewriter.analysis import ClassAnalysis
    from transfuse.rewriter.tracer import trace_module

    trace = trace_module(module, (args, {}), {})
    children = {name: type(child) for name, child in module.named_children()}
    return ClassAnalysis(cls=type(module), trace=trace, traced_path="", had_example=True, children=children)


def test_only_tests_of_configuration_values_are_decided(remote):
    """``x.dtype == torch.float16`` reads the input, and is not decided; ``self.config.pretraining_tp
    > 1`` is, with the traced instance's value; so is ``self.pretraining_tp > 1``."""
    from transfuse.rewriter.branches import constant_tests

    x = torch.randn(2, 5, 32)
    assert constant_tests(_analysis(remote.DtypeArmsMLP(remote.config()), x)) == ()
    attention = _analysis(remote.SlicingAttention(remote.config(pretraining_tp=1)), x)
    assert constant_tests(attention) == (("self.config.pretraining_tp > 1", False),)
    mlp = _analysis(remote.SlicingMLP(remote.config(pretraining_tp=1)), x)
    assert constant_tests(mlp) == (("self.pretraining_tp > 1", False),)


def test_a_base_forward_that_reads_the_projections_is_no_obstacle(remote):
    """A subclass's forward that falls back to the base class's (``super().forward``, which slices
    the weights on a configuration value) merges its projections: the base forward reads the parts
    left under the original names, views of the merged weight, and computes what it did."""
    torch.manual_seed(0)
    for tp in (1, 2):
        attention = remote.SdpaFallbackAttention(remote.config(pretraining_tp=tp))
        original = copy.deepcopy(attention)
        x = torch.randn(2, 5, 32)
        transfuse.rewrite(attention, example_inputs=(x,))
        report = transfuse.report(attention)
        assert report.counts().get("qkv") == 1, report.skipped
        merged = _calls(attention.qkv_proj)
        with torch.no_grad():
            for output_attentions in (False, True):
                got, want = attention(x, output_attentions), original(x, output_attentions)
                assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        assert merged[0] == 1  # the fast path ran the merged projection, the fallback its parts


def test_a_method_that_rebinds_a_projection_is_refused(remote):
    torch.manual_seed(0)
    attention = remote.PrunableAttention(remote.config())
    transfuse.rewrite(attention, example_inputs=(torch.randn(2, 5, 32),))
    report = transfuse.report(attention)
    assert "qkv" not in report.counts()
    refused = [s for s in report.skipped if s.kind == "qkv"]
    assert [s.tag for s in refused] == ["qkv.other-use"] and "rebound by another method" in refused[0].reason


def test_shared_self_and_cross_attention_fuses_on_the_self_attention_path(remote):
    """Bart's shared attention class: with ``key_value_states`` None, q, k and v read
    ``hidden_states`` on both arms of the cache test (q above it, moved into each arm); the merged
    projection runs there, with a cache and without, and cross-attention runs the original code."""
    torch.manual_seed(0)
    attention = remote.SharedCrossAttention(remote.config())
    original = copy.deepcopy(attention)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    transfuse.rewrite(attention, example_inputs=(x,))
    report = transfuse.report(attention)
    assert report.counts().get("qkv") == 1, report.skipped
    merged = _calls(attention.qkv_proj)

    def same(got, want):
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()

    with torch.no_grad():
        out, cache = attention(x)
        want, want_cache = original(x)
        same((out, cache), (want, want_cache))
        step = torch.randn(2, 1, 32)
        same(attention(step, past_key_value=cache), original(step, past_key_value=want_cache))
        assert merged[0] == 2  # the prefill and the cached step each ran the merged projection
        cross, cross_cache = attention(x, key_value_states=memory)
        same((cross, cross_cache), original(x, key_value_states=memory))
        same(attention(x, memory, cross_cache), original(x, memory, cross_cache))
        assert merged[0] == 2  # cross-attention (k and v of another value) ran the parts


def _sink(code: str) -> str:
    import libcst as cst

    from transfuse.fusers.projections import _sunk_into_arms

    function = cst.parse_module(code).body[0]
    return cst.Module(body=[_sunk_into_arms(function, ("q", "k", "v"))]).code.strip()


_ABOVE = """
def forward(self, x, cache=None):
    y = x * 2
    q = self.q(x)
    if cache is not None:
        k, v = self.k(x), self.v(x)
    else:
        k, v = self.k(y), self.v(y)
    return q, k, v
"""


def test_the_statements_above_an_if_move_into_both_arms():
    assert _sink(_ABOVE) == """def forward(self, x, cache=None):
    y = x * 2
    if cache is not None:
        q = self.q(x)
        k, v = self.k(x), self.v(x)
    else:
        q = self.q(x)
        k, v = self.k(y), self.v(y)
    return q, k, v"""


@pytest.mark.parametrize(
    "change",
    [
        ("q = self.q(x)", "q = self.q(x); cache = None"),  # the moved statements rebind what the test reads
        ("if cache is not None:", "if x.shape[0] > 1:"),  # a test with an effect, or on data: order matters
        ("if cache is not None:", "if self.cached:"),  # an attribute read: a property may run code
        ("q = self.q(x)", "q = self.q(x) + self.q(y)"),  # a projection called twice above the if
        ("else:\n        k, v = self.k(y), self.v(y)", "else:\n        k, v = self.k(y), y"),  # v not in each arm
    ],
)
def test_nothing_moves_where_the_order_could_matter(change):
    code = _ABOVE.replace(*change)
    assert _sink(code) == code.strip()
