"""The rotary fusion: which RoPE functions the fused op takes, the refusals, and whole models.

The toy attention modules below call module-level RoPE functions written the ways modeling
files write them; each function's docstring ends in its verdict.
"""

from __future__ import annotations

import torch
from torch import nn

import transfuse
from transfuse.fusers.rotary import rotary_layout
from transfuse.ops import RotaryLayout


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's ``apply_rotary_pos_emb`` → fuses (dimension 1)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rope_tokens_first(q, k, cos, sin):
    """The same for ``[batch, tokens, heads, dim]`` → fuses (dimension 2)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_wrong_sign(q, k, cos, sin):
    """Rotation the other way (``cat(x2, -x1)``) → refused (rotary.form): the values differ."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def turn(x):
        half = x.shape[-1] // 2
        return torch.cat((x[..., half:], -x[..., :half]), dim=-1)

    return q * cos + turn(q) * sin, k * cos + turn(k) * sin


def rope_partial(q, k, cos, sin):
    """Partial rotary, the width read from cos (Phi-3) → fuses (partial): the rest passes through."""
    width = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot, q_pass = q[..., :width], q[..., width:]
    k_rot, k_pass = k[..., :width], k[..., width:]
    q_out = torch.cat([q_rot * cos + _rotate_half(q_rot) * sin, q_pass], dim=-1)
    k_out = torch.cat([k_rot * cos + _rotate_half(k_rot) * sin, k_pass], dim=-1)
    return q_out, k_out


def rope_partial_pass_first(q, k, cos, sin):
    """Partial rotary with the passed channels put first → refused (rotary.partial): the values differ."""
    width = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot, q_pass = q[..., :width], q[..., width:]
    k_rot, k_pass = k[..., :width], k[..., width:]
    q_out = torch.cat([q_pass, q_rot * cos + _rotate_half(q_rot) * sin], dim=-1)
    k_out = torch.cat([k_pass, k_rot * cos + _rotate_half(k_rot) * sin], dim=-1)
    return q_out, k_out


def rope_scaled(q, k, cos, sin):
    """RoPE with the output put through a sigmoid → refused (rotary.form): not a polynomial."""
    q, k = rope(q, k, cos, sin)
    return torch.sigmoid(q), k


