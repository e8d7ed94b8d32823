"""No silent skip: ``transfuse.census`` counts fusion opportunities by structure, independently of the
fusers, and a rewrite gives each one it neither fused nor refused a refusal of its own
(``<kind>.unrecognised-form``).

The toys imitate the older forms of transformers' modeling files (the third-party corpus of
``benchmarks/corpus_coverage.py`` holds the real ones): cos and sin indexed by ``position_ids``
inside the rotary function, experts in a ``ModuleList`` looped over with ``torch.where`` and
``index_add_``, a norm written ``weight * (x / sqrt(mean(x * x) + eps))``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from transfuse import census
from transfuse.rewriter.report import FusionRecord, RewriteReport, SkipRecord

HIDDEN, HEADS, VOCAB = 32, 4, 64


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class WeightFirstSqrtNorm(nn.Module):
    """g * (x / sqrt(mean(x * x) + eps)), the weight first."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps))


class PositionIdsRotaryAttention(nn.Module):
    """q, k, v from one input; rotary with cos and sin indexed by position_ids inside the function."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        dim = HIDDEN // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(64).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, hidden_states, position_ids):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, HEADS, -1).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, HEADS, -1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, self.cos_cached, self.sin_cached, position_ids)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.w2 = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class WhereIndexAddMoE(nn.Module):
    """A ModuleList of expert MLPs, looped over with torch.where and index_add_."""

    def __init__(self, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(experts))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        weights, idx = torch.topk(self.gate(h).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, expert(h[rows]) * weights[rows, slot, None])
        return out.reshape(shape)


class ToyDecoder(nn.Module):
    """Embedding, norm, attention, norm, mixture, norm, head: logits from token ids."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.input_norm = WeightFirstSqrtNorm(HIDDEN)
        self.attn = PositionIdsRotaryAttention()
        self.post_norm = WeightFirstSqrtNorm(HIDDEN)
        self.moe = WhereIndexAddMoE()
        self.final_norm = WeightFirstSqrtNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        h = self.embed(input_ids)
        h = h + self.attn(self.input_norm(h), positions)
        h = h + self.moe(self.post_norm(h))
        return self.head(self.final_norm(h))


def _described(found):
    return sorted(o.describe() for o in found)


def test_the_census_counts_each_structure_once():
    torch.manual_seed(0)
    found = census.count(ToyDecoder())
    kinds = sorted(o.kind for o in found)
    assert kinds.count("rms_norm") == 3
    assert [o.describe() for o in found if o.kind == "qkv"] == ["qkv:attn:k_proj+q_proj+v_proj"]
    assert [o.describe() for o in found if o.kind == "rotary"] == ["rotary:attn:apply_rotary_pos_emb"]
    assert [o.describe() for o in found if o.kind == "moe"] == ["moe:moe"]
    # Each expert's own GLU pair (w1, w3 multiplied after an activation).
    assert [o.describe() for o in found if o.kind == "gate_up"] == [f"gate_up:moe.experts.{i}:w1+w3" for i in range(4)]


class DifferentInputs(nn.Module):
    """Two linears on different values, and one value rebound between two calls: no group."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.c = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        first = self.a(x) + self.b(y)
        x = torch.tanh(first)
        return self.c(x) + self.a(x * 2)


class StackedExperts(nn.Module):
    """Experts as a 3-D parameter, routed by a linear layer with one output per expert."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, 4, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(4, HIDDEN, 2 * HIDDEN))

    def forward(self, x):
        return x


class BlockDiagonal(nn.Module):
    """A 3-D weight of blocks with a 2-D bias of the same rows, and no router: not experts."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8, 8))
        self.bias = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return x


class LayerStack(nn.Module):
    """A list of identical layers with two linears each: layers, not experts (no router)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TwoLinearLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.b(self.a(x))


def test_the_census_does_not_count_what_is_not_there():
    assert census.count(DifferentInputs()) == []
    assert census.count(LayerStack()) == []
    stack = LayerStack()
    stack.layers = nn.ModuleList(TwoLinearLayer() for _ in range(3))
    assert census.count(stack) == []
    assert census.count(nn.Conv1d(4, 4, 3)) == []
    assert census.count(BlockDiagonal()) == []
    assert census.count(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU())) == []
    assert _described(census.count(nn.Sequential(nn.RMSNorm(HIDDEN)))) == ["rms_norm:0"]
    assert _described(census.count(StackedExperts())) == ["moe:<model>"]


