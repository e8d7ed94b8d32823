"""Toy modules that imitate Hugging Face idioms, each named for what it imitates.

Each docstring ends in its verdict: "→ fuses" or "→ refused (tag)".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


# ---- RMSNorm written every way a modeling file writes it -----------------------------


class LlamaStyleNorm(nn.Module):
    """float32, cast back, then weight (Llama) → fuses."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaStyleNorm(nn.Module):
    """(1 + weight) in float32, cast last, through a helper method (Gemma) → fuses."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class SquareRsqrtPowNorm(nn.Module):
    """torch.square, pow(-0.5), weight times float32 then cast (OLMo 2 rounding) → fuses."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * (torch.square(h).mean(dim=-1, keepdim=True) + self.eps).pow(-0.5)
        return (self.scale * h).to(x.dtype)


class OperatorSpellingNorm(nn.Module):
    """x * x and ``** -0.5``, computed in the input dtype, no weight → fuses."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * ((x * x).mean(-1, keepdim=True) + self.eps) ** -0.5


class PowOperatorNorm(nn.Module):
    """``x ** 2`` and torch.mean with keyword arguments, zero-centred weight without a cast → fuses."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden) * 0.1)
        self.eps = eps

    def forward(self, x):
        normed = x * torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + self.eps)
        return normed * (1 + self.weight)


def _passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class DecoratedNorm(LlamaStyleNorm):
    """A forward under a functools.wraps decorator (like @deprecate_kwarg) → fuses."""

    @_passthrough
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LayerNormMath(nn.Module):
    """Mean subtraction: LayerNorm, not RMSNorm → refused (rms_norm.mean-subtracted)."""

    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(var + self.eps))


class NormThenGate(nn.Module):
    """qwen3_next's gated norm: the norm cast back and weighted in the input dtype, then times
    silu of the gate in float32, cast back → fuses (GatedRMSNorm)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(dtype)
        h = h * F.silu(gate.to(torch.float32))
        return h.to(dtype)


class Float32NormThenSigmoidGate(nn.Module):
    """kimi_linear's: the weight in float32, a sigmoid gate → fuses (GatedRMSNorm)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, hidden_states, gate):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.to(torch.float32) * h
        return (h * torch.sigmoid(gate.to(torch.float32))).to(dtype)


class UnweightedNormThenGate(nn.Module):
    """No weight, the norm cast back before the gate → fuses (GatedRMSNorm)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, hidden_states, gate):
        h = hidden_states.to(torch.float32)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(hidden_states.dtype)
        return (h * F.gelu(gate.to(torch.float32))).to(hidden_states.dtype)


class GateNamedZ(NormThenGate):
    """The gated form, with the inputs named (x, z) → refused (rms_norm.inputs: keyword callers)."""

    def forward(self, x, z):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.to(torch.float32))).to(dtype)


class GatedRMSNorm(nn.Module):
    """A second input gates the norm before it (Mamba-2 style) → refused (rms_norm.inputs)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x, gate):
        x = x * F.silu(gate)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x


class TrailingComputeNorm(nn.Module):
    """A bias added after the norm → refused (rms_norm.trailing-compute)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return h * 2.0 + 1.0


class WrongDimNorm(nn.Module):
    """The mean over dimension 1, not the last → refused (rms_norm.reduce-dim)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps)


class LiteralEpsNorm(nn.Module):
    """eps written as a literal, not an attribute → refused (rms_norm.eps-source)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class BufferEpsNorm(nn.Module):
    """eps kept in a tensor buffer, not a float attribute → refused (rms_norm.eps-source)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("eps", torch.tensor(1e-6))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class BranchingRMSNorm(nn.Module):
    """A branch on an attribute the trace cannot see both ways → refused (rms_norm.control-flow)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps
        self.skip = False

    def forward(self, x):
        if self.skip:
            return x
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


# ---- tracer idioms ---------------------------------------------------------------------


class DataDependentBranch(nn.Module):
    """A branch on a tensor's values: the trace stops there and keeps the graph before it."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.proj(x)
        s = h.sum()
        if s > 0:
            h = h * 2
        return h


