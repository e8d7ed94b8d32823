"""RoPE in the layouts third-party modeling files write: one tensor at a time with half-width tables
(GPT-J, CodeGen), interleaved pairs computed in float32 (Cohere), partial rotary inside the function
(Nemotron), a table's first half widened (GLM), results cast back (OLMo). Each toy attention fuses to
the op in the function's layout, with the stock module's logits and gradients bit for bit; a near
miss of each is refused with its tag, as is RoPE that computes the op's values laid out otherwise
(halves split off with ``chunk`` and concatenated, gpt-oss's: the matmuls after it would sum otherwise).

Each function's docstring ends in its verdict.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transfuse
from transfuse import ops


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def rope_gptj(tensor, sin, cos):
    """One tensor, sin before cos, half-width tables widened by repeat_interleave → fuses (rotary_one)."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


def rope_cohere(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Interleaved pairs of q and k in float32, cast back → fuses (interleaved, upcast)."""
    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_pairs(q) * sin)
    k_embed = (k * cos) + (rotate_pairs(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


def rope_nemotron(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The rotary width read from cos, the rest passed through → fuses (partial)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def rope_glm(q, k, cos, sin, unsqueeze_dim=1):
    """The tables' first half widened by repeat_interleave, interleaved pairs, partial → fuses."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_pairs(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_pairs(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def rope_olmo(q, k, cos, sin, unsqueeze_dim=1):
    """Rotate-half, each result cast back to its input's dtype → fuses (cast)."""
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)


# ---- near misses ----------------------------------------------------------------------------


def _rotate_chunks(x, cos, sin):
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def rope_chunks(q, k, cos, sin, unsqueeze_dim=1):
    """Halves split with ``chunk``, half-width tables used as they are: the values of
    ``expand="repeat"``, but a concatenation's layout, not the heads' → refused (rotary.form)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _rotate_chunks(q, cos, sin), _rotate_chunks(k, cos, sin)


def rotate_pairs_backwards(x):
    return torch.stack((x[..., 1::2], -x[..., ::2]), dim=-1).flatten(-2)


def rope_pairs_backwards(q, k, cos, sin):
    """Interleaved pairs turned the other way → refused (rotary.interleaved)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_pairs_backwards(q) * sin, k * cos + rotate_pairs_backwards(k) * sin


def rope_gptj_backwards(tensor, sin, cos):
    """GPT-J's one tensor, pairs turned the other way → refused (rotary.one-tensor)."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_pairs_backwards(tensor) * sin)


def rope_float16(q, k, cos, sin):
    """Rotate-half cast to float16 whatever the input → refused (rotary.form): no layout casts there."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos + rotate_half(q) * sin).to(torch.float16), (k * cos + rotate_half(k) * sin).to(torch.float16)


def rope_one_table(sinusoidal_pos, q, k):
    """Sin and cos in one table, split in the function (RoFormer's) → refused (rotary.one-table)."""
    sin, cos = sinusoidal_pos.chunk(2, dim=-1)
    sin_pos = torch.stack([sin, sin], dim=-1).reshape_as(sinusoidal_pos)
    cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(sinusoidal_pos)
    q_rot = torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).reshape_as(q)
    k_rot = torch.stack([-k[..., 1::2], k[..., ::2]], dim=-1).reshape_as(k)
    return q * cos_pos + q_rot * sin_pos, k * cos_pos + k_rot * sin_pos


# ---- the attention modules --------------------------------------------------------------------

HIDDEN, HEADS, HEAD_DIM, ROTARY_DIM = 64, 4, 16, 8


def _angles(positions: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, seq, width]`` angles of the positions (one frequency a pair)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
    return positions[..., None].float() * inv_freq


