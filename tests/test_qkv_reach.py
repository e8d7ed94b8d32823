"""QKV where the trace has to reach the projections: a module the probe never called (a decoder's
cross-attention in a run without an encoder) is traced with the call of a reached module of its
class; ``torch.finfo(x.dtype)`` ahead of the projections reads the traced dtype; projections
called in a method the forward calls are refused by name. Toys imitating the idioms (each shape
read as ``bsz, q_len, _ = hidden_states.size()``), against their unmodified selves: outputs bit
for bit in fp32, gradients; and the traces themselves, counted."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from transfuse import census
from transfuse.ops import MergedProjection
from transfuse.rewriter.analysis import analyse, clear_cache
from transfuse.rewriter.capture import make_probe, record_calls
from transfuse.rewriter.tracer import _info_reading_traced_dtypes, trace_module


class SelfOrCrossAttention(nn.Module):
    """bart's attention of 4.x: one class for self- and cross-attention (k and v read
    ``key_value_states`` where it is given), the shape unpacked from ``size()``, and a causal flag
    the forward branches on (so the self- and cross-attention instances have traces of their own)."""

    def __init__(self, hidden: int = 32, heads: int = 4, is_causal: bool = True):
        super().__init__()
        self.heads, self.head_dim, self.is_causal = heads, hidden // heads, is_causal
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, key_value_states=None):
        bsz, q_len, _ = hidden_states.size()
        query = self.q_proj(hidden_states)
        if key_value_states is None:
            key = self.k_proj(hidden_states)
            value = self.v_proj(hidden_states)
        else:
            key = self.k_proj(key_value_states)
            value = self.v_proj(key_value_states)
        q = query.view(bsz, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = key.view(bsz, -1, self.heads, self.head_dim).transpose(1, 2)
        v = value.view(bsz, -1, self.heads, self.head_dim).transpose(1, 2)
        if self.is_causal:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class OnlyCrossAttention(SelfOrCrossAttention):
    """The same attention under a class of its own, used only for cross-attention: where the probe
    has no encoder states, no module of its class is reached."""


class DecoderLayer(nn.Module):
    def __init__(self, cross: type = SelfOrCrossAttention):
        super().__init__()
        self.self_attn = SelfOrCrossAttention(is_causal=True)
        self.cross_attn = cross(is_causal=False)

    def forward(self, x, memory=None):
        h = x + self.self_attn(x)
        if memory is not None:
            h = h + self.cross_attn(h, key_value_states=memory)
        return h


class Decoder(nn.Module):
    """Two decoder layers; the cross-attention runs only where encoder states are passed."""

    def __init__(self, cross: type = SelfOrCrossAttention):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(cross) for _ in range(2)])

    def forward(self, x, memory=None):
        for layer in self.layers:
            x = layer(x, memory)
        return x


class MinFilledAttention(nn.Module):
    """The fill value of a mask read as ``torch.finfo(hidden_states.dtype).min`` before the
    projections (bloom, codegen, mpt and gpt_neox of 4.x fill scores this way): the dtype of a traced
    value is a node, which ``torch.finfo`` itself does not take → fuses."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        fill = torch.finfo(hidden_states.dtype).min
        q = self.q(hidden_states).view(bsz, q_len, self.heads, -1).transpose(1, 2)
        k = self.k(hidden_states).view(bsz, q_len, self.heads, -1).transpose(1, 2)
        v = self.v(hidden_states).view(bsz, q_len, self.heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        future = torch.ones(q_len, q_len, dtype=torch.bool, device=scores.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, fill), dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(bsz, q_len, -1))


class ProjectedInAMethod(nn.Module):
    """q, k and v projected in a method the forward calls (``self._project(hidden_states)``) →
    refused (qkv.in-method): an edit rewrites the forward's source only."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def _project(self, hidden_states):
        return self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.size()
        q, k, v = (t.view(bsz, q_len, 4, -1).transpose(1, 2) for t in self._project(hidden_states))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(bsz, q_len, -1))


class Residual(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


@pytest.fixture(autouse=True)
def _fresh_analyses():
    """Analyses are cached per class: each test traces its toys itself."""
    clear_cache()
    yield
    clear_cache()


def _rewritten(stock: nn.Module, x: torch.Tensor) -> nn.Module:
    model = copy.deepcopy(stock)
    transfuse.rewrite(model, example_inputs=(x,))
    return model


def _same_outputs_and_gradients(stock: nn.Module, model: nn.Module, *inputs: torch.Tensor) -> None:
    """Outputs equal bit for bit (widths of whole 16-column blocks: CPU BLAS sums each column alike,
    merged or not); each parameter's gradient equal, a merged weight's to its parts' stacked (to
    rounding: the input's gradient is one matmul instead of a sum of the parts')."""
    with torch.no_grad():
        assert torch.equal(model(*inputs), stock(*inputs))
    model(*inputs).square().sum().backward()
    stock(*inputs).square().sum().backward()
    merged = {}
    for fusion in transfuse.report(model).fusions:
        (into,) = [n for n, c in model.get_submodule(fusion.path).named_children() if isinstance(c, MergedProjection)]
        merged[f"{fusion.path}.{into}"] = [f"{fusion.path}.{part}" for part in fusion.replaced]
    stock_grads = {name: p.grad for name, p in stock.named_parameters()}
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        parts = [stock_grads[f"{p}.{kind}"] for p in merged[owner]] if owner in merged else [stock_grads[name]]
        if all(g is None for g in parts):  # a module the inputs do not reach (the cross-attention without memory)
            assert param.grad is None, name
            continue
        torch.testing.assert_close(param.grad, torch.cat(parts), msg=name)


def _called_children(trace) -> list[str]:
    return [n.target for n in trace.graph.nodes if n.op == "call_module"]


def test_a_module_the_probe_never_called_is_traced_with_the_call_of_one_of_its_class():
    """Without a call, ``bsz, q_len, _ = hidden_states.size()`` has nothing to unpack and the trace
    stops before any projection; with the self-attention's call, it reaches all four."""
    torch.manual_seed(0)
    model, x = Decoder(), torch.randn(2, 5, 32)
    probe = record_calls(model, make_probe(model, (x,)))
    assert "layers.0.cross_attn" not in probe.calls and "layers.0.self_attn" in probe.calls
    cross = model.layers[0].cross_attn
    alone = trace_module(cross)
    assert alone.partial and "iteration over the value of size" in alone.stop_reason
    assert _called_children(alone) == []
    analysis = analyse(cross, "layers.0.cross_attn", probe)
    assert analysis.borrowed_from == "layers.0.self_attn" and analysis.had_example
    assert not analysis.trace.partial, analysis.trace.describe_stop()
    assert _called_children(analysis.trace) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    # Specialised on its own flag: the self-attention's trace does not describe it.
    assert analysis.trace.specialisation == {"is_causal": False}
    assert analyse(model.layers[0].self_attn, "layers.0.self_attn", probe) is not analysis