def test_account_refuses_each_opportunity_no_record_covers():
    found = census.count(ToyDecoder())
    report = RewriteReport()
    report.fusions.append(FusionRecord("input_norm", "WeightFirstSqrtNorm", "rms_norm", ("",), "FusedRMSNorm"))
    report.skipped.append(SkipRecord("PositionIdsRotaryAttention", "rotary", "a reason", "rotary.form"))
    report.skipped.append(SkipRecord("ExpertMLP", "gate_up", "a reason", "gate_up.form", path="moe.experts.0"))
    missing = census.account(found, report)
    assert _described(missing) == [
        "gate_up:moe.experts.1:w1+w3", "gate_up:moe.experts.2:w1+w3", "gate_up:moe.experts.3:w1+w3",
        "moe:moe", "qkv:attn:k_proj+q_proj+v_proj", "rms_norm:final_norm", "rms_norm:post_norm",
    ]  # fmt: skip
    tags = sorted(s.tag for s in report.skipped if s.tag.endswith(".unrecognised-form"))
    assert tags == ["gate_up.unrecognised-form"] * 3 + [f"{k}.unrecognised-form" for k in ("moe", "qkv", "rms_norm", "rms_norm")]
    assert census.unaccounted(found, report) == []
    assert "[qkv.unrecognised-form]" in str(report)


def test_a_rewrite_leaves_no_opportunity_unreported_and_the_model_exact():
    torch.manual_seed(0)
    stock = ToyDecoder().eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(stock)
    found = census.count(stock)
    transfuse.rewrite(model, example_inputs=(ids,))
    report = transfuse.report(model)
    assert census.unaccounted(found, report) == [], str(report)
    # The rule's refusals are exactly what the fusers left neither fused nor refused.
    flagged = {(s.kind, s.path) for s in report.skipped if s.tag.endswith(".unrecognised-form")}
    fusers_only = RewriteReport(report.fusions, [s for s in report.skipped if not s.tag.endswith(".unrecognised-form")])
    assert {(o.kind, o.path) for o in census.unaccounted(found, fusers_only)} == flagged
    for o in found:  # each is in the report by its kind: fused, or refused with a tag
        kinds = ("qkv", "gate_up") if o.kind in ("qkv", "gate_up") else (o.kind, "add_rms_norm")
        assert any(f.kind in kinds for f in report.fusions) or any(s.kind in kinds for s in report.skipped), o
    with torch.no_grad():
        want, got = stock(ids), model(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_only_the_kinds_asked_for_are_accounted():
    stock = ToyDecoder().eval()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    model = copy.deepcopy(stock)
    transfuse.rewrite(model, fusions=["qkv"], example_inputs=(ids,))
    kinds = {s.kind for s in transfuse.report(model).skipped if s.tag.endswith(".unrecognised-form")}
    assert kinds <= {"qkv"}


class MeanSubtractedNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight: a LayerNorm without bias, not a root mean square."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - mean) / torch.sqrt(variance + 1e-5)


def test_a_mean_subtracted_norm_is_not_counted_as_a_root_mean_square():
    assert census.count(MeanSubtractedNorm()) == []
    assert _described(census.count(WeightFirstSqrtNorm(HIDDEN))) == ["rms_norm:<model>"]


def test_an_experts_glu_inside_a_fused_mixture_is_covered_by_it():
    from tests import toys

    torch.manual_seed(0)
    model = toys.TinyMoEModel(toys.ModuleListMoE(experts=4))
    x = torch.randn(2, 7, HIDDEN)
    found = [o for o in census.count(model) if o.kind == "gate_up"]
    assert _described(found) == [f"gate_up:block.experts.{e}:w1+w3" for e in range(4)]
    transfuse.rewrite(model, example_inputs=(x,))
    report = transfuse.report(model)
    (moe,) = [f for f in report.fusions if f.kind == "moe"]
    assert moe.claimed == ("gate", "experts")
    assert all(census.absorbed(o, report) and census.fused(o, report) for o in found)
    assert not any(s.tag == "gate_up.unrecognised-form" for s in report.skipped), str(report)
    # Only the children the mixture claimed: a GLU beside its experts (a shared expert) is not covered.
    shared = census.Opportunity("gate_up", "block.shared", "GLUExpert", "w1+w3")
    assert not census.absorbed(shared, report) and not census.fused(shared, report)
    rms = census.Opportunity("rms_norm", "block.experts.0", "Norm")
    assert not census.absorbed(rms, report)


class SplitForwardAttention(PositionIdsRotaryAttention):
    """q, k and v projected in a method the forward calls, RoPE applied in another (a forward split
    into helpers) → both counted."""

    def forward(self, x, position_ids):
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, position_ids)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def project(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, HEADS, -1).transpose(1, 2)
        return q, k, self.v_proj(x).view(b, t, HEADS, -1).transpose(1, 2)

    def rotate(self, q, k, position_ids):
        return apply_rotary_pos_emb(q, k, self.cos_cached, self.sin_cached, position_ids)


def test_the_census_reads_the_methods_the_forward_calls():
    found = [o.describe() for o in census.count(SplitForwardAttention())]
    assert found == ["qkv:<model>:k_proj+q_proj+v_proj", "rotary:<model>:apply_rotary_pos_emb"]
