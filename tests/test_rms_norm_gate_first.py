"""Norms gated before the normalisation (Mamba-2's mixers): ``rms_norm(x.float() * act(gate.float()))``.

The gate multiplies the upcast input, the product is normalised over the row or over groups of
it, then the weight with the model's rounding; an optional gate (``if gate is not None``) whose
branch holds only that product gives, without a gate, the norm of the input alone. Toys fuse into
``GatedRMSNorm(gate_first=True)`` bit for bit (float32 and bf16) with stock gradients; the forms
the op does not compute stay refused with their reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from tests import toys
from transfuse.ops import GatedRMSNorm
from transfuse.ops.rms_norm import RMSNormSpec, input_gated_rms_norm_native
from transfuse.tiny import tiny_model


class GroupedGateFirstNorm(nn.Module):
    """Mamba-2's ``MambaRMSNormGated``: optional gate, groups of ``group_size`` → fuses."""

    def __init__(self, hidden_size, group_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size))
        self.variance_epsilon = eps
        self.group_size = group_size

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        *prefix_dims, last_dim = hidden_states.shape
        group_count = last_dim // self.group_size
        hidden_states_group = hidden_states.view(*prefix_dims, group_count, self.group_size)
        variance = hidden_states_group.pow(2).mean(-1, keepdim=True)
        hidden_states_group = hidden_states_group * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = hidden_states_group.view(*prefix_dims, group_count * self.group_size)
        return self.weight * hidden_states.to(input_dtype)


class RowGateFirstNorm(nn.Module):
    """A required gate (sigmoid), the whole row normalised, the weight in float32, cast last → fuses."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden_size))
        self.eps = eps

    def forward(self, hidden_states, gate):
        h = hidden_states.float() * torch.sigmoid(gate.float())
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(hidden_states.dtype)


class ElseBranchGateNorm(GroupedGateFirstNorm):
    """Without a gate it scales the input: the None path is not the gated one minus the gate → refused."""

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        else:
            hidden_states = hidden_states * 0.5
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LiteralGroupNorm(GroupedGateFirstNorm):
    """Groups of a literal size, not an attribute → refused (rms_norm.inputs: the group size)."""

    def forward(self, hidden_states, gate):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32) * F.silu(gate.to(torch.float32))
        grouped = hidden_states.view(*hidden_states.shape[:-1], -1, 8)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * grouped.view(hidden_states.shape).to(input_dtype)


class _Mixer(nn.Module):
    """A projection into (x, gate) and the gated norm, as Mamba-2's mixer calls it."""

    def __init__(self, norm, with_gate=True):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.norm = norm
        self.with_gate = with_gate

    def forward(self, x):
        h, gate = self.inp(x).chunk(2, dim=-1)
        return self.norm(h, gate) if self.with_gate else self.norm(h)


@pytest.mark.parametrize("norm", [lambda: GroupedGateFirstNorm(32, 8), lambda: GroupedGateFirstNorm(32, 32), lambda: RowGateFirstNorm(32)], ids=["groups", "one_group", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_gated_before_it_fuses_bit_for_bit_with_stock_gradients(norm, dtype):
    torch.manual_seed(0)
    model = _Mixer(norm()).to(dtype)
    stock = copy.deepcopy(model)
    x = torch.randn(3, 7, 32, dtype=dtype)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert isinstance(model.norm, GatedRMSNorm) and model.norm.gate_first, transfuse.report(model)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    for m in (model, stock):
        m(x).float().pow(2).sum().backward()
    for name, p in stock.named_parameters():
        assert torch.equal(model.get_parameter(name).grad, p.grad), name


def test_without_a_gate_the_fused_norm_takes_the_originals_path_for_none():
    torch.manual_seed(0)
    model = _Mixer(GroupedGateFirstNorm(32, 8))
    x = torch.randn(2, 5, 32)
    stock = copy.deepcopy(model.norm)
    transfuse.rewrite(model, example_inputs=(x,))
    assert model.norm.optional_gate and model.norm.group_size == 8
    h = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(model.norm(h), stock(h))
        assert torch.equal(model.norm(h, gate=None), stock(h, gate=None))


def test_a_required_gate_stays_required():
    model = _Mixer(RowGateFirstNorm(32))
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    assert isinstance(model.norm, GatedRMSNorm) and not model.norm.optional_gate
    with pytest.raises(TypeError, match="needs its gate"):
        model.norm(torch.randn(2, 32))


def test_the_native_definition_is_the_models_arithmetic_in_bf16():
    torch.manual_seed(1)
    norm = GroupedGateFirstNorm(64, 16).to(torch.bfloat16)
    x, gate = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    spec = RMSNormSpec(upcast=True, cast_before_weight=True)
    out = input_gated_rms_norm_native(x, gate, norm.weight, norm.variance_epsilon, *spec.flags(), "silu", 16)
    assert torch.equal(out, norm(x, gate))


REFUSED = [
    (toys.GatedRMSNorm(32), "rms_norm.inputs", "in float32"),  # the gate multiplies in the input dtype
    (ElseBranchGateNorm(32, 32), "rms_norm.control-flow", "not only the gate's product"),
    (LiteralGroupNorm(32, 8), "rms_norm.inputs", "group size"),
]


@pytest.mark.parametrize("norm, tag, words", REFUSED, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_forms_the_op_does_not_compute_stay_refused(norm, tag, words):
    model = _Mixer(norm)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert model.norm is norm
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "rms_norm"]
    assert skip.tag == tag and words in skip.reason, skip
    with torch.no_grad():
        assert torch.equal(model(x), before)


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "granitemoehybrid", "zamba2", "nemotron_h"])
def test_real_gated_norms_fuse_and_logits_match(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
    transfuse.rewrite(model, fusions=["rms_norm"])
    report = transfuse.report(model)
    gated = [m for m in model.modules() if isinstance(m, GatedRMSNorm) and m.gate_first]
    assert gated and not [s for s in report.skipped if s.kind == "rms_norm"], report
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, before)