def test_unreached_cross_attention_fuses_and_both_paths_stay_exact():
    torch.manual_seed(0)
    stock, x, memory = Decoder(), torch.randn(2, 5, 32), torch.randn(2, 3, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    fused = sorted(f.path for f in report.fusions if f.kind == "qkv")
    assert fused == [f"layers.{i}.{a}" for i in (0, 1) for a in ("cross_attn", "self_attn")], report
    assert report.skipped == [], report
    assert "if key_value_states is None:" in transfuse.diff(model)
    _same_outputs_and_gradients(stock, model, x)
    stock.zero_grad(), model.zero_grad()
    _same_outputs_and_gradients(stock, model, x, memory)  # the cross path runs the original code


def test_a_module_no_call_of_its_class_reached_is_refused_as_not_reached():
    torch.manual_seed(0)
    stock, x = Decoder(cross=OnlyCrossAttention), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert sorted(f.path for f in report.fusions) == ["layers.0.self_attn", "layers.1.self_attn"]
    (skip,) = report.skipped
    assert skip.tag == "qkv.not-reached" and skip.cls == "OnlyCrossAttention"
    assert skip.reason.startswith("the probe input never reached this module, nor another of its class")
    assert "before 4 of its 4 linear children" in skip.reason and "iteration over the value of size" in skip.reason
    assert census.unaccounted(census.count(stock), report) == []
    _same_outputs_and_gradients(stock, model, x)


def test_finfo_of_a_traced_dtype_no_longer_stops_the_trace():
    torch.manual_seed(0)
    module, x = MinFilledAttention(), torch.randn(2, 5, 32)
    trace = trace_module(module, ((x,), {}))
    assert not trace.partial, trace.describe_stop()
    assert _called_children(trace) == ["q", "k", "v", "o"]
    fill = next(n for n in trace.graph.nodes if n.op == "call_method" and n.target == "masked_fill")
    assert fill.args[2] == torch.finfo(torch.float32).min
    assert any(g.op == "call_function" and g.args[1:] == ("dtype",) for g in trace.guards)  # read as a guard
    # Put back after the trace: the types themselves, whose instances they make.
    assert type(torch.finfo(torch.float16)) is torch.finfo and type(torch.iinfo(torch.int8)) is torch.iinfo


def test_the_finfo_of_a_trace_makes_and_recognises_the_real_types_instances():
    stand_in = _info_reading_traced_dtypes(torch.finfo)
    assert type(stand_in(torch.bfloat16)) is torch.finfo and stand_in(torch.bfloat16).eps == torch.finfo(torch.bfloat16).eps
    assert isinstance(torch.finfo(torch.float32), stand_in) and not isinstance(torch.iinfo(torch.int8), stand_in)


def test_finfo_before_the_projections_fuses():
    torch.manual_seed(0)
    stock, x = Residual(MinFilledAttention()), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert [(f.path, f.replaced) for f in report.fusions] == [("inner", ("q", "k", "v"))], report
    assert report.skipped == []
    _same_outputs_and_gradients(stock, model, x)


def test_projections_in_a_method_the_forward_calls_are_refused_by_name():
    torch.manual_seed(0)
    stock, x = Residual(ProjectedInAMethod()), torch.randn(2, 5, 32)
    (found,) = [o for o in census.count(stock) if o.kind == "qkv"]
    assert (found.path, found.detail) == ("inner", "k+q+v")
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert report.fusions == []
    (skip,) = report.skipped
    assert skip.tag == "qkv.in-method"
    assert skip.reason == (
        "self.q is called in self._project, a method that forward calls, not in forward: "
        "the merge rewrites the source of forward only."
    )
    assert census.unaccounted([found], report) == []
    assert transfuse.diff(model) == ""
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
