"""Tracer and analysis features that patterns spanning loops, flags and children rest on:
scalar attributes as nodes, specialisation, stand-in values, child analyses, inlining."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from transfuse.rewriter.analysis import ClassAnalysis, analyse
from transfuse.rewriter.capture import make_probe, record_calls
from transfuse.rewriter.fusion import Fuser
from transfuse.rewriter.graph import is_op
from transfuse.rewriter.inline import inline_calls
from transfuse.rewriter.tracer import trace_module


class FlaggedTopK(nn.Module):
    """A router whose top-k count and renormalisation come from attributes."""

    def __init__(self, top_k=2, renormalize=True):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        values, ids = torch.topk(F.linear(x, self.weight).softmax(-1), self.top_k, dim=-1)
        if self.renormalize:
            values = values / values.sum(-1, keepdim=True)
        return values, ids


class HitLoop(nn.Module):
    """A loop over the rows of nonzero(), with a data-dependent skip and a list lookup."""

    def __init__(self):
        super().__init__()
        self.parts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x, ids):
        out = torch.zeros_like(x)
        for i in (F.one_hot(ids, 3).sum(0) > 0).nonzero():
            if i == 2:
                continue
            rows = torch.where(ids == i)[0]
            out.index_add_(0, rows, self.parts[i](x[rows]))
        return out


def test_scalar_attributes_are_nodes_and_guards_specialise_the_trace():
    trace = trace_module(FlaggedTopK(), ((torch.randn(5, 16),), {}))
    topk = next(n for n in trace.graph.nodes if is_op(n, "topk"))
    assert topk.args[1].meta["self_attr"] == "top_k"  # k is read per instance from its attribute
    assert trace.specialisation["renormalize"] is True
    assert any(is_op(n, "div") for n in trace.graph.nodes)
    without = trace_module(FlaggedTopK(renormalize=False), ((torch.randn(5, 16),), {}))
    assert without.specialisation["renormalize"] is False
    assert not any(is_op(n, "div") for n in without.graph.nodes)


def test_an_analysis_is_reused_only_for_instances_it_describes():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = FlaggedTopK(renormalize=True), FlaggedTopK(renormalize=False), FlaggedTopK()

        def forward(self, x):
            return self.a(x)[0] + self.b(x)[0] + self.c(x)[0]

    model = Two()
    probe = record_calls(model, make_probe(model, (torch.randn(3, 16),)))
    a, b, c = (analyse(getattr(model, n), n, probe) for n in "abc")
    assert a is c and a is not b
    assert a.trace.specialisation["renormalize"] is True and b.trace.specialisation["renormalize"] is False


def test_data_dependent_loops_follow_one_iteration_and_say_where():
    module = HitLoop()
    trace = trace_module(module, ((torch.randn(6, 4), torch.tensor([0, 1, 1, 0, 2, 1])), {}))
    assert not trace.partial, trace.describe_stop()
    kinds = sorted(a.kind for a in trace.assumptions)
    assert kinds == ["branch", "index", "loop"]
    assert all(a.location and a.location[0].endswith("test_tracer_specialisation.py") for a in trace.assumptions)
    # The one iteration called the representative member of the list, and added its output.
    assert [n.target for n in trace.graph.nodes if n.op == "call_module"] == ["parts.0"]
    assert sum(is_op(n, "index_add_") for n in trace.graph.nodes) == 1


def test_a_branch_on_data_outside_such_a_loop_still_stops_the_trace():
    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    trace = trace_module(Branch(), ((torch.randn(3),), {}))
    assert trace.partial and "data-dependent" in trace.stop_reason


class _ChildAware(Fuser):
    kind = "child_aware"

    def match(self, analysis: ClassAnalysis):
        return analysis.child("a").trace.specialisation["renormalize"]

    def fuse(self, module, found):
        raise AssertionError("not used")


def test_verdicts_that_consult_children_follow_the_children():
    class Holder(nn.Module):
        def __init__(self, flag):
            super().__init__()
            self.a = FlaggedTopK(renormalize=flag)

        def forward(self, x):
            return self.a(x)[0]

    fuser = _ChildAware()
    for flag in (True, False, True):
        model = Holder(flag)
        probe = record_calls(model, make_probe(model, (torch.randn(3, 16),)))
        assert analyse(model, "", probe).verdict(fuser) is flag


def test_inlining_splices_a_child_graph_with_paths_below_the_parent():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = FlaggedTopK()

        def forward(self, x):
            values, ids = self.router(x)
            return values * 2, ids

    block = Block()
    probe = record_calls(block, make_probe(block, (torch.randn(3, 16),)))
    analysis = analyse(block, "", probe)
    inlined = inline_calls(analysis.trace, lambda path: analysis.child(path).trace)
    nodes = list(inlined.graph.nodes)
    assert not any(n.op == "call_module" for n in nodes)
    assert {n.target for n in nodes if n.op == "get_attr"} >= {"router.weight", "router.top_k"}
    topk = next(n for n in nodes if is_op(n, "topk"))
    assert topk.args[1].meta["self_attr"] == "router.top_k"
    output = next(n for n in nodes if n.op == "output").args[0]
    assert is_op(output[0], "mul") and is_op(output[0].args[0], "div")  # router's values, renormalised, times 2