class Attention(nn.Module):
    """q, k, v, o projections; subclasses rotate q and k in one of the forms."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def heads(self, hidden_states):
        b, t, _ = hidden_states.shape
        shape = (b, t, HEADS, HEAD_DIM)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return q, k, v

    def attend(self, q, k, v):
        b, _, t, _ = q.shape
        weights = torch.softmax(q @ k.transpose(2, 3) / HEAD_DIM**0.5, dim=-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, t, -1))


class GPTJAttention(Attention):
    """GPT-J's forward: heads ``[batch, seq, heads, dim]``, the rotary part cut and put back in the
    forward, sin and cos halves of one gathered table, each of q and k rotated by its own call."""

    def forward(self, hidden_states, position_ids):
        b, t, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(b, t, HEADS, HEAD_DIM)
        key = self.k_proj(hidden_states).view(b, t, HEADS, HEAD_DIM)
        value = self.v_proj(hidden_states).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        angles = _angles(position_ids, ROTARY_DIM)
        sincos = torch.cat((angles.sin(), angles.cos()), dim=-1).to(query.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        k_rot, k_pass = key[:, :, :, :ROTARY_DIM], key[:, :, :, ROTARY_DIM:]
        q_rot, q_pass = query[:, :, :, :ROTARY_DIM], query[:, :, :, ROTARY_DIM:]
        k_rot = rope_gptj(k_rot, sin, cos)
        q_rot = rope_gptj(q_rot, sin, cos)
        key = torch.cat([k_rot, k_pass], dim=-1).permute(0, 2, 1, 3)
        query = torch.cat([q_rot, q_pass], dim=-1).permute(0, 2, 1, 3)
        return self.attend(query, key, value)


def _tables(position_ids, width, interleaved=False, dtype=torch.float32):
    """cos and sin ``[batch, seq, width]``: each pair's angle repeated for its two channels,
    neighbours (interleaved) or halves."""
    angles = _angles(position_ids, width)
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class CohereAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        cos, sin = _tables(position_ids, HEAD_DIM, interleaved=True, dtype=q.dtype)
        q, k = rope_cohere(q, k, cos, sin)
        return self.attend(q, k, v)


class NemotronAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        cos, sin = _tables(position_ids, ROTARY_DIM, dtype=q.dtype)
        q, k = rope_nemotron(q, k, cos, sin)
        return self.attend(q, k, v)


class GLMAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        cos, sin = _tables(position_ids, ROTARY_DIM, dtype=q.dtype)
        q, k = rope_glm(q, k, cos, sin)
        return self.attend(q, k, v)


class OLMoAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        cos, sin = _tables(position_ids, HEAD_DIM, dtype=q.dtype)
        q, k = rope_olmo(q, k, cos, sin)
        return self.attend(q, k, v)


class ChunksAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        angles = _angles(position_ids, HEAD_DIM)
        q, k = rope_chunks(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))
        return self.attend(q, k, v)


class PairsBackwardsAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        cos, sin = _tables(position_ids, HEAD_DIM, interleaved=True, dtype=q.dtype)
        q, k = rope_pairs_backwards(q, k, cos, sin)
        return self.attend(q, k, v)


class GPTJBackwardsAttention(Attention):
    def forward(self, hidden_states, position_ids):
        b, t, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(b, t, HEADS, HEAD_DIM)
        key = self.k_proj(hidden_states).view(b, t, HEADS, HEAD_DIM)
        value = self.v_proj(hidden_states).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        angles = _angles(position_ids, HEAD_DIM)
        key = rope_gptj_backwards(key, angles.sin(), angles.cos()).permute(0, 2, 1, 3)
        query = rope_gptj_backwards(query, angles.sin(), angles.cos()).permute(0, 2, 1, 3)
        return self.attend(query, key, value)


class Float16Attention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        cos, sin = _tables(position_ids, HEAD_DIM, dtype=q.dtype)
        q, k = rope_float16(q, k, cos, sin)
        return self.attend(q.to(v.dtype), k.to(v.dtype), v)


class OneTableAttention(Attention):
    def forward(self, hidden_states, position_ids):
        q, k, v = self.heads(hidden_states)
        angles = _angles(position_ids, HEAD_DIM)
        sinusoidal = torch.cat((angles.sin(), angles.cos()), dim=-1)[:, None].to(q.dtype)
        q, k = rope_one_table(sinusoidal, q, k)
        return self.attend(q, k, v)


def _inputs(dtype=torch.float32, batch=2, tokens=5):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, HIDDEN, generator=generator).to(dtype)
    positions = torch.stack([torch.arange(tokens) + 3, torch.arange(tokens)])  # each sequence its own
    return x, positions


def _rewritten(cls, dtype=torch.float32):
    torch.manual_seed(0)
    module, stock = cls().to(dtype), cls().to(dtype)
    stock.load_state_dict(module.state_dict())
    transfuse.rewrite(module, fusions=["rotary"], example_inputs=_inputs(dtype))
    return module, stock


# class -> (the op calls a forward makes, the rewritten call)
FUSES = {
    GPTJAttention: (["rotary_one", "rotary_one"],
                    'rotary_one(k_rot, cos, sin, unsqueeze_dim=2, interleaved=True, expand="repeat_interleave", '
                    "original=rope_gptj, sin_first=True)"),
    CohereAttention: (["rotary"],
                      "rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=True, upcast=True, original=rope_cohere)"),
    NemotronAttention: (["rotary"], "rotary(q, k, cos, sin, unsqueeze_dim=1, partial=True, original=rope_nemotron)"),
    GLMAttention: (["rotary"], 'rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=True, expand="repeat_interleave", '
                               "first_half=True, partial=True, original=rope_glm)"),
    OLMoAttention: (["rotary"], "rotary(q, k, cos, sin, unsqueeze_dim=1, cast=True, original=rope_olmo)"),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", list(FUSES), ids=lambda c: c.__name__)
def test_each_layout_fuses_with_the_stock_modules_logits_bit_for_bit(cls, dtype):
    module, stock = _rewritten(cls, dtype)
    report = transfuse.report(module)
    assert report.counts() == {"rotary": 1}, report
    calls_made, rewritten = FUSES[cls]
    assert rewritten in transfuse.diff(module)
    x, positions = _inputs(dtype)
    with torch.no_grad(), ops.trace() as calls:
        got = module(x, positions)
    assert [c.op for c in calls] == calls_made
    with torch.no_grad():
        assert torch.equal(got, stock(x, positions))


@pytest.mark.parametrize("cls", list(FUSES), ids=lambda c: c.__name__)
def test_each_layout_gives_the_stock_modules_gradients(cls):
    module, stock = _rewritten(cls)
    x, positions = _inputs()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with ops.trace() as calls:
        module(x1, positions).square().sum().backward()
    assert {(c.op, c.grad) for c in calls} == {(FUSES[cls][0][0], True)}
    stock(x2, positions).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    for (name, p), q in zip(module.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "cls, tag, why",
    [
        (PairsBackwardsAttention, "rotary.interleaved", "its values equal those of none of the op's layouts"),
        (GPTJBackwardsAttention, "rotary.one-tensor", "its values equal those of none of the op's layouts"),
        (Float16Attention, "rotary.form", "its values equal those of none of the op's layouts"),
        (ChunksAttention, "rotary.form", "laid out alike"),
        (OneTableAttention, "rotary.one-table", "reads sin and cos from one table"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_a_near_miss_of_each_layout_is_refused_with_its_tag(cls, tag, why):
    module, stock = _rewritten(cls)
    report = transfuse.report(module)
    assert report.counts() == {}, report
    refusals = [s for s in report.skipped if s.kind == "rotary"]
    assert [s.tag for s in refusals] == [tag] and why in refusals[0].reason, refusals
    x, positions = _inputs()
    with torch.no_grad():
        assert torch.equal(module(x, positions), stock(x, positions))


def test_a_call_with_tables_narrower_than_the_proof_covered_runs_the_function():
    """A function proved for tables as wide as the head (OLMo's) called with narrower ones (a broadcast
    the model never makes): the op hands the call to the function, which fails as it would unfused."""
    _rewritten(OLMoAttention)
    q, k = torch.randn(2, HEADS, 5, HEAD_DIM), torch.randn(2, HEADS, 5, HEAD_DIM)
    cos, sin = _tables(torch.arange(5)[None], HEAD_DIM)
    with ops.trace() as calls:
        fused = ops.rotary(q, k, cos, sin, cast=True, original=rope_olmo)
    assert [c.op for c in calls] == ["rotary"] and all(torch.equal(f, w) for f, w in zip(fused, rope_olmo(q, k, cos, sin)))
    with pytest.raises(RuntimeError, match="must match the size"), ops.trace() as calls:
        ops.rotary(q, k, cos[..., :4], sin[..., :4], cast=True, original=rope_olmo)
    assert calls == []