class ShapeUnpacking(nn.Module):
    """``b, s, _ = x.shape`` and a ``*``-splat into view: traces with meta values."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, cache=None):
        bsz, seq, _ = x.shape
        shape = (*x.shape[:-1], self.heads, -1)
        out, _unused = self.proj(x).view(shape), cache
        return out.reshape(bsz, seq, -1)


# ---- small models around the norms, for rewrite() -----------------------------------


class TinyNormModel(nn.Module):
    """Two projections around any norm class; a model for rewrite() without transformers."""

    def __init__(self, norm: nn.Module, hidden: int = 32):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.norm = norm
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


# ---- attention and MLP idioms for the QKV and gate/up fusions ----------------------


def _attend(q, k, v, heads):
    """Causal attention with heads of 8 channels; k and v repeated for grouped queries."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, 8).transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


class WqWkWvAttention(nn.Module):
    """GQA attention with projections named wq/wk/wv (q wider than k and v) → fuses."""

    def __init__(self, hidden=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads = heads
        self.wk = nn.Linear(hidden, kv_heads * 8, bias=False)
        self.wq = nn.Linear(hidden, heads * 8, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * 8, bias=False)
        self.wo = nn.Linear(heads * 8, hidden, bias=False)

    def forward(self, x):
        # keys first: q is still found as the one whose width differs
        k = self.wk(x)
        q = self.wq(x)
        v = self.wv(x)
        return self.wo(_attend(q, k, v, self.heads))


class QueryKeyValueAttention(nn.Module):
    """Multi-head attention with query/key/value (equal widths, with biases) → fuses."""

    def __init__(self, hidden=32):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        return self.dense(_attend(self.query(hidden_states), self.key(hidden_states), self.value(hidden_states), 4))


class ScaleBase(nn.Module):
    def finish(self, x):
        return x * 0.5


class SuperCallingAttention(ScaleBase):
    """A forward that calls zero-argument super() → fuses, and super() still works."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, x):
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return super().finish(_attend(q, k, v, 4))


def _renamed_kwarg(old, new):
    """Like transformers' @deprecate_kwarg: maps an old keyword name to the new one."""

    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorator


class RenamedKwargAttention(nn.Module):
    """A decorated forward whose decorator maps ``scale_by`` to ``scale`` → fuses, decorator kept."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    @_renamed_kwarg("scale_by", "scale")
    def forward(self, x, scale=1.0):
        return _attend(self.q(x), self.k(x), self.v(x), 4) * scale


class ProjectionUsedTwice(nn.Module):
    """q computed twice → refused (qkv.called-twice)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, x):
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return _attend(q, k, v, 4) + self.q(x)


class InputMutatedBetween(nn.Module):
    """The input is scaled in place between the projections → refused (qkv.input-mutated)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, x):
        x = x.clone()
        q = self.q(x)
        x.mul_(2.0)
        k = self.k(x)
        v = self.v(x)
        return _attend(q, k, v, 4)


class AliasedInputs(nn.Module):
    """Same value under two names → refused (qkv.inputs-differ): the syntax cannot prove them equal."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = x
        return _attend(self.q(x), self.k(h), self.v(h), 4)


class CastInputPair(nn.Module):
    """Two projections of one value, one of it cast to float32 (hy_v4's indexer) → refused
    (qkv.inputs-differ): a merged projection would compute both in one dtype."""

    def __init__(self, hidden=32):
        super().__init__()
        self.k = nn.Linear(hidden, hidden)
        self.weights = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.k(x) * self.weights(x.float()).to(x.dtype).sigmoid()


class LinearsInAList(nn.Module):
    """Linears held in a ModuleList and called from the holder's loop on one value (gemma3n's altup
    projections) → the list refused (qkv.module-list): members of a list are not merged."""

    def __init__(self, hidden=32):
        super().__init__()
        self.projections = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(3)])

    def forward(self, x):
        return sum(projection(x) for projection in self.projections)


