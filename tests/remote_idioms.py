"""Modules written the way third-party modeling files write them (not transformers' own code):
weight-slicing branches on a configuration value, a GLU repeated in both arms of a dtype test,
and projections the file already merges (``W_pack``, ``query_key_value``, a chunked ``gate_up``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def config(pretraining_tp=1, hidden=32, heads=4, inner=48, rotary=False):
    return SimpleNamespace(
        pretraining_tp=pretraining_tp, hidden_size=hidden, num_attention_heads=heads, intermediate_size=inner,
        rms_norm_eps=1e-6, rotary=rotary,
    )


def _attend(q, k, v, heads):
    b, s, h = q.shape
    q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(h // heads)
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, s, h)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def _heads(t, heads):
    b, s, h = t.shape
    return t.view(b, s, heads, h // heads).transpose(1, 2)


def _attend_heads(q, k, v):
    b, n, s, d = q.shape
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, n * d)


def position_embeddings(batch, seq, head_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, head_dim)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class SlicingAttention(nn.Module):
    """Llama-1 remote-code attention: ``if self.config.pretraining_tp > 1`` slices the weights."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states):
        if self.config.pretraining_tp > 1:
            slicing = self.hidden_size // self.config.pretraining_tp
            q_slices = self.q_proj.weight.split(slicing, dim=0)
            k_slices = self.k_proj.weight.split(slicing, dim=0)
            v_slices = self.v_proj.weight.split(slicing, dim=0)
            query_states = torch.cat([F.linear(hidden_states, q) for q in q_slices], dim=-1)
            key_states = torch.cat([F.linear(hidden_states, k) for k in k_slices], dim=-1)
            value_states = torch.cat([F.linear(hidden_states, v) for v in v_slices], dim=-1)
        else:
            query_states = self.q_proj(hidden_states)
            key_states = self.k_proj(hidden_states)
            value_states = self.v_proj(hidden_states)
        out = _attend(query_states, key_states, value_states, self.num_heads)
        if self.config.pretraining_tp > 1:
            out = out.split(self.hidden_size // self.config.pretraining_tp, dim=2)
            o_slices = self.o_proj.weight.split(self.hidden_size // self.config.pretraining_tp, dim=1)
            return sum(F.linear(out[i], o_slices[i]) for i in range(self.config.pretraining_tp))
        return self.o_proj(out)


class SdpaFallbackAttention(SlicingAttention):
    """The SDPA subclass of the slicing attention: its own forward, which hands a call that asks for
    the attention weights to the base class's forward (``super().forward``), whose sliced arm reads
    the projections' weights."""

    def forward(self, hidden_states, output_attentions=False):
        if output_attentions:
            return super().forward(hidden_states)
        query_states = _heads(self.q_proj(hidden_states), self.num_heads)
        key_states = _heads(self.k_proj(hidden_states), self.num_heads)
        value_states = _heads(self.v_proj(hidden_states), self.num_heads)
        out = F.scaled_dot_product_attention(query_states, key_states, value_states)
        b, n, s, d = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, n * d))


class PrunableAttention(SdpaFallbackAttention):
    """An attention with a method that rebinds a projection (``prune_heads``): a merged projection
    would then compute a module no longer there."""

    def prune_heads(self, keep):
        self.q_proj = nn.Linear(self.hidden_size, keep, bias=False)


