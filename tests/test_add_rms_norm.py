"""The add_rms_norm fusion: a decoder layer's residual add and the norm after it as one
``fused_add_rms_norm``, proved on the source, and ``ops.add_rms_norm``'s fall-back to the
statements as written wherever the fused op would not compute exactly them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transfuse
from transfuse import ops
from transfuse.fusers import AddRMSNormFuser, fusers_for
from transfuse.fusers.add_rms_norm import _Fuse
from transfuse.ops import RMSNormSpec
from transfuse.tiny import tiny_model


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_one_site_a_layer_and_the_logits_are_the_stock_models(model_type):
    stock, fused = tiny_model(model_type).eval(), tiny_model(model_type).eval()
    transfuse.rewrite(fused)
    layers = stock.config.num_hidden_layers
    assert transfuse.report(fused).counts()["add_rms_norm"] == layers
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ops.trace() as calls:
        got = fused(ids).logits
    assert sum(c.op == "fused_add_rms_norm" for c in calls) == layers
    with torch.no_grad():
        want = stock(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_edit_replaces_the_three_statements_and_keeps_their_comments():
    import libcst as cst

    source = """
def forward(self, hidden_states, residual):
    hidden_states = residual + hidden_states
    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    other = residual + hidden_states
    residual = other
    other = self.mlp(other)
    return hidden_states, other
"""
    tree = cst.parse_module(source)
    fuse = _Fuse({"post_attention_layernorm"}, lambda: "add_rms_norm")
    code = tree.visit(fuse).code
    assert fuse.sites == 1
    assert "hidden_states, residual = add_rms_norm(self.post_attention_layernorm, residual, hidden_states)" in code
    assert "# Fully Connected" in code and "self.mlp(other)" in code  # not a norm the graph found


@pytest.mark.parametrize(
    "body",
    [
        # something between the statements
        "h = r + h\n    r = h\n    h = h * 2\n    h = self.norm(h)",
        # the residual is not the sum
        "h = r + h\n    r = x\n    h = self.norm(h)",
        # the norm reads another value
        "h = r + h\n    r = h\n    h = self.norm(r)",
        # a difference, not a sum; a keyword argument
        "h = r - h\n    r = h\n    h = self.norm(h)",
        "h = r + h\n    r = h\n    h = self.norm(h, eps=1)",
    ],
)
def test_other_statements_are_left_alone(body):
    import libcst as cst

    tree = cst.parse_module(f"def forward(self, h, r, x):\n    {body}\n    return h, r\n")
    fuse = _Fuse({"norm"}, lambda: "add_rms_norm")
    assert tree.visit(fuse).code == tree.code and fuse.sites == 0


def _norm(width=16, **spec):
    torch.manual_seed(0)
    return ops.RMSNorm(nn.Parameter(torch.randn(width)), 1e-6, RMSNormSpec(**spec))


def test_add_rms_norm_is_the_sum_and_its_norm():
    norm = _norm(offset=True)
    a, b = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    with ops.trace() as calls:
        normed, total = ops.add_rms_norm(norm, a, b)
    assert [c.op for c in calls] == ["fused_add_rms_norm"]
    assert torch.equal(total, a + b) and torch.equal(normed, norm(a + b))


def test_add_rms_norm_runs_the_statements_as_written_where_the_op_would_differ():
    a, b = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    # A hook on the norm runs (the fused op would skip it).
    norm, seen = _norm(), []
    norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with ops.trace() as calls:
        normed, total = ops.add_rms_norm(norm, a, b)
    assert seen and torch.equal(seen[0], a + b) and [c.op for c in calls] == ["rms_norm"]
    # A float32 residual with bf16 hidden states: the sum is promoted, as written.
    norm = _norm()
    normed, total = ops.add_rms_norm(norm, a, b.bfloat16())
    assert total.dtype == torch.float32 and torch.equal(total, a + b.bfloat16())
    # A norm that is not the RMSNorm layer (its fusion not made): called as it is.
    plain = nn.LayerNorm(16)
    normed, total = ops.add_rms_norm(plain, a, b)
    assert torch.equal(normed, plain(a + b))


def test_asking_for_add_rms_norm_without_rms_norm_is_an_error():
    with pytest.raises(ValueError, match="builds on rms_norm"):
        fusers_for(["add_rms_norm", "qkv"])
    assert any(isinstance(f, AddRMSNormFuser) for f in fusers_for(["rms_norm", "add_rms_norm"]))
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="builds on rms_norm"):
        transfuse.rewrite(model, fusions=["add_rms_norm"])


def test_gradients_through_the_fused_op_are_the_stock_models():
    stock, fused = tiny_model("llama").train(), tiny_model("llama").train()
    transfuse.rewrite(fused, fusions=["rms_norm", "add_rms_norm"])
    assert transfuse.report(fused).counts() == {"rms_norm": 5, "add_rms_norm": 2}
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (stock, fused):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(stock.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_an_emitted_modeling_file_runs_the_fused_op_too(tmp_path):
    """In an emitted file the norm is the model's own class, its forward the op: the class says
    what it computes (``_transfuse_rms_norm``), and add_rms_norm fuses with it as with the layer."""
    from transfuse.rewriter.emit import emit

    model = transfuse.rewrite(tiny_model("llama"))
    emit(model, tmp_path / "out")
    assert "_transfuse_rms_norm = ('weight', 'variance_epsilon', RMSNormSpec(" in (tmp_path / "out" / "modeling_llama.py").read_text()
    loaded = transfuse.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), ops.trace() as calls:
        got = loaded(ids).logits
    assert sum(c.op == "fused_add_rms_norm" for c in calls) == 2
    with torch.no_grad():
        assert torch.equal(got, model.eval()(ids).logits)


def test_a_norm_whose_forward_is_replaced_on_the_instance_is_called():
    """accelerate's offloading hooks set the instance's forward (moving the weight in first): the
    fused op would read the weight without them, so the norm is called as written."""
    norm, calls = _norm(), []
    original = norm.forward

    def forward(x):
        calls.append(x)
        return original(x)

    norm.forward = forward
    a, b = torch.randn(2, 16), torch.randn(2, 16)
    normed, total = ops.add_rms_norm(norm, a, b)
    assert len(calls) == 1 and torch.equal(normed, original(a + b))


def test_a_layer_whose_norm_the_rms_norm_fusion_refuses_is_refused_with_the_reason():
    """The report counts only sites that run fused: a norm instance the RMSNorm fusion refuses
    (here its epsilon is an int) refuses the add at that layer too."""
    stock, model = tiny_model("llama").eval(), tiny_model("llama").eval()
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1
    stock.model.layers[1].post_attention_layernorm.variance_epsilon = 1
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.counts()["add_rms_norm"] == 1
    refusals = [s for s in report.skipped if s.kind == "add_rms_norm"]
    assert [s.tag for s in refusals] == ["add_rms_norm.norm"] and "not a float" in refusals[0].reason
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=1e-6, atol=1e-6)