class FourReaders(nn.Module):
    """A fourth linear (a gate) reads the same input → all four merge (gated attention)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, hidden)

    def forward(self, x):
        return _attend(self.q(x), self.k(x), self.v(x), 4) * torch.sigmoid(self.gate(x))


class SelfOrCrossAttention(nn.Module):
    """One class for self- and cross-attention, as bart's is: k and v read ``memory if is_cross else
    x``. With ``memory`` None, q, k and v provably read x → fuses on that path; the cross path is kept."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, x, memory=None, cache=None):
        is_cross = memory is not None
        q = self.q(x).view(*x.shape[:-1], 4, 8).transpose(1, 2)
        scale = 1.0
        if cache is not None:
            if is_cross:
                scale = 0.5
        source = memory if is_cross else x
        if is_cross and cache is not None and cache.get("reuse"):
            k, v = cache["k"], cache["v"]
        else:
            k = self.k(source).view(*source.shape[:-1], 4, 8).transpose(1, 2)
            v = self.v(source).view(*source.shape[:-1], 4, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=not is_cross)
        return out.transpose(1, 2).reshape(*x.shape) * scale


class SelfThenCross(nn.Module):
    """A decoder layer of one self- and one cross-attention of the same class."""

    def __init__(self, hidden=32):
        super().__init__()
        self.self_attn = SelfOrCrossAttention(hidden)
        self.cross_attn = SelfOrCrossAttention(hidden)
        self.memory = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.self_attn(x) + x
        memory = self.memory(x[:, :3])  # a shorter sequence: the cross path really is another path
        return self.cross_attn(h, memory=memory, cache={}) + h


class RebindsOptionalArgument(nn.Module):
    """``memory = x`` when it is None: the argument is rebound, so no path is specialised → refused
    (qkv.inputs-differ)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, x, memory=None):
        if memory is None:
            memory = x
        return _attend(self.q(x), self.k(memory), self.v(memory), 4)


def make_closure_attention(scale):
    """A class made in a factory: its forward closes over ``scale`` → refused (source.closure)."""

    class ClosureAttention(nn.Module):
        def __init__(self, hidden=32):
            super().__init__()
            self.q = nn.Linear(hidden, hidden)
            self.k = nn.Linear(hidden, hidden)
            self.v = nn.Linear(hidden, hidden)

        def forward(self, x):
            return _attend(self.q(x), self.k(x), self.v(x), 4) * scale

    return ClosureAttention


class NameMangledAttention(nn.Module):
    """A forward reading ``self.__scale`` (stored as ``_NameMangledAttention__scale``) → refused (source.name-mangled)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.__scale = 0.5

    def forward(self, x):
        return _attend(self.q(x), self.k(x), self.v(x), 4) * self.__scale


class FunctionalSiluMLP(nn.Module):
    """``F.silu(gate(x)) * up(x)`` with the function, not a module → fuses."""

    def __init__(self, hidden=32, inner=48):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TorchMulGeluTanhMLP(nn.Module):
    """``torch.mul(up(x), act(gate(x)))``, up first, nn.GELU(approximate="tanh") → fuses."""

    def __init__(self, hidden=32, inner=48):
        super().__init__()
        self.gate = nn.Linear(hidden, inner)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down(torch.mul(self.up(x), self.act(self.gate(x))))


class ReluGLU(nn.Module):
    """A ReLU-gated GLU: the fused op has no relu → only the projections merge."""

    def __init__(self, hidden=32, inner=48):
        super().__init__()
        self.gate = nn.Linear(hidden, inner)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Wrapper(nn.Module):
    """Holds one module under ``inner``, as a decoder layer holds its attention."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + x


# ---- mixtures of experts written the ways modeling files write them ---------------------


class GLUExpert(nn.Module):
    """One expert of an ``nn.ModuleList``: ``w2(silu(w1(x)) * w3(x))`` (trust_remote_code style)."""

    def __init__(self, hidden, inter, bias=False):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=bias)
        self.w2 = nn.Linear(inter, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, inter, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class ModuleListMoE(nn.Module):
    """Linear gate, softmax/top-k in the block, ``nn.ModuleList`` experts, returns (out, logits) → fuses."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2, bias=False):
        super().__init__()
        self.hidden_dim, self.num_experts, self.top_k = hidden, experts, top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([GLUExpert(hidden, inter, bias) for _ in range(experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class PackedExperts(nn.Module):
    """Experts as 3-D tensors ``[E, H, 2I]`` / ``[E, I, H]`` applied with ``@`` (a transposed layout)."""

    def __init__(self, hidden, inter, experts):
        super().__init__()
        self.num_experts = experts
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * inter) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, inter, hidden) / inter**0.5)

    def forward(self, x, routing_weights, selected):
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=self.num_experts + 1).permute(2, 0, 1)  # [E+1, tokens, k]
        for expert in torch.greater(mask.sum(dim=(1, 2)), 0).nonzero():
            expert = expert[0]
            if expert == self.num_experts:
                continue
            token, slot = torch.where(mask[expert])
            gate, up = (x[token] @ self.gate_up[expert]).chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
            out.index_add_(0, token, (h @ self.down[expert]) * routing_weights[token, slot].unsqueeze(-1))
        return out