class Attention(nn.Module):
    """q, k, v projections; each subclass's forward applies RoPE through one of the functions."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.heads, self.dim = heads, hidden // heads


class LlamaLikeAttention(Attention):
    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        out = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return out.transpose(1, 2).reshape(b, t, -1)


class TokensFirstAttention(Attention):
    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim)
        k = self.k(x).view(b, t, self.heads, self.dim)
        v = self.v(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope_tokens_first(q, k, cos, sin)
        out = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), dim=-1) @ v
        return out.transpose(1, 2).reshape(b, t, -1)


class WrongSignAttention(LlamaLikeAttention):
    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope_wrong_sign(q, k, cos, sin)
        return (q @ k.transpose(-1, -2)).sum(-1).transpose(1, 2)


class PartialAttention(LlamaLikeAttention):
    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope_partial(q, k, cos[..., : self.dim // 2], sin[..., : self.dim // 2])
        return (q @ k.transpose(-1, -2)).sum(-1).transpose(1, 2)


class PartialPassFirstAttention(LlamaLikeAttention):
    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope_partial_pass_first(q, k, cos[..., : self.dim // 2], sin[..., : self.dim // 2])
        return (q @ k.transpose(-1, -2)).sum(-1).transpose(1, 2)


class SigmoidAttention(LlamaLikeAttention):
    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope_scaled(q, k, cos, sin)
        return (q @ k.transpose(-1, -2)).sum(-1).transpose(1, 2)


class KeywordAttention(LlamaLikeAttention):
    """A keyword whose value the forward computes: not a constant the proof can take."""

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope(q, k, cos, sin, unsqueeze_dim=q.dim() - 3)
        return (q @ k.transpose(-1, -2)).sum(-1).transpose(1, 2)


class KeywordConstantAttention(LlamaLikeAttention):
    """The default passed again by keyword: a constant, proved with the function."""

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        q, k = rope(q, k, cos, sin, unsqueeze_dim=1)
        return (q @ k.transpose(-1, -2)).sum(-1).transpose(1, 2)


def _inputs(hidden=32, heads=4, batch=2, tokens=5):
    torch.manual_seed(1)
    dim = hidden // heads
    angles = torch.randn(batch, tokens, dim // 2)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.randn(batch, tokens, hidden), angles.cos(), angles.sin()


def _rewritten(cls):
    torch.manual_seed(0)
    module = cls()
    stock = cls()
    stock.load_state_dict(module.state_dict())
    x, cos, sin = _inputs()
    transfuse.rewrite(module, fusions=["rotary"], example_inputs=(x, cos, sin))
    return module, stock, (x, cos, sin)


def test_the_functions_proved_rope_and_the_ones_refused():
    assert rotary_layout(rope) == RotaryLayout(1)
    assert rotary_layout(rope_tokens_first) == RotaryLayout(2)
    assert rotary_layout(rope_partial) == RotaryLayout(1, partial=True)
    for function in (rope_wrong_sign, rope_partial_pass_first, rope_scaled):
        assert rotary_layout(function) is None, function.__name__


def test_transformers_own_rope_functions_are_proved():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3

    assert rotary_layout(llama) == RotaryLayout(1) and rotary_layout(qwen3) == RotaryLayout(1)
    assert rotary_layout(phi3) == RotaryLayout(1, partial=True)  # partial rotary: its width is cos's


def test_a_rope_call_becomes_the_fused_op_with_the_same_numbers_and_gradients():
    for cls in (LlamaLikeAttention, TokensFirstAttention, PartialAttention, KeywordConstantAttention):
        module, stock, (x, cos, sin) = _rewritten(cls)
        assert transfuse.report(module).counts() == {"rotary": 1}, transfuse.report(module)
        assert "rotary(q, k, cos" in transfuse.diff(module) and "original=rope" in transfuse.diff(module)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = module(x1, cos, sin), stock(x2, cos, sin)
        assert torch.equal(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)
        for (name, p), q in zip(module.named_parameters(), stock.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_rope_functions_the_op_does_not_compute_are_refused_with_the_reason():
    for cls, tag in ((WrongSignAttention, "rotary.form"), (PartialPassFirstAttention, "rotary.partial")):
        module, stock, (x, cos, sin) = _rewritten(cls)
        report = transfuse.report(module)
        assert report.counts() == {}, report
        assert any(s.tag == tag for s in report.skipped), report
        assert torch.equal(module(x, cos, sin), stock(x, cos, sin))


def test_a_call_that_passes_a_computed_keyword_is_refused():
    module, stock, (x, cos, sin) = _rewritten(KeywordAttention)
    report = transfuse.report(module)
    assert report.counts() == {} and any(s.tag == "rotary.arguments" for s in report.skipped), report
    assert torch.equal(module(x, cos, sin), stock(x, cos, sin))


def test_a_function_patched_in_after_the_rewrite_is_honoured(monkeypatch):
    from transfuse import ops

    module, stock, (x, cos, sin) = _rewritten(LlamaLikeAttention)
    with ops.trace() as calls:
        before = module(x, cos, sin)
    assert [c.op for c in calls] == ["rotary"]

    def identity(q, k, cos, sin, unsqueeze_dim=1):  # RoPE's signature, not RoPE
        return q, k

    monkeypatch.setitem(globals(), "rope", identity)
    with ops.trace() as calls:
        patched = module(x, cos, sin)
    assert calls == []  # the patched function ran, not the op
    assert not torch.equal(patched, before)

    def copy_of_rope(q, k, cos, sin, unsqueeze_dim=1):  # a new function object, proved at its first call
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    monkeypatch.setitem(globals(), "rope", copy_of_rope)
    with ops.trace() as calls:
        again = module(x, cos, sin)
    assert [c.op for c in calls] == ["rotary"] and torch.equal(again, before)


def test_an_emitted_model_runs_the_fused_op_for_its_own_copy_of_the_function(tmp_path):
    from transfuse import ops
    from transfuse.rewriter.emit import emit
    from transfuse.tiny import tiny_model

    model = transfuse.rewrite(tiny_model("llama"))
    emit(model, tmp_path / "out")
    text = (tmp_path / "out" / "modeling_llama.py").read_text()
    assert "rotary(query_states, key_states, cos, sin, unsqueeze_dim=1, original=apply_rotary_pos_emb)" in text
    loaded = transfuse.from_pretrained(tmp_path / "out", trust_remote_code=True)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ops.trace() as calls:
        got = loaded(input_ids=ids).logits
    assert sum(c.op == "rotary" for c in calls) == 2
    with torch.no_grad():
        assert torch.equal(got, model(input_ids=ids).logits)
