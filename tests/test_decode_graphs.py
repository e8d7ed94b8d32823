"""Small-batch CUDA graphs of the fused MoE layer (``transfuse.ops.graphs``): replay gives what
running the layer gives, follows the weights, and stays out of the way where it cannot be exact.
A shape is captured the second time it is seen, so each case calls the layer at least twice."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse.ops import MoE
from transfuse.ops.moe_layer import _LAYER_GRAPHS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _original_block():
    """The transformers block the fixture fuses, built the same way (same seed) on each call."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block


@pytest.fixture
def layer():
    holder = torch.nn.Sequential(_original_block())
    transfuse.rewrite(holder, example_inputs=(torch.randn(1, 8, 256, device="cuda", dtype=torch.bfloat16),),
                      fusions=["moe"])  # fmt: skip
    assert not holder[0].graph_small_batches  # a rewrite alone captures nothing
    transfuse.decode_steps(holder)
    fused = holder[0]
    assert isinstance(fused, MoE), transfuse.report(holder)
    return fused


def _captured(layer) -> int:
    graphs = _LAYER_GRAPHS.get(layer)
    return 0 if graphs is None else len(graphs._graphs)


def test_replay_matches_running_the_layer_and_outputs_are_fresh(layer):
    assert not layer.training  # it took the flag of the block it replaced
    assert _captured(layer) == 0  # the rewrite's verification calls captured nothing
    with torch.no_grad():
        layer(torch.randn(1, 5, 256, device="cuda", dtype=torch.bfloat16))  # a shape seen once
        assert _captured(layer) == 0
        for tokens in (1, 3, 1):
            xs = [torch.randn(1, tokens, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            outs = [layer(x) for x in xs]
            for x, out in zip(xs, outs):  # earlier outputs are not overwritten by later replays
                assert torch.equal(out, layer._forward(x))
    assert _captured(layer) == 2  # one graph per shape seen twice


def test_replay_follows_weights_changed_in_place_and_replaced(layer):
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        layer(x)
        assert _captured(layer) == 1
        for p in layer.parameters():
            p.mul_(1.5)
        assert torch.equal(layer(x), layer._forward(x))
        first = next(layer.parameters())
        first.data = first.data * 0.5  # a new tensor at a new address
        for _ in range(2):
            assert torch.equal(layer(x), layer._forward(x))
    assert _captured(layer) == 1  # the graph of the old weights was dropped


def test_hooks_autograd_and_the_switch_keep_the_layer_eager(layer, monkeypatch):
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    graphs_of = lambda: _LAYER_GRAPHS.get(layer)  # noqa: E731
    seen = []
    handle = layer.gate.register_forward_hook(lambda *args: seen.append(1))  # the router
    with torch.no_grad():
        for _ in range(3):
            layer(x)
    handle.remove()
    assert len(seen) == 3 and _captured(layer) == 0
    for _ in range(2):
        layer(x).float().sum().backward()  # parameters require grad: autograd records, no graph
    assert _captured(layer) == 0 and next(layer.parameters()).grad is not None
    monkeypatch.setenv("TRANSFUSE_DECODE_GRAPHS", "0")
    with torch.no_grad():
        layer(x)
        layer(x)
    assert _captured(layer) == 0 and graphs_of().failed is None
    monkeypatch.setenv("TRANSFUSE_DECODE_GRAPHS", "1")
    with torch.no_grad():
        for _ in range(2):  # none of the calls above counted as a sighting
            assert torch.equal(layer(x), layer._forward(x))
    assert _captured(layer) == 1


def test_a_larger_batch_runs_eagerly(layer):
    x = torch.randn(2, 40, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(layer(x), layer._forward(x))
    assert _captured(layer) == 0


def test_changing_providers_recaptures_and_uncapturable_code_runs_eagerly(layer, monkeypatch):
    from transfuse import ops
    from transfuse.ops import moe_experts_native

    op = ops.get_op("moe_experts")

    def syncing(*args):  # reads the experts' ids on the host first: a capture of it fails
        args[2].max().item()
        return moe_experts_native(*args)

    monkeypatch.setitem(op._providers, "syncing", ops.Provider("syncing", syncing))
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        triton_out = layer(x)
        assert _captured(layer) == 1
        try:
            ops.set_priority(["native"], "moe_experts")  # grouped matmuls on device offsets: capturable
            native_out = layer(x)  # a new dispatch generation: seen once, run eagerly
            assert torch.equal(layer(x), native_out) and _captured(layer) == 1  # captured, the old graph dropped
            ops.set_priority(["syncing"], "moe_experts")
            layer(x)
            with pytest.warns(UserWarning, match="runs eagerly"):
                assert torch.equal(layer(x), native_out)  # the capture fails: eager
            with ops.trace() as calls:
                layer(x)  # eager from now on at this shape: the provider runs every call
        finally:
            ops.set_priority(None, "moe_experts")
        assert [c.provider for c in calls if c.op == "moe_experts"] == ["syncing"]
        torch.testing.assert_close(native_out, triton_out, rtol=2e-2, atol=2e-2)
        layer(x)
        assert torch.equal(layer(x), triton_out)  # the default providers again, in a new graph
    assert _captured(layer) == 1


@pytest.mark.parametrize("tokens", [1, 40])
def test_torch_compile_of_the_layer_runs_its_code_and_matches_eager(layer, tokens):
    """Under torch.compile the layer is traced, not replayed: compile's output matches the eager
    layer, and no decode graph is captured on the way (one-token calls included)."""
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    x = torch.randn(1, tokens, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = [compiled(x) for _ in range(3)]
        expected = layer._forward(x)
        original = _original_block()(x)  # the unmodified transformers block
        original = original[0] if isinstance(original, tuple) else original
    assert _captured(layer) == 0
    for out in got:
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out, original, rtol=2e-2, atol=2e-2)