class SigmoidRouter(nn.Module):
    """Sigmoid scores, a correction bias that steers the choice, renormalised and scaled weights."""

    def __init__(self, hidden, experts, top_k, scale=1.5):
        super().__init__()
        self.top_k = top_k
        self.routed_scaling_factor = scale
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.register_buffer("expert_bias", torch.randn(experts) * 0.1)

    def forward(self, x):
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.routed_scaling_factor


class SharedExpertMoE(nn.Module):
    """Sigmoid router (returns ids first), packed transposed experts, a shared expert behind a
    sigmoid gate, experts called with keyword arguments → fuses."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=3):
        super().__init__()
        self.router = SigmoidRouter(hidden, experts, top_k)
        self.experts = PackedExperts(hidden, inter, experts)
        self.shared = GLUExpert(hidden, 24)
        self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        chosen, weights = self.router(tokens)
        routed = self.experts(tokens, routing_weights=weights, selected=chosen)
        shared = torch.sigmoid(self.shared_gate(tokens)) * self.shared(tokens)
        return (shared + routed).view(shape)


class ExpertUsage(nn.Module):
    """Counts how often each expert is chosen, in a buffer: state the fused layer would not update."""

    def __init__(self, experts):
        super().__init__()
        self.register_buffer("counts", torch.zeros(experts))

    def forward(self, ids):
        self.counts += torch.bincount(ids.flatten(), minlength=self.counts.numel())
        return ids


class StatefulChildMoE(ModuleListMoE):
    """A child that records expert usage as a side effect → refused (moe.unaccounted)."""

    def __init__(self):
        super().__init__()
        self.usage = ExpertUsage(8)

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        logits = self.gate(tokens)
        weights, selected = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        self.usage(selected)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[expert_idx].squeeze(0))
            contribution = self.experts[expert_idx](tokens[token]) * weights[token, slot, None]
            out.index_add_(0, token, contribution.to(tokens.dtype))
        return out.view_as(hidden_states)


class TemperatureRoutedMoE(ModuleListMoE):
    """Routing weights divided by a temperature, a formula transfuse does not know → refused (moe.routing-form)."""

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        weights, selected = torch.topk(self.gate(tokens), self.top_k, dim=-1)
        weights = torch.softmax(weights / 0.7, dim=-1)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[expert_idx].squeeze(0))
            out.index_add_(0, token, self.experts[expert_idx](tokens[token]) * weights[token, slot, None])
        return out.view_as(hidden_states)


class SkipsFirstExpertMoE(nn.Module):
    """Packed experts whose loop skips expert 0, a real expert → refused (moe.loop-form)."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2):
        super().__init__()
        self.router = SigmoidRouter(hidden, experts, top_k)
        self.experts = SkippingExperts(hidden, inter, experts)

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        chosen, weights = self.router(tokens)
        return self.experts(tokens, weights, chosen).view_as(hidden_states)


class EveryTokenExperts(nn.Module):
    """Packed experts run on every token with batched matmuls, inputs pre-scaled by their routing
    scores (llama4's form)."""

    def __init__(self, hidden=32, inter=16, experts=8):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * inter) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, inter, hidden) / inter**0.5)

    def forward(self, x):  # [E * tokens, hidden], grouped by expert
        x = x.view(self.gate_up.shape[0], -1, x.shape[-1])
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down).view(-1, x.shape[-1])


