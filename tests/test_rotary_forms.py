"""Rotary forms of older modeling files: cos and sin read at ``position_ids`` inside the function,
a parameter kept and ignored, partial rotary cut in the forward, interleaved pairs of q and k, one
tensor at a time, and the forms the op does not take (complex frequencies, sin and cos in one table,
RoPE in a method the forward calls), each refused with its tag; the census counts each of those
call sites.

The toy attention modules are written as transformers 4.3x-4.4x wrote them: a rotary child holding
cached cos and sin tables, ``apply_rotary_pos_emb`` a module-level function; each function's
docstring ends in its verdict.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transfuse
from transfuse import ops


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_indexed(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """cos and sin read at the positions (transformers 4.36-4.44) → fuses, the op reads the tables."""
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rope_squeezed(q, k, cos, sin, position_ids):
    """Tables held as ``[1, 1, seq, dim]``, squeezed, then read at the positions (4.31-4.35) → fuses."""
    cos = cos.squeeze(1).squeeze(0)
    sin = sin.squeeze(1).squeeze(0)
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rope_kept_parameter(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The modern arithmetic with ``position_ids`` kept and never read (4.45) → fuses, with or without it."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rope_reads_positions(q, k, cos, sin, position_ids):
    """The positions used for something besides reading the tables → refused (rotary.form)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * (position_ids.unsqueeze(1).unsqueeze(-1) + 1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rope_interleaved(q, k, cos, sin):
    """Interleaved pairs for q and k at once, half-width tables → fuses (interleaved, repeat_interleave)."""
    cos = torch.repeat_interleave(cos[:, None, :, :], 2, 3)
    sin = torch.repeat_interleave(sin[:, None, :, :], 2, 3)
    return (q * cos) + (rotate_every_two(q) * sin), (k * cos) + (rotate_every_two(k) * sin)


def rope_one_tensor(tensor, sin, cos):
    """GPT-J's: one tensor, interleaved pairs, sin before cos → fuses, each call a ``rotary_one``."""
    sin = torch.repeat_interleave(sin[:, None, :, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, None, :, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


def rope_complex(xq, xk, freqs_cis):
    """Complex frequencies (Meta's reference code) → refused (rotary.complex)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class CachedRotaryEmbedding(nn.Module):
    """Cos and sin tables of every position, cut to the sequence (the 4.3x rotary module)."""

    def __init__(self, dim, max_positions=32, base=10000.0, leading_ones=False):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        shape = (1, 1, max_positions, dim) if leading_ones else (max_positions, dim)
        self.register_buffer("cos_cached", emb.cos().view(shape), persistent=False)
        self.register_buffer("sin_cached", emb.sin().view(shape), persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[..., :seq_len, :].to(x.dtype), self.sin_cached[..., :seq_len, :].to(x.dtype)


class OldAttention(nn.Module):
    """q, k, v, o projections and a rotary child; subclasses apply RoPE in one of the forms."""

    leading_ones = False

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.rotary_emb = CachedRotaryEmbedding(self.head_dim, leading_ones=self.leading_ones)

    def heads(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q, k, v):
        bsz, _, q_len, _ = q.shape
        weights = torch.softmax(torch.matmul(q, k.transpose(2, 3)) / self.head_dim**0.5, dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class IndexedAttention(OldAttention):
    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = rope_indexed(query_states, key_states, cos, sin, position_ids)
        return self.attend(query_states, key_states, value_states)


class SqueezedAttention(OldAttention):
    leading_ones = True

    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value_states, seq_len=key_states.shape[-2])
        query_states, key_states = rope_squeezed(query_states, key_states, cos, sin, position_ids)
        return self.attend(query_states, key_states, value_states)


class KeptParameterAttention(OldAttention):
    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value_states, seq_len=key_states.shape[-2])
        cos, sin = cos[position_ids], sin[position_ids]
        query_states, key_states = rope_kept_parameter(query_states, key_states, cos, sin, position_ids)
        return self.attend(query_states, key_states, value_states)


class PartialInForwardAttention(OldAttention):
    """The rotary width cut in the forward (GPT-NeoX, Phi): the function rotates the cut part → fuses."""

    def __init__(self):
        super().__init__()
        self.rotary_ndims = self.head_dim // 2
        self.rotary_emb = CachedRotaryEmbedding(self.rotary_ndims)

    def forward(self, hidden_states, position_ids):
        query, key, value = self.heads(hidden_states)
        query_rot, query_pass = query[..., : self.rotary_ndims], query[..., self.rotary_ndims :]
        key_rot, key_pass = key[..., : self.rotary_ndims], key[..., self.rotary_ndims :]
        cos, sin = self.rotary_emb(value, seq_len=key.shape[-2])
        query, key = rope_indexed(query_rot, key_rot, cos, sin, position_ids)
        query = torch.cat((query, query_pass), dim=-1)
        key = torch.cat((key, key_pass), dim=-1)
        return self.attend(query, key, value)


class ReadsPositionsAttention(OldAttention):
    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value_states, seq_len=key_states.shape[-2])
        cos, sin = cos[position_ids], sin[position_ids]
        query_states, key_states = rope_reads_positions(query_states, key_states, cos, sin, position_ids)
        return self.attend(query_states, key_states, value_states)


class InterleavedAttention(OldAttention):
    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value_states, seq_len=key_states.shape[-2])
        half = self.head_dim // 2
        cos, sin = cos[position_ids][..., :half], sin[position_ids][..., :half]
        query_states, key_states = rope_interleaved(query_states, key_states, cos, sin)
        return self.attend(query_states, key_states, value_states)


class OneTensorAttention(OldAttention):
    def forward(self, hidden_states, position_ids):
        query, key, value = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value, seq_len=key.shape[-2])
        half = self.head_dim // 2
        cos, sin = cos[position_ids][..., :half], sin[position_ids][..., :half]
        key = rope_one_tensor(key, sin, cos)
        query = rope_one_tensor(query, sin, cos)
        return self.attend(query, key, value)


class InMethodAttention(OldAttention):
    """RoPE called in a method the forward calls (a forward split in two) → refused (rotary.in-method)."""

    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.project_and_rotate(hidden_states, position_ids)
        return self.attend(query_states, key_states, value_states)

    def project_and_rotate(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value_states, seq_len=key_states.shape[-2])
        query_states, key_states = rope_indexed(query_states, key_states, cos, sin, position_ids)
        return query_states, key_states, value_states


class StaticMethodAttention(OldAttention):
    """RoPE as a static method of the class, sin and cos in one table → refused (rotary.one-table)."""

    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value_states, seq_len=key_states.shape[-2])
        half = self.head_dim // 2
        sinusoidal = torch.cat([sin[position_ids][..., :half], cos[position_ids][..., :half]], dim=-1)[:, None]
        query_states, key_states = self.apply_rotary(sinusoidal, query_states, key_states)
        return self.attend(query_states, key_states, value_states)

    @staticmethod
    def apply_rotary(sinusoidal_pos, query, key, value=None):
        sin, cos = sinusoidal_pos.chunk(2, dim=-1)
        sin_pos = torch.stack([sin, sin], dim=-1).reshape_as(sinusoidal_pos)
        cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(sinusoidal_pos)
        rotated_query = torch.stack([-query[..., 1::2], query[..., ::2]], dim=-1).reshape_as(query)
        rotated_key = torch.stack([-key[..., 1::2], key[..., ::2]], dim=-1).reshape_as(key)
        return query * cos_pos + rotated_query * sin_pos, key * cos_pos + rotated_key * sin_pos


def rope_one_modern(x, cos, sin, position_ids=None, unsqueeze_dim=1):
    """One tensor in the modern arithmetic (gemma3n's) → fuses, each call a ``rotary_one``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (rotate_half(x) * sin)


class TokensFirstAttention(OldAttention):
    """q and k kept as ``[batch, seq, heads, dim]``; tables read at the positions."""

    def tokens_first(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape)
        key = self.k_proj(hidden_states).view(shape)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = self.rotary_emb(value, seq_len=q_len)
        return query, key, value, cos[position_ids], sin[position_ids]


class KeywordConstantAttention(TokensFirstAttention):
    """Heads kept as ``[batch, seq, heads, dim]``, RoPE told so by a constant passed by keyword
    (gemma3n, gemma4, the DeepSeek-V3.2 indexer) → fuses, the function proved with that constant."""

    def forward(self, hidden_states, position_ids):
        query, key, value, cos, sin = self.tokens_first(hidden_states, position_ids)
        query, key = rope_kept_parameter(query, key, cos, sin, unsqueeze_dim=2)
        return self.attend(query.transpose(1, 2), key.transpose(1, 2), value)


class KeywordConstantOneTensorAttention(TokensFirstAttention):
    def forward(self, hidden_states, position_ids):
        query, key, value, cos, sin = self.tokens_first(hidden_states, position_ids)
        query = rope_one_modern(query, cos, sin, unsqueeze_dim=2)
        key = rope_one_modern(key, cos, sin, unsqueeze_dim=2)
        return self.attend(query.transpose(1, 2), key.transpose(1, 2), value)


class KeywordVariableAttention(OldAttention):
    """A keyword whose value is computed in the forward → refused (rotary.arguments)."""

    def forward(self, hidden_states, position_ids):
        query, key, value = self.heads(hidden_states)
        cos, sin = self.rotary_emb(value, seq_len=key.shape[-2])
        cos, sin = cos[position_ids], sin[position_ids]
        query, key = rope_kept_parameter(query, key, cos, sin, unsqueeze_dim=query.dim() - 3)
        return self.attend(query, key, value)


def relative_buckets(num_buckets, position_ids):
    """Relative-position arithmetic of three arguments (products, a negation, a concatenation)."""
    relative = -(position_ids[:, None, :] - position_ids[:, :, None])
    return torch.cat([relative * num_buckets, relative + num_buckets], dim=-1)


class BucketsInMethodAttention(OldAttention):
    """No RoPE, relative-position arithmetic in a method the forward calls → no rotary refusal."""

    def forward(self, hidden_states, position_ids):
        query_states, key_states, value_states = self.heads(hidden_states)
        return self.attend(query_states, key_states, value_states) + self.bias(position_ids).sum()

    def bias(self, position_ids):
        return relative_buckets(4, position_ids).float() * 0.0


class ComplexAttention(OldAttention):
    def forward(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.shape
        xq = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        xk = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, seq_len=q_len)
        half = self.head_dim // 2
        freqs = torch.polar(torch.ones_like(cos[..., :half]), torch.atan2(sin[..., :half], cos[..., :half]))
        xq, xk = rope_complex(xq, xk, freqs[:, None, :])
        return self.attend(xq.transpose(1, 2), xk.transpose(1, 2), v)


def _inputs(batch=2, tokens=5, hidden=32):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, hidden, generator=generator)
    # positions of their own per sequence (left padding: the padded ones at 1, as transformers sets them)
    positions = torch.stack([torch.arange(tokens), (torch.arange(tokens) - 2).clamp(min=0).masked_fill(torch.arange(tokens) < 2, 1)])
    return x, positions


def _rewritten(cls):
    torch.manual_seed(0)
    module, stock = cls(), cls()
    stock.load_state_dict(module.state_dict())
    transfuse.rewrite(module, fusions=["rotary"], example_inputs=_inputs())
    return module, stock


OP_CALLS = {
    InterleavedAttention: ["rotary"],
    OneTensorAttention: ["rotary_one", "rotary_one"],
    KeywordConstantOneTensorAttention: ["rotary_one", "rotary_one"],
}


@pytest.mark.parametrize(
    "cls",
    [IndexedAttention, SqueezedAttention, KeptParameterAttention, PartialInForwardAttention, InterleavedAttention,
     OneTensorAttention, KeywordConstantAttention, KeywordConstantOneTensorAttention],
)  # fmt: skip
def test_older_rope_calls_fuse_with_the_originals_numbers_bit_for_bit(cls):
    module, stock = _rewritten(cls)
    report = transfuse.report(module)
    assert report.counts() == {"rotary": 1}, report
    x, positions = _inputs()
    with torch.no_grad(), ops.trace() as calls:
        got = module(x, positions)
    assert [c.op for c in calls] == OP_CALLS.get(cls, ["rotary"])
    with torch.no_grad():
        assert torch.equal(got, stock(x, positions))
    # gradients too: the op's backward for the tables' rows
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    module(x1, positions).square().sum().backward()
    stock(x2, positions).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)


def test_the_rewritten_call_passes_the_positions_and_says_how_they_are_read():
    module, _ = _rewritten(IndexedAttention)
    assert "position_ids=position_ids, indexed=True)" in transfuse.diff(module)
    module, _ = _rewritten(KeptParameterAttention)
    text = transfuse.diff(module)
    assert "original=rope_kept_parameter, position_ids=position_ids)" in text and "indexed" not in text


@pytest.mark.parametrize(
    "cls, tag",
    [
        (ReadsPositionsAttention, "rotary.form"),
        (ComplexAttention, "rotary.complex"),
        (InMethodAttention, "rotary.in-method"),
        (StaticMethodAttention, "rotary.one-table"),
        (KeywordVariableAttention, "rotary.arguments"),
    ],
)
def test_forms_the_op_does_not_compute_are_refused_each_with_its_tag(cls, tag):
    module, stock = _rewritten(cls)
    report = transfuse.report(module)
    assert report.counts() == {}, report
    assert [s.tag for s in report.skipped if s.kind == "rotary"] == [tag], report
    x, positions = _inputs()
    with torch.no_grad():
        assert torch.equal(module(x, positions), stock(x, positions))


def test_a_function_patched_in_after_the_rewrite_gets_the_calls_own_arguments(monkeypatch):
    module, stock = _rewritten(IndexedAttention)
    x, positions = _inputs()
    seen = []

    def patched(q, k, cos, sin, position_ids, unsqueeze_dim=1):  # RoPE's signature, not RoPE
        seen.append((cos.shape, position_ids))
        return q, k

    monkeypatch.setitem(globals(), "rope_indexed", patched)
    with torch.no_grad(), ops.trace() as calls:
        module(x, positions)
    # (the proof of the new function ran it too, on its own tensors: the last call is the model's)
    assert calls == [] and seen[-1][0] == (5, 8) and seen[-1][1] is positions  # the tables, not their rows


def test_a_constant_passed_by_keyword_is_passed_on_and_proved_with_the_function():
    module, _ = _rewritten(KeywordConstantAttention)
    assert "unsqueeze_dim=2" in transfuse.diff(module) and "original_keywords=(('unsqueeze_dim', 2),)" in transfuse.diff(module)
    x, positions = _inputs()
    seen = []

    def patched(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # RoPE's signature, not RoPE
        seen.append(unsqueeze_dim)
        return q, k

    globals()["rope_kept_parameter"], kept = patched, rope_kept_parameter
    try:
        with torch.no_grad(), ops.trace() as calls:
            module(x, positions)
    finally:
        globals()["rope_kept_parameter"] = kept
    assert calls == [] and seen[-1] == 2  # the patched function, called with the call's own keyword


@pytest.mark.parametrize("cls", [KeywordConstantAttention, KeywordConstantOneTensorAttention])
def test_a_keyword_constant_call_compiles_and_trains_like_the_stock_module(cls):
    """Under ``torch.compile`` the call runs the function (or the library op) with the call's
    keyword: the stock module's outputs and gradients."""
    module, stock = _rewritten(cls)
    x, positions = _inputs()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=False)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(x1, positions), stock(x2, positions)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(module.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_function_proved_with_a_keyword_is_a_copy_with_that_default():
    from transfuse.ops.rotary import with_keywords

    variant = with_keywords(rope_kept_parameter, (("unsqueeze_dim", 2),))
    assert variant is with_keywords(rope_kept_parameter, (("unsqueeze_dim", 2),))  # one object: one proof
    assert variant.__defaults__ == (None, 2) and rope_kept_parameter.__defaults__ == (None, 1)
    assert with_keywords(rope_kept_parameter, (("q", 2),)) is None  # no parameter with a default
    assert with_keywords(rope_kept_parameter, (("dim", 2),)) is None


def test_the_standalone_runtime_form_reads_the_tables_at_the_positions():
    from transfuse.ops.rotary import rotary_native
    from transfuse.rewriter.standalone import rotary

    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=generator), torch.randn(2, 2, 5, 8, generator=generator)
    cos, sin = torch.randn(1, 1, 9, 8, generator=generator), torch.randn(1, 1, 9, 8, generator=generator)
    positions = torch.randint(0, 9, (2, 5), generator=generator)
    want = rotary_native(q, k, cos[0, 0][positions], sin[0, 0][positions])
    got = rotary(q, k, cos, sin, position_ids=positions, indexed=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    got = rotary(q, k, cos, sin, 1, rope_squeezed, positions, True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("cls, name", [(InMethodAttention, "rope_indexed"), (StaticMethodAttention, "apply_rotary")])
def test_the_census_counts_rope_called_in_a_method_of_the_class(cls, name):
    from transfuse import census

    assert [o.describe() for o in census.count(cls()) if o.kind == "rotary"] == [f"rotary:<model>:{name}"]


def test_arithmetic_of_fewer_arguments_in_a_method_is_not_taken_for_rope():
    module, _ = _rewritten(BucketsInMethodAttention)
    assert [s.tag for s in transfuse.report(module).skipped if s.kind == "rotary"] == []
