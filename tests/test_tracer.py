"""The all-leaf tracer on real transformers classes and on toy idioms."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests import toys
from transfuse.rewriter.analysis import analyse
from transfuse.rewriter.capture import make_probe, record_calls
from transfuse.rewriter.graph import is_op
from transfuse.rewriter.tracer import UNKNOWN, trace_module
from transfuse.tiny import tiny_model


def _traces_by_class(model_type: str, **overrides):
    """Trace every class of a tiny model once, with its recorded call: {class name: (module, trace)}."""
    model = tiny_model(model_type, **overrides)
    probe = record_calls(model, make_probe(model))
    assert probe.error is None
    found = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if name not in found and not type(module).__module__.startswith("torch."):
            found[name] = (module, analyse(module, path, probe).trace)
    return found


def _class_ending(traces, suffix):
    matches = [name for name in traces if name.endswith(suffix)]
    assert matches, f"no class ending in {suffix} among {sorted(traces)}"
    return [traces[name] for name in matches]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "gpt_oss"])
def test_attention_traces_through_output_projection(model_type):
    (module, trace), = _class_ending(_traces_by_class(model_type), "Attention")
    assert not trace.partial, trace.describe_stop()
    called = [n.target for n in trace.graph.nodes if n.op == "call_module"]
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(called)
    # The attention interface is one leaf call returning (output, weights).
    (attention,) = [n for n in trace.graph.nodes if n.op == "call_function" and "attention" in n.target.__name__]
    assert isinstance(attention.meta["val"], tuple) and len(attention.meta["val"]) == 2
    # The o_proj call's traced value has the model's hidden size.
    (o_proj,) = [n for n in trace.graph.nodes if n.target == "o_proj"]
    assert o_proj.meta["val"].shape[-1] == module.config.hidden_size
    assert o_proj.meta["val"].is_meta


@pytest.mark.parametrize(
    "model_type, suffixes, overrides",
    [
        ("llama", ["MLP", "RMSNorm"], {}),
        ("qwen3_moe", ["MLP", "RMSNorm", "SparseMoeBlock", "TopKRouter"], {"mlp_only_layers": [0]}),
        ("deepseek_v3", ["MLP", "RMSNorm", "MoE", "TopkRouter"], {}),
        ("gpt_oss", ["MLP", "RMSNorm", "TopKRouter"], {}),
    ],
)
def test_mlp_norm_moe_and_router_trace_fully(model_type, suffixes, overrides):
    traces = _traces_by_class(model_type, **overrides)
    for suffix in suffixes:
        for module, trace in _class_ending(traces, suffix):
            assert not trace.partial, f"{type(module).__name__}: {trace.describe_stop()}"
            assert trace.output is not None


def test_data_dependent_branch_gives_partial_graph_ending_at_the_branch():
    module = toys.DataDependentBranch(8)
    trace = trace_module(module, ((torch.randn(2, 8),), {}))
    assert trace.partial
    assert "data-dependent" in trace.stop_reason
    source_lines, first = inspect.getsourcelines(toys.DataDependentBranch.forward)
    branch_line = first + next(i for i, line in enumerate(source_lines) if "if s > 0" in line)
    assert trace.stop_location[1] == branch_line
    ops = [n for n in trace.graph.nodes if n.op in ("call_module", "call_method", "call_function")]
    # The graph holds proj and the comparison, and nothing after the branch.
    assert ops[0].target == "proj"
    assert is_op(ops[-1], "gt")
    assert not any(is_op(n, "mul") for n in ops)


def test_shape_unpacking_and_splat_trace_with_meta_values():
    module = toys.ShapeUnpacking(16, heads=4)
    trace = trace_module(module, ((torch.randn(2, 5, 16),), {"cache": object()}))
    assert not trace.partial, trace.describe_stop()
    view = next(n for n in trace.graph.nodes if is_op(n, "view"))
    # The splat of the input's shape was concrete; the head count is the attribute it came from.
    batch, seq, heads, rest = view.args[1]
    assert (batch, seq, rest) == (2, 5, -1)
    assert heads.meta["self_attr"] == "heads" and heads.meta["val"] == 4
    assert trace.output.args[0].meta["val"].shape == (2, 5, 16)
    # The cache argument was fixed to None, so no placeholder stands for it.
    assert [p.name for p in trace.placeholders()] == ["x"]


def test_without_an_example_values_are_unknown_but_dataflow_is_kept():
    trace = trace_module(toys.LlamaStyleNorm(8))
    assert not trace.partial
    x = trace.placeholders()[0]
    assert x.meta["val"] is UNKNOWN
    assert any(is_op(n, "rsqrt") for n in trace.graph.nodes)


def test_float_attributes_and_parameters_are_nodes():
    trace = trace_module(toys.GemmaStyleNorm(8), ((torch.randn(3, 8),), {}))
    assert set(trace.float_attrs) == {"eps"}
    add = next(n for n in trace.graph.nodes if is_op(n, "add") and trace.float_attrs["eps"] in n.args)
    assert add.args[1].meta["self_attr"] == "eps"
    # self.weight.float() was recorded, not computed eagerly into a constant.
    assert any(is_op(n, "float") and n.args[0].target == "weight" for n in trace.graph.nodes)


def test_tracing_restores_the_instance():
    module = toys.GemmaStyleNorm(8)
    before = dict(vars(module))
    trace_module(module, ((torch.randn(3, 8),), {}))
    assert vars(module).keys() == before.keys()
    assert module.eps == 1e-6 and type(module.eps) is float
    assert isinstance(module.weight, torch.nn.Parameter)
    assert torch.nn.Module.__call__ is not None and module(torch.randn(2, 8)).shape == (2, 8)


def test_decorated_forward_is_unwrapped():
    trace = trace_module(toys.DecoratedNorm(8), ((torch.randn(3, 8),), {}))
    assert not trace.partial
    assert [p.name for p in trace.placeholders()] == ["hidden_states"]


def test_a_child_parameter_reshaped_outside_the_graph_says_which_tensor_it_views():
    """``self.child.w.view(...)`` with the child's own sizes runs in Python (no proxy among its arguments):
    the graph gets a constant, whose ``view_of`` names the tensor it is the whole of; a slice is no view."""
    from torch import nn

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.rows, self.cols = 4, 3
            self.w = nn.Parameter(torch.randn(8, 3))

    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Holder()

        def forward(self, x):
            whole = self.child.w.view(2, self.child.rows, self.child.cols)
            return (whole * x.sum()).sum() + (x @ self.child.w[:3].t()).sum()

    trace = trace_module(Reader(), ((torch.randn(5, 3),), {}))
    constants = [n for n in trace.graph.nodes if n.op == "get_attr" and n.meta.get("constant")]
    assert [n.meta.get("view_of") for n in constants] == [("child.w", (8, 3)), None]
