"""Calls a proxy cannot enter: ``einops.rearrange`` is a leaf call valued on meta tensors, a
``@torch.jit.script`` function is traced through the Python torch keeps of it. The rest of the
forward is still seen, and q/k/v and gate/up fuse around them with the original's numbers."""

from __future__ import annotations

import copy
import warnings

import einops
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import transfuse
from transfuse.rewriter.tracer import trace_module

HIDDEN, HEADS = 32, 4


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


with warnings.catch_warnings():  # torch.jit.script is deprecated; remote code still uses it
    warnings.simplefilter("ignore", DeprecationWarning)
    scripted_silu = torch.jit.script(_silu)


class EinopsAttention(nn.Module):
    """Heads split with ``rearrange`` (imported by name and through the module) → qkv fuses."""

    def __init__(self, hidden: int):
        super().__init__()
        self.heads = HEADS
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, hidden, bias=False)
        self.wv = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        q = rearrange(self.wq(x), "b s (h d) -> b h s d", h=self.heads)
        k = einops.rearrange(self.wk(x), "b s (h d) -> b h s d", h=self.heads)
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", h=self.heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class ScriptedActivationMLP(nn.Module):
    """The GLU's activation a TorchScript function → gate_up fuses."""

    def __init__(self, hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(scripted_silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.attn = EinopsAttention(hidden)
        self.mlp = ScriptedActivationMLP(hidden)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def test_the_trace_goes_past_einops_and_scripted_calls():
    x = torch.randn(2, 5, HIDDEN, device="meta")
    for module in (EinopsAttention(HIDDEN), ScriptedActivationMLP(HIDDEN)):
        trace = trace_module(module, ((x,), {}))
        assert not trace.partial, trace.describe_stop()
        assert tuple(trace.output.args[0].meta["val"].shape) == (2, 5, HIDDEN)


def test_qkv_and_gate_up_fuse_around_calls_the_tracer_cannot_enter():
    torch.manual_seed(0)
    model = _Model().eval()
    original = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transfuse.rewrite(model, example_inputs=(torch.randn(2, 6, HIDDEN),))
    report = transfuse.report(model)
    kinds = {f.kind for f in report.fusions}
    assert {"qkv", "gate_up"} <= kinds, report
    assert not [s for s in report.skipped if s.tag.endswith("partial-trace")], report
    x = torch.randn(3, 7, HIDDEN)
    with torch.no_grad():
        got, want = model(x), original(x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
