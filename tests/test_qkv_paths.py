"""QKV on one path of a forward: a projection that may be None, a flag that takes k and v from
elsewhere, and the two together; and the projections of one value called before a child that
also reads it. Toys imitating the idioms, each against its unmodified self (outputs bit for bit
in fp32, gradients), refusals, and the real tiny types."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from transfuse.ops import MergedProjection

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import coverage  # noqa: E402


class OptionalInjection(nn.Module):
    """A projection that some instances lack (``nn.Linear(...) if use else None``), tested with
    ``is None`` before its call: with it not None the body is specialised and the two projections of
    ``x`` merge → fuses (where it is None the instance keeps its forward)."""

    def __init__(self, combine: bool = True):
        super().__init__()
        self.down = nn.Linear(32, 16, bias=False)
        self.up = nn.Linear(16, 32, bias=False)
        self.inject = nn.Linear(32, 32, bias=False) if combine else None

    def forward(self, x):
        mix = torch.sigmoid(self.up(F.silu(self.down(x) / 4)))
        mixed = mix * x
        if self.inject is None:
            return mixed
        return mixed + torch.sigmoid(self.inject(x))


class KeyIsValueOrShared(nn.Module):
    """v may be None (v is k: ``self.v(x) if self.v is not None else k``) and a flag takes k and v
    from an earlier layer (``if self.shares_kv: k, v = shared[...]``): on the path where v is a
    projection and the flag is false, q, k and v read one value → fuses, under both tests; where v is
    None, q and k merge under the flag's test alone."""

    def __init__(self, key_is_value: bool = False, shares_kv: bool = False):
        super().__init__()
        self.shares_kv = shares_kv
        self.stores_kv = not shares_kv
        self.q = nn.Linear(32, 32)
        if not shares_kv:
            self.k = nn.Linear(32, 16)
            self.v = nn.Linear(32, 16) if not key_is_value else None
        self.o = nn.Linear(32, 32)

    def forward(self, x, shared: dict):
        shape = (*x.shape[:-1], -1, 8)
        q = self.q(x).view(shape)
        q = q * 0.5
        if self.shares_kv:
            k, v = shared["kv"]
        else:
            k = self.k(x).view(shape)
            v = self.v(x).view(shape) if self.v is not None else k
            k = torch.tanh(k)
        if self.stores_kv:
            shared["kv"] = k, v
        k, v = k.repeat_interleave(2, dim=-2), v.repeat_interleave(2, dim=-2)
        weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k), dim=-1)
        return self.o(torch.einsum("bhqk,bkhd->bqhd", weights, v).flatten(-2))


class FlagSetInForward(nn.Module):
    """The flag that selects where k and v come from is assigned in the forward: its value through
    one call is not the attribute's, so no path is specialised → refused (placement)."""

    def __init__(self):
        super().__init__()
        self.warm = False
        self.q = nn.Linear(32, 32)
        self.k = nn.Linear(32, 32)
        self.v = nn.Linear(32, 32)

    def forward(self, x):
        q = self.q(x)
        if self.warm:
            k, v = q, q
        else:
            self.warm = x.shape[0] > 100
            k, v = self.k(x), self.v(x)
        return q * k + v


class Gate(nn.Module):
    """A child that reads the projections' input: what it does to the value the class cannot see."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return torch.sigmoid(self.a(x))


class ProjectionsAroundAChild(nn.Module):
    """Linear attention's inputs: q, k and v read ``x``, then a child reads it, then two more
    projections of it (kimi_linear's ``forget_gate`` before ``b_proj`` and ``g_a_proj``) → the three
    before the child merge; the two after stay as written."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32, bias=False)
        self.k = nn.Linear(32, 32, bias=False)
        self.v = nn.Linear(32, 32, bias=False)
        self.gate = Gate()
        self.b = nn.Linear(32, 16, bias=False)
        self.g = nn.Linear(32, 16, bias=False)
        self.o = nn.Linear(16, 32, bias=False)

    def forward(self, x):
        mixed = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)
        q, k, v = mixed.split(32, dim=-1)
        decay = self.gate(x)
        beta = torch.sigmoid(self.b(x))
        state = (q * k).unflatten(-1, (2, 16)).sum(-2) * decay + beta
        return self.o(state * self.g(x)) + v


class ChildAfterTheFirst(nn.Module):
    """A child reads ``x`` right after the first projection: fewer than two come before it → refused,
    naming the child."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)
        self.k = nn.Linear(32, 32)
        self.v = nn.Linear(32, 32)
        self.gate = Gate()

    def forward(self, x):
        q = self.q(x)
        decay = self.gate(x)
        return q * self.k(x) + self.v(x) * decay.repeat(1, 1, 2)


class Injections(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([OptionalInjection(), OptionalInjection(combine=False), OptionalInjection()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return x


class Attentions(nn.Module):
    """A stack like gemma4's: full layers, a k-is-v layer, then layers that read the kv it stored."""

    def __init__(self):
        super().__init__()
        kinds = [{}, {"key_is_value": True}, {}, {"shares_kv": True}]
        self.layers = nn.ModuleList([KeyIsValueOrShared(**kind) for kind in kinds])

    def forward(self, x):
        shared = {}
        for layer in self.layers:
            x = layer(x, shared) + x
        return x