class EveryTokenMoE(nn.Module):
    """Every expert computes every token, scaled by a sigmoid of its router logit (llama4) → refused
    (moe.dense-experts): not passed over in silence."""

    def __init__(self, hidden=32, experts=8):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = EveryTokenExperts(hidden, 16, experts)

    def forward(self, hidden_states):
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores = torch.sigmoid(self.router(tokens)).transpose(0, 1).reshape(-1, 1)  # [E * tokens, 1]
        routed = self.experts(tokens.repeat(self.router.out_features, 1) * scores)
        return routed.view(self.router.out_features, *tokens.shape).sum(0).view_as(hidden_states)


class BiasedEveryTokenExperts(EveryTokenExperts):
    """As EveryTokenExperts, with a bias on the down projection: a zero row no longer gives zero."""

    def __init__(self, hidden=32, inter=16, experts=8):
        super().__init__(hidden, inter, experts)
        self.bias = nn.Parameter(torch.randn(experts, 1, hidden))

    def forward(self, x):
        x = x.view(self.gate_up.shape[0], -1, x.shape[-1])
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return (torch.bmm(F.silu(gate) * up, self.down) + self.bias).view(-1, x.shape[-1])


class MaskedScoresMoE(nn.Module):
    """Every expert computes every token, its row scaled by the token's score for the expert: a sigmoid
    (or softmax) of the top-k logits scattered into -inf, so zero at the experts not chosen; a shared
    expert added in place (llama4's form) → fused, the routing weights on the input."""

    def __init__(self, hidden=32, experts=8, top_k=2, softmax=False, experts_cls=EveryTokenExperts):
        super().__init__()
        self.top_k, self.softmax = top_k, softmax
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = experts_cls(hidden, 16, experts)
        self.shared = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states):
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = self.router(tokens)
        top, ids = torch.topk(logits, self.top_k, dim=1)
        masked = torch.full_like(logits, float("-inf")).scatter_(1, ids, top)
        scores = (masked.float().softmax(dim=-1) if self.softmax else torch.sigmoid(masked.float())).to(masked.dtype)
        rows = tokens.repeat(self.router.out_features, 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = self.shared(tokens)
        out.add_(self.experts(rows).reshape(self.router.out_features, -1, tokens.shape[-1]).sum(dim=0))
        return out.view_as(hidden_states)


class BiasedMaskedScoresMoE(MaskedScoresMoE):
    """Experts with a bias (a zero row gives the bias, not zero) → refused (moe.dense-experts)."""

    def __init__(self):
        super().__init__(experts_cls=BiasedEveryTokenExperts)


class ReadBeforeAddMoE(MaskedScoresMoE):
    """The shared output is read before the routed sum is added into it in place → refused: the
    value read there is not the sum."""

    def forward(self, hidden_states):
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = self.router(tokens)
        top, ids = torch.topk(logits, self.top_k, dim=1)
        scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter_(1, ids, top))
        rows = tokens.repeat(self.router.out_features, 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = self.shared(tokens)
        before = out * 2
        out.add_(self.experts(rows).reshape(self.router.out_features, -1, tokens.shape[-1]).sum(dim=0))
        return (out + before).view_as(hidden_states)


class SkippingExperts(PackedExperts):
    skip = 0

    def forward(self, x, routing_weights, selected):
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 0, 1)
        for expert in torch.greater(mask.sum(dim=(1, 2)), 0).nonzero():
            expert = expert[0]
            if expert == self.skip:
                continue
            token, slot = torch.where(mask[expert])
            gate, up = (x[token] @ self.gate_up[expert]).chunk(2, dim=-1)
            out.index_add_(0, token, ((F.silu(gate) * up) @ self.down[expert]) * routing_weights[token, slot, None])
        return out


