"""RMSNorms whose forward branches on the instance's own attributes: specialised per instance.

Toys imitating Gemma 3n/4 (``if self.with_scale``) and xLSTM (``if self.weight is not None``,
``if self.force_float32_reductions``, ``if self.bias is not None`` in a helper) fuse, each
instance on the path its attributes choose, bit for bit in float32 with stock gradients; the
fused layer keeps the attributes and raises when one changes. A branch on anything else stays
refused with its reason.
"""

from __future__ import annotations

import copy

import libcst as cst
import pytest
import torch
from torch import nn

import transfuse
from tests import toys
from transfuse.ops import RMSNorm
from transfuse.rewriter.analysis import clear_cache
from transfuse.tiny import tiny_model


class WithScaleNorm(nn.Module):
    """Gemma 3n/4's: the weight only ``if self.with_scale`` (a bool set in __init__) → fuses."""

    def __init__(self, dim, eps=1e-6, with_scale=True):
        super().__init__()
        self.eps = eps
        self.with_scale = with_scale
        if self.with_scale:
            self.weight = nn.Parameter(torch.randn(dim))

    def _norm(self, hidden_states):
        mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
        return hidden_states * torch.pow(mean_squared, -0.5)

    def forward(self, hidden_states):
        normed_output = self._norm(hidden_states.float())
        if self.with_scale:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


class OptionalWeightNorm(nn.Module):
    """xLSTM's: ``weight`` a parameter or None, float32 only if a flag says so, a bias that is None,
    the branches in helpers → fuses."""

    def __init__(self, dim, eps=1e-6, use_weight=True, force_float32_reductions=True):
        super().__init__()
        self.eps = eps
        self.force_float32_reductions = force_float32_reductions
        self.weight = nn.Parameter(torch.randn(dim)) if use_weight else None
        self.bias = None

    def _apply_weight_bias(self, x):
        if self.weight is not None:
            x = x * self.weight
        if self.bias is not None:
            x = x + self.bias
        return x

    def _rms_normalize(self, x):
        in_dtype = x.dtype
        if self.force_float32_reductions:
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(in_dtype)

    def forward(self, x):
        return self._apply_weight_bias(self._rms_normalize(x))


class ElifModeNorm(nn.Module):
    """``if``/``elif`` on an int attribute and a conditional expression → fuses on the path taken."""

    def __init__(self, dim, eps=1e-6, mode=1, scale_power=2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)
        self.eps = eps
        self.mode = mode
        self.scale_power = scale_power

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + (self.eps if self.scale_power == 2 else 0.5))
        if self.mode == 0:
            h = h * self.weight.float()
        elif self.mode == 1:
            h = h * (1.0 + self.weight.float())
        else:
            h = h * 2
        return h.to(x.dtype)


class InputFlagNorm(toys.LlamaStyleNorm):
    """A branch on an argument's value, not an attribute → refused (rms_norm.control-flow)."""

    def forward(self, hidden_states, scale=True):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if scale:
            return self.weight * hidden_states.to(input_dtype)
        return hidden_states.to(input_dtype)


class RebindingNorm(WithScaleNorm):
    """The attribute tested is assigned in the forward before the test → refused (rms_norm.control-flow)."""

    def forward(self, hidden_states):
        self.with_scale = hidden_states.shape[0] > 1
        normed_output = self._norm(hidden_states.float())
        if self.with_scale:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


class TensorTruthNorm(WithScaleNorm):
    """A branch on a buffer's truth (its data, not the instance's attributes) → refused."""

    def __init__(self, dim):
        super().__init__(dim)
        self.register_buffer("enabled", torch.tensor(True))

    def forward(self, hidden_states):
        normed_output = self._norm(hidden_states.float())
        if self.enabled:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


class TrainingBranchNorm(WithScaleNorm):
    """A branch on ``self.training`` → refused (rms_norm.control-flow): one layer for both modes."""

    def forward(self, hidden_states):
        normed_output = self._norm(hidden_states.float())
        if not self.training:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


class _Norms(nn.Module):
    """Several norm instances of one class in a row, each fed the previous one's output."""

    def __init__(self, *norms):
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.norms = nn.ModuleList(norms)

    def forward(self, x):
        h = self.inp(x)
        for norm in self.norms:
            h = norm(h) + h
        return h