class Holder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + x


def _rewritten(stock: nn.Module, x: torch.Tensor) -> nn.Module:
    model = copy.deepcopy(stock)
    transfuse.rewrite(model, example_inputs=(x,))
    return model


def _same_outputs_and_gradients(stock: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """Outputs equal bit for bit; each parameter's gradient equal, a merged weight's to its parts'
    stacked. (Bit for bit needs widths of whole 16-column blocks, where CPU BLAS sums each column in
    the same order merged or not, and no reduction over a part's slice: a strided row is summed in
    another order than a contiguous one. The toys keep to both: what they test is the path.)"""
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
    model(x).square().sum().backward()
    stock(x).square().sum().backward()
    merged = {}
    for fusion in transfuse.report(model).fusions:
        (into,) = [n for n, c in model.get_submodule(fusion.path).named_children() if isinstance(c, MergedProjection)]
        merged[f"{fusion.path}.{into}"] = [f"{fusion.path}.{part}" for part in fusion.replaced]
    stock_grads = {name: p.grad for name, p in stock.named_parameters()}
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        want = torch.cat([stock_grads[f"{p}.{kind}"] for p in merged[owner]]) if owner in merged else stock_grads[name]
        # Equal to rounding: the input's gradient is one matmul instead of a sum of the parts'.
        torch.testing.assert_close(param.grad, want, msg=name)


def test_a_projection_that_may_be_none_merges_where_it_is_not():
    torch.manual_seed(0)
    stock, x = Injections(), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert sorted((f.path, f.replaced) for f in report.fusions) == [
        ("layers.0", ("down", "inject")),
        ("layers.2", ("down", "inject")),
    ], report
    assert report.skipped == []  # the instance without it has one projection of x: nothing to merge
    diff = transfuse.diff(model)
    assert "if self.inject is not None:" in diff and "self.pair_proj(x).split(" in diff
    _same_outputs_and_gradients(stock, model, x)


def test_k_is_v_and_shared_kv_merge_on_the_path_where_both_tests_hold():
    torch.manual_seed(0)
    stock, x = Attentions(), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    fused = sorted((f.path, f.replaced) for f in report.fusions if f.kind == "qkv")
    # The k-is-v layer, traced on its own path, merges q and k (its v call stays, as written).
    assert fused == [("layers.0", ("q", "k", "v")), ("layers.1", ("q", "k")), ("layers.2", ("q", "k", "v"))]
    assert report.skipped == []  # the sharing layer has one projection of x: nothing to merge
    diff = transfuse.diff(model)
    assert "if self.v is not None and not self.shares_kv:" in diff and "if not self.shares_kv:" in diff
    assert "self.qkv_proj(x).split(" in diff
    _same_outputs_and_gradients(stock, model, x)


def test_a_flag_the_forward_assigns_is_not_specialised():
    torch.manual_seed(0)
    stock, x = Holder(FlagSetInForward()), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert report.fusions == []
    (skip,) = report.skipped
    assert skip.tag == "qkv.placement" and "different blocks" in skip.reason
    assert transfuse.diff(model) == ""
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))


@pytest.mark.parametrize("model_type", ["gemma4_text", "qwen4_exp_text", "kimi_linear", "bailing_hybrid", "bitnet"])
def test_real_types_fuse_every_qkv_opportunity(model_type):
    """bitnet: its GLU (squared relu, a norm between the product and the down projection) is counted
    as gate_up, not as a qkv opportunity."""
    row = coverage.run_type(model_type)
    assert row["status"] == "ok", row.get("error")
    assert row["fused"]["qkv"] == row["opportunities"]["qkv"] > 0
    assert row["fused"]["gate_up"] == row["opportunities"]["gate_up"] > 0
    assert not any(tag.startswith("qkv.") for tag in row["refusals"]), row["refusals"]
    assert row["generation_equal"] is True


def test_the_projections_before_a_child_that_reads_their_input_merge():
    torch.manual_seed(0)
    stock, x = Holder(ProjectionsAroundAChild()), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert [(f.path, f.replaced) for f in report.fusions] == [("inner", ("q", "k", "v"))], report
    assert report.skipped == []
    diff = transfuse.diff(model)
    assert "self.qkv_proj(x).split(" in diff and "self.b(x)" in diff and "-        return self.o(state * self.g(x))" not in diff
    _same_outputs_and_gradients(stock, model, x)


def test_a_child_right_after_the_first_projection_is_refused_by_name():
    torch.manual_seed(0)
    stock, x = Holder(ChildAfterTheFirst()), torch.randn(2, 5, 32)
    model = _rewritten(stock, x)
    report = transfuse.report(model)
    assert report.fusions == []
    (skip,) = report.skipped
    assert skip.tag == "qkv.input-mutated" and skip.reason == "x is passed to self.gate between the projections."
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