class RangeLoopMoE(ModuleListMoE):
    """A loop over every expert index (``range``), unrolled by tracing → fuses (each iteration reads its own expert)."""

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        weights, selected = torch.topk(F.softmax(self.gate(tokens), dim=-1, dtype=torch.float), self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            slot, token = torch.where(mask[expert_idx])
            out.index_add_(0, token, self.experts[expert_idx](tokens[token]) * weights[token, slot, None])
        return out.view_as(hidden_states)


class JitterMoE(ModuleListMoE):
    """Multiplicative input jitter in training mode (Mixtral's router_jitter_noise): fuses; with a
    non-zero jitter the fused layer refuses to run in training mode."""

    def __init__(self, jitter=0.0):
        super().__init__()
        self.jitter_noise = jitter

    def forward(self, hidden_states):
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        return super().forward(hidden_states)[0]


class TinyMoEModel(nn.Module):
    """Projections around a mixture-of-experts block, for rewrite() without transformers."""

    def __init__(self, block: nn.Module, hidden: int = 32):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.block = block
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.block(self.inp(x))
        return self.out(h[0] if isinstance(h, tuple) else h)


# ---- fail-closed verification: holes a rewrite must not fall through --------------------


def _doubled_if_flat(x):
    """A module-level helper whose branch depends on the input's shape."""
    if x.dim() == 2:
        return x * 2
    return x


class HelperShapeBranchNorm(LlamaStyleNorm):
    """RMSNorm whose forward calls a module-level helper that doubles 2-D inputs: traced on 3-D
    inputs it looks like a plain norm → refused (rms_norm.control-flow)."""

    def forward(self, hidden_states):
        hidden_states = _doubled_if_flat(hidden_states)
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class InlineShapeBranchNorm(LlamaStyleNorm):
    """A size read straight into a conditional expression (``x * 2 if s == 1 else x``), no
    statement-level branch in sight of a line-based check → refused (rms_norm.control-flow)."""

    def forward(self, hidden_states):
        seq = hidden_states.shape[1]
        scale = 2.0 if seq == 1 else 1.0
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype) * scale


class ShapeBranchMoE(ModuleListMoE):
    """A block that routes a single token differently (skips the renormalisation): the probe's
    tokens take the other path → refused (moe.control-flow)."""

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if batch_size * sequence_length > 1:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class SpareNormModel(nn.Module):
    """Two norms of one class, of which the forward calls only the first, and a norm of another
    class it never calls: the spare of the called class borrows its sibling's inputs (→ fuses,
    verified), the other cannot be checked (→ refused, verify.not-reached)."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.norm = LlamaStyleNorm(hidden)
        self.spare = LlamaStyleNorm(hidden)
        self.unused = GemmaStyleNorm(hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


class ReadsChildWeightModel(nn.Module):
    """A model whose forward reads a projection's registered parameter from outside its attention:
    the attention fuses and checks out alone, and the model then fails (the merged projection's
    part under that name is a view, with no parameter of its own)."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.attn = WqWkWvAttention(hidden)

    def forward(self, x):
        return self.attn(x) * self.attn.wq._parameters["weight"].norm()


class _GLUProjections(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.gate = nn.Linear(hidden, 64)
        self.up = nn.Linear(hidden, 64)
        self.down = nn.Linear(64, hidden)


class CastAroundGLU(_GLUProjections):
    """The activation and product in float32, cast back (beam) → only the projections merge."""

    def forward(self, x):
        gate = self.gate(x)
        return self.down((F.silu(gate.float()) * self.up(x).float()).to(gate.dtype))


class ActivatedGateInAVariable(_GLUProjections):
    """The activated gate kept in a variable, multiplied in the next statement (recurrent_gemma):
    not one act_and_mul expression → only the projections merge."""

    def forward(self, x):
        gate = F.gelu(self.gate(x), approximate="tanh")
        return self.down(gate * self.up(x))


class InPlaceBetweenGLU(_GLUProjections):
    """A gate scaled in place between the two calls: the source proof cannot rule out that the
    write reaches x → refused (gate_up.input-mutated)."""

    def forward(self, x):
        gate = self.gate(x)
        gate.mul_(0.5)
        return self.down(F.silu(gate) * self.up(x))


class ScaledGateGLU(_GLUProjections):
    """A scalar factor on the gate before the activation (falcon_h1) → only the projections merge."""

    gate_multiplier = 0.5

    def forward(self, x):
        return self.down(self.up(x) * F.silu(self.gate(x) * self.gate_multiplier))