class SharedCrossAttention(nn.Module):
    """Bart's attention of the 4.3x-4.4x releases, used for self- and cross-attention: q from
    ``hidden_states``; k and v from ``key_value_states`` when given, reused from the cache in
    cross-attention, else projected from ``hidden_states`` and appended to the cache."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=True)
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=True)

    def forward(self, hidden_states, key_value_states=None, past_key_value=None):
        is_cross_attention = key_value_states is not None
        # get query proj
        query_states = self.q_proj(hidden_states) * 0.5
        if is_cross_attention and past_key_value is not None:
            key_states = past_key_value[0]
            value_states = past_key_value[1]
        elif is_cross_attention:
            key_states = _heads(self.k_proj(key_value_states), self.num_heads)
            value_states = _heads(self.v_proj(key_value_states), self.num_heads)
        elif past_key_value is not None:
            key_states = _heads(self.k_proj(hidden_states), self.num_heads)
            value_states = _heads(self.v_proj(hidden_states), self.num_heads)
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        else:
            key_states = _heads(self.k_proj(hidden_states), self.num_heads)
            value_states = _heads(self.v_proj(hidden_states), self.num_heads)
        past_key_value = (key_states, value_states)
        query_states = _heads(query_states, self.num_heads)
        out = _attend_heads(query_states, key_states, value_states)
        return self.out_proj(out), past_key_value


class SlicingMLP(nn.Module):
    """Llama-1 remote-code MLP: ``if self.pretraining_tp > 1`` (an attribute copied off the config)."""

    def __init__(self, config):
        super().__init__()
        self.pretraining_tp = config.pretraining_tp
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        if self.pretraining_tp > 1:
            slice = self.gate_proj.weight.shape[0] // self.pretraining_tp
            gate_proj_slices = self.gate_proj.weight.split(slice, dim=0)
            up_proj_slices = self.up_proj.weight.split(slice, dim=0)
            down_proj_slices = self.down_proj.weight.split(slice, dim=1)
            gate_proj = torch.cat([F.linear(x, gate_proj_slices[i]) for i in range(self.pretraining_tp)], dim=-1)
            up_proj = torch.cat([F.linear(x, up_proj_slices[i]) for i in range(self.pretraining_tp)], dim=-1)
            intermediate_states = (self.act_fn(gate_proj) * up_proj).split(slice, dim=2)
            down_proj = [F.linear(intermediate_states[i], down_proj_slices[i]) for i in range(self.pretraining_tp)]
            down_proj = sum(down_proj)
        else:
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class DtypeArmsMLP(nn.Module):
    """The same GLU written in both arms of a test on the input's dtype."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        if x.dtype == torch.float16:
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            y = y.clamp(-65000, 65000)
        else:
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y


class ChunkedGateUpMLP(nn.Module):
    """One ``gate_up_proj`` linear whose output is chunked: ``gate, up = ...chunk(2, dim=-1)``."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class UpFirstGateUpMLP(nn.Module):
    """The merged halves in the other order: ``up, gate = w12(x).split(inner, dim=-1)``."""

    def __init__(self, config):
        super().__init__()
        self.inner = config.intermediate_size
        self.w12 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        up, gate = self.w12(x).split(self.inner, dim=-1)
        return self.w3(up * F.silu(gate))


class WPackAttention(nn.Module):
    """Baichuan-style: ``W_pack`` gives q, k, v in one linear, unflattened then indexed."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings):
        proj = self.W_pack(hidden_states)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states = _heads(proj[0], self.num_heads)
        key_states = _heads(proj[1], self.num_heads)
        value_states = _heads(proj[2], self.num_heads)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return self.o_proj(_attend_heads(query_states, key_states, value_states))


class QueryKeyValueAttention(nn.Module):
    """Falcon/GPT-NeoX-style: ``query_key_value`` then ``split``."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=True)

    def forward(self, hidden_states, position_embeddings):
        q, k, v = self.query_key_value(hidden_states).split(self.hidden_size, dim=-1)
        q, k, v = (_heads(t, self.num_heads) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return self.dense(_attend_heads(q, k, v))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer around an attention and an MLP of the classes given."""

    def __init__(self, config, attention, mlp):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp(config)

    def forward(self, hidden_states, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if position_embeddings is None:
            hidden_states = self.self_attn(hidden_states)
        else:
            hidden_states = self.self_attn(hidden_states, position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class Decoder(nn.Module):
    def __init__(self, config, attention=SlicingAttention, mlp=SlicingMLP, layers=2):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config, attention, mlp) for _ in range(layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states):
        position = None
        if self.config.rotary:
            b, s, h = hidden_states.shape
            cos, sin = position_embeddings(b, s, h // self.config.num_attention_heads)
            position = cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position)
        return self.norm(hidden_states)
