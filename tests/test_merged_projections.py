"""Projections a modeling file already merges: a chunked ``gate_up_proj`` gets its activation and
product fused into ``act_and_mul`` (bit for bit in float32), halves in the other order are refused
with a tag, and a ``W_pack`` or ``query_key_value`` does not stop the norm, add+norm and rotary
fusions around it. The modules are loaded from their file as remote code is."""

from __future__ import annotations


import libcst
import pytest
import torch

import transfuse
from transfuse.rewriter.source import rewrite_of
from transfuse.tiny import tiny_model


def _rewritten(model, x):
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    with torch.no_grad():
        after = model(x)
    return before, after, transfuse.report(model)


@pytest.mark.parametrize("attention", ["WPackAttention", "QueryKeyValueAttention"])
def test_merged_qkv_and_chunked_gate_up_fuse_with_everything_around_them(remote, attention):
    torch.manual_seed(0)
    model = remote.Decoder(remote.config(rotary=True), getattr(remote, attention), remote.ChunkedGateUpMLP)
    before, after, report = _rewritten(model, torch.randn(2, 5, 32))
    counts = report.counts()
    assert counts == {"rms_norm": 5, "add_rms_norm": 2, "rotary": 2, "gate_up": 2}, counts
    assert {f.into for f in report.fusions if f.kind == "gate_up"} == {"act_and_mul"}
    assert torch.equal(after, before)  # act_and_mul computes silu(gate) * up as written


def test_chunked_gate_up_forward_calls_the_fused_op(remote):
    torch.manual_seed(0)
    model = remote.Decoder(remote.config(rotary=True), remote.QueryKeyValueAttention, remote.ChunkedGateUpMLP)
    x = torch.randn(2, 5, 32)
    transfuse.rewrite(model, example_inputs=(x,))
    for layer in model.layers:
        rewrite = rewrite_of(layer.mlp.forward)
        code = libcst.Module(body=[]).code_for_node(rewrite.edited)
        assert "act_and_mul_linear(self.down_proj, gate_up_proj_out, 'silu')" in code, code
        assert "self.act(" not in code
        assert isinstance(layer.mlp.gate_up_proj, torch.nn.Linear)  # the model's own linear, untouched


def test_halves_in_the_other_order_are_refused_with_a_tag(remote):
    torch.manual_seed(0)
    model = remote.Decoder(remote.config(rotary=True), remote.QueryKeyValueAttention, remote.UpFirstGateUpMLP)
    before, after, report = _rewritten(model, torch.randn(2, 5, 32))
    assert "gate_up" not in report.counts()
    assert [s.tag for s in report.skipped if s.kind == "gate_up"] == ["gate_up.halves-order"]
    assert torch.equal(after, before)


def test_phi3s_chunked_gate_up_is_fused():
    model = tiny_model("phi3")
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    transfuse.rewrite(model)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    report = transfuse.report(model)
    assert sorted(f.path for f in report.fusions if f.kind == "gate_up") == [
        f"model.layers.{i}.mlp" for i in range(model.config.num_hidden_layers)
    ]
    assert torch.equal(after, before)