def _rewrite_and_compare(model, x, dtype=torch.float32):
    model = model.to(dtype)
    x = x.to(dtype)
    stock = copy.deepcopy(model)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    with torch.no_grad():
        after = model(x)
    assert torch.equal(after, before)
    if dtype == torch.float32:
        # The gradients are stock's up to rounding: the backward of ``pow(ms, -0.5)`` (Gemma's
        # spelling) is another formula than rsqrt's, whose values the forward shares.
        for m in (model, stock):
            m(x).pow(2).sum().backward()
        for name, p in stock.named_parameters():
            if p.grad is None:  # a weight on a path not taken
                assert model.get_parameter(name).grad is None, name
                continue
            difference = (model.get_parameter(name).grad - p.grad).abs().max()
            assert difference <= 1e-5 * p.grad.abs().max(), (name, difference)
    return model


NORMS = [
    (lambda: [WithScaleNorm(32), WithScaleNorm(32, with_scale=False), WithScaleNorm(32)], 3),
    (lambda: [OptionalWeightNorm(32), OptionalWeightNorm(32)], 2),
    (lambda: [OptionalWeightNorm(32, use_weight=False)], 1),
    (lambda: [OptionalWeightNorm(32, force_float32_reductions=False)], 1),
    (lambda: [ElifModeNorm(32), ElifModeNorm(32, mode=0), ElifModeNorm(32, mode=2)], 2),
]


@pytest.mark.parametrize("norms, fused", NORMS, ids=["with_scale", "weight", "no_weight", "no_fp32_flag", "elif_mode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_branching_on_their_attributes_fuse_per_instance_bit_for_bit(norms, fused, dtype):
    torch.manual_seed(0)
    clear_cache()  # each case traced afresh (a weightless instance is not told apart by the cache)
    model = _rewrite_and_compare(_Norms(*norms()), torch.randn(3, 7, 32), dtype)
    report = transfuse.report(model)
    assert report.counts().get("rms_norm", 0) == fused, report
    assert sum(isinstance(n, RMSNorm) for n in model.norms) == fused


def test_an_instance_whose_untraced_attribute_differs_is_refused_not_given_the_traced_path():
    """Analyses are specialised on the scalar attributes branches read (``with_scale``), not on a
    parameter being None: an instance without the weight that the traced one had is refused."""
    clear_cache()
    model = _Norms(OptionalWeightNorm(32), OptionalWeightNorm(32, use_weight=False))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert isinstance(model.norms[0], RMSNorm) and isinstance(model.norms[1], OptionalWeightNorm)
    (skip,) = transfuse.report(model).skipped
    assert skip.tag == "rms_norm.specialised" and "weight a tensor" in skip.reason and "= None" in skip.reason
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_an_instance_on_a_path_no_rule_explains_stays_refused():
    """ElifModeNorm's third mode multiplies by 2: that path is not a norm's, so that instance is refused."""
    model = _Norms(ElifModeNorm(32), ElifModeNorm(32, mode=2))
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    assert isinstance(model.norms[0], RMSNorm) and isinstance(model.norms[1], ElifModeNorm)
    (skip,) = transfuse.report(model).skipped
    assert skip.tag == "rms_norm.trailing-compute"


def test_the_fused_layer_holds_the_attributes_and_refuses_to_run_when_one_changes():
    model = _Norms(WithScaleNorm(32), OptionalWeightNorm(32))
    x = torch.randn(2, 5, 32)
    transfuse.rewrite(model, example_inputs=(x,))
    gemma_like, xlstm_like = model.norms
    assert isinstance(gemma_like, RMSNorm) and gemma_like.with_scale is True
    assert xlstm_like.force_float32_reductions is True and xlstm_like.bias is None
    assert "with_scale = True" in repr(gemma_like)
    model(x)
    gemma_like.with_scale = False
    with pytest.raises(ValueError, match=r"made for with_scale = True, and it is now False"):
        model(x)
    gemma_like.with_scale = True
    xlstm_like.bias = nn.Parameter(torch.zeros(32))
    with pytest.raises(ValueError, match=r"made for bias = None"):
        model(x)
    del xlstm_like.bias
    xlstm_like.bias = None
    xlstm_like.weight = None
    with pytest.raises(ValueError, match=r"made for weight a tensor, and it is now NoneType"):
        model(x)


def test_the_emitted_forward_checks_the_assumptions():
    from transfuse.fusers.rms_norm import RMSNormFuser
    from transfuse.rewriter.emit import emitted_replacement

    model = _Norms(WithScaleNorm(32))
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    (fuser, found), = model.__dict__["_transfuse_replaced"].values()
    assert isinstance(fuser, RMSNormFuser)
    text = emitted_replacement(WithScaleNorm, fuser, found).replacement
    code = cst.Module(body=[text]).code
    assert "check_assumptions(self, (('with_scale', True, False),))" in code
    assert "for with_scale = True" in code


REFUSED = [
    (InputFlagNorm(32), "rms_norm.control-flow", "has an if at line"),
    (RebindingNorm(32), "rms_norm.control-flow", "has an if at line"),
    (TensorTruthNorm(32), "rms_norm.", ""),
    (TrainingBranchNorm(32), "rms_norm.control-flow", "self.training"),
    (toys.BranchingRMSNorm(32), None, None),  # `if self.skip: return x` with skip False: the path fuses
]


@pytest.mark.parametrize("norm, tag, words", REFUSED, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_branches_on_anything_but_the_instances_attributes_stay_refused(norm, tag, words):
    model = toys.TinyNormModel(norm)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    skips = [s for s in transfuse.report(model).skipped if s.kind == "rms_norm"]
    if tag is None:
        assert isinstance(model.norm, RMSNorm) and not skips
    else:
        assert model.norm is norm
        (skip,) = skips
        assert skip.tag.startswith(tag) and words in skip.reason, skip
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_an_early_return_on_the_path_taken_stays_refused():
    norm = toys.BranchingRMSNorm(32)
    norm.skip = True
    model = toys.TinyNormModel(norm)
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    assert model.norm is norm
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "rms_norm"]
    assert skip.tag.startswith("rms_norm.")


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma3n_text", "xlstm"])
def test_real_norms_with_attribute_branches_fuse_and_logits_match(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
    transfuse.rewrite(model, fusions=["rms_norm"])
    report = transfuse.report(model)
    refused = [s for s in report.skipped if s.kind == "rms_norm" and "RMSNorm" in s.cls]  # xLSTM's LayerNorm stays
    assert report.counts().get("rms_norm", 0) > 0 and not refused, report
    with torch.no_grad():
        after = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(after, before)


class CheckedInputNorm(nn.Module):
    """The older remote-code form: ``if x.size(-1) != self.dim_norm: raise`` before the norm (a check
    of the input whose arm only raises) → fuses; the inputs it accepts take the traced path."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.dim_norm = eps, dim
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, hidden_states):
        if hidden_states.size(-1) != self.dim_norm:
            raise AssertionError("hidden_states.size(-1) != self.dim_norm")
        old_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(dim=-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.eps)).to(old_dtype) * self.weight


class CheckedThenScaledNorm(CheckedInputNorm):
    """The same test, whose arm rescales the input instead of raising → refused (rms_norm.control-flow)."""

    def forward(self, hidden_states):
        if hidden_states.size(-1) != self.dim_norm:
            hidden_states = hidden_states[..., : self.dim_norm]
        old_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(dim=-1, keepdim=True)
        return (hidden_states * torch.rsqrt(variance + self.eps)).to(old_dtype) * self.weight


def test_a_check_of_the_input_that_only_raises_does_not_stop_the_fusion():
    torch.manual_seed(0)
    model = _rewrite_and_compare(_Norms(CheckedInputNorm(32), CheckedInputNorm(32)), torch.randn(3, 7, 32))
    assert all(isinstance(n, RMSNorm) for n in model.norms), transfuse.report(model)
    assert not [s for s in transfuse.report(model).skipped if s.kind == "rms_norm"]
    with pytest.raises(RuntimeError):  # an input of another width: the fused op raises too
        model.norms[0](torch.randn(2, 16))


def test_a_check_of_the_input_whose_arm_computes_stays_refused():
    norm = CheckedThenScaledNorm(32)
    model = toys.TinyNormModel(norm)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,))
    assert model.norm is norm
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "rms_norm"]
    assert skip.tag == "rms_norm.control-flow", skip
    with torch.no_grad():
        assert torch.equal(model(x), before)
