"""Hooks on modules whose calls a fusion removes run as in the stock model: as often, with the same
inputs and outputs, and a hook that changes an output changes what follows.

The parts of a merged projection, a GLU's activation module, a norm absorbed into the add+norm,
the experts' module and the router of a fused mixture-of-experts block: forward, forward-pre,
backward and backward-pre hooks, registered after the rewrite or before it, their own or global.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

import transfuse
from transfuse.tiny import tiny_model

from . import toys

LLAMA_MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.1.mlp.gate_proj",
    "model.layers.1.mlp.up_proj",
    "model.layers.1.mlp.act_fn",
    "model.layers.0.post_attention_layernorm",
]
MOE_MODULES = ["model.layers.0.mlp.experts", "model.layers.1.mlp.gate"]
FUSED_CALLS = [("llama", p) for p in LLAMA_MODULES] + [("qwen3_moe", p) for p in MOE_MODULES]
KINDS = ("forward", "forward_pre", "backward", "backward_pre")


def _pair(model_type: str):
    torch.manual_seed(0)
    stock = tiny_model(model_type).eval()
    rewritten = transfuse.rewrite(copy.deepcopy(stock))
    return stock, rewritten


@pytest.fixture(scope="module")
def llama():
    stock, rewritten = _pair("llama")
    counts = transfuse.report(rewritten).counts()
    assert counts["qkv"] == counts["gate_up"] == counts["add_rms_norm"] == 2
    return stock, rewritten


@pytest.fixture(scope="module")
def qwen3_moe():
    stock, rewritten = _pair("qwen3_moe")
    assert transfuse.report(rewritten).counts()["moe"] == 2
    return stock, rewritten


def _register(module: nn.Module, kind: str, seen: list, change: float | None = None):
    """A hook of ``kind`` that records what it sees (the output, the input, the output's gradients);
    with ``change``, a forward hook that scales the output."""
    if kind == "forward":
        def hook(m, args, out):
            seen.append((out[0] if isinstance(out, tuple) else out).detach().clone())  # a router: its logits
            return None if change is None else out * change
        return module.register_forward_hook(hook)
    if kind == "forward_pre":
        return module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    if kind == "backward":
        return module.register_full_backward_hook(lambda m, gin, gout: seen.append(_given(gout)))
    return module.register_full_backward_pre_hook(lambda m, gout: seen.append(_given(gout)))


def _given(gradients: tuple) -> list[torch.Tensor]:
    """The output gradients a backward hook is given (a router's logits get none)."""
    return [g.detach().clone() for g in gradients if g is not None]


def _run(model: nn.Module, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(seed))
    logits = model(ids).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    model.zero_grad(set_to_none=True)
    return logits.detach()


def _seen_in_both(pair, path: str, kind: str, change: float | None = None):
    results = []
    for model in pair:
        seen: list = []
        handle = _register(model.get_submodule(path), kind, seen, change)
        try:
            logits = _run(model)
        finally:
            handle.remove()
        results.append((seen, logits))
    return results


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,path", FUSED_CALLS)
def test_a_hook_on_a_module_whose_call_was_fused_runs_as_in_the_stock_model(request, family, path, kind):
    (stock_seen, _), (seen, _) = _seen_in_both(request.getfixturevalue(family), path, kind)
    assert len(stock_seen) >= 1
    assert len(seen) == len(stock_seen), f"{kind} hook on {path}: {len(seen)} calls, stock {len(stock_seen)}"
    for got, want in zip(seen, stock_seen):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family,path", [FUSED_CALLS[0], FUSED_CALLS[4], FUSED_CALLS[-2]])
def test_a_recomputed_forward_runs_the_hooks_again_as_in_the_stock_model(request, family, path):
    """Under activation checkpointing the forward runs twice, and so do the hooks of the fused modules."""
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    counts = []
    for model in request.getfixturevalue(family):
        seen: list = []
        handle = _register(model.get_submodule(path), "forward", seen)
        try:
            logits = torch.utils.checkpoint.checkpoint(lambda i: model(i).logits, ids, use_reentrant=False)
            logits.sum().backward()
            model.zero_grad(set_to_none=True)
        finally:
            handle.remove()
        counts.append(len(seen))
    assert counts[1] == counts[0] == 2


@pytest.mark.parametrize("family,path", [("llama", p) for p in LLAMA_MODULES] + [("qwen3_moe", MOE_MODULES[0])])
def test_a_hook_that_changes_an_output_changes_the_logits_as_in_the_stock_model(request, family, path):
    pair = request.getfixturevalue(family)
    plain = _run(pair[0])
    (_, stock_logits), (_, logits) = _seen_in_both(pair, path, "forward", change=1.5)
    assert (stock_logits - plain).abs().max() > 1e-3
    torch.testing.assert_close(logits, stock_logits, rtol=1e-4, atol=1e-5)


def test_hooks_registered_before_the_rewrite_keep_running_and_the_fusions_are_made():
    torch.manual_seed(0)
    stock = tiny_model("llama").eval()
    model = copy.deepcopy(stock)
    paths = ["model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.act_fn",
             "model.layers.1.post_attention_layernorm", "model.norm"]  # fmt: skip
    counts = {id(m): Counter() for m in (stock, model)}
    handles = []
    for m in (stock, model):
        for path in paths:
            count = counts[id(m)]
            module = m.get_submodule(path)
            handles.append(module.register_forward_hook(lambda *a, p=path, c=count: c.update([p])))
            handles.append(module.register_full_backward_hook(lambda *a, p=path, c=count: c.update([p + "/b"])))
    transfuse.rewrite(model)
    assert {"qkv", "gate_up", "add_rms_norm", "rms_norm"} <= set(transfuse.report(model).counts())
    counts[id(model)].clear()
    torch.testing.assert_close(_run(model), _run(stock), rtol=1e-4, atol=1e-5)
    assert counts[id(model)] == counts[id(stock)] and len(counts[id(stock)]) == 2 * len(paths)
    for handle in handles:
        handle.remove()  # the handles of the hooks registered before the rewrite still remove them
    counts[id(model)].clear()
    _run(model)
    assert not counts[id(model)]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_global_hooks_see_every_stock_module_called_as_often_as_in_the_stock_model(request, family):
    called = []
    handles = [
        module_globals.register_module_forward_hook(lambda m, a, o: called.append(("f", id(m)))),
        module_globals.register_module_full_backward_hook(lambda m, gi, go: called.append(("b", id(m)))),
    ]
    try:
        tallies = []
        for model in request.getfixturevalue(family):
            names = {id(m): name for name, m in model.named_modules()}
            called.clear()
            _run(model)
            tallies.append(Counter((kind, names.get(i)) for kind, i in called))
    finally:
        for handle in handles:
            handle.remove()
    stock, rewritten = tallies
    assert {key: rewritten[key] for key in stock} == stock


def test_hooks_on_per_expert_modules_refuse_stacking_them_and_a_hook_on_the_stack_raises():
    torch.manual_seed(0)
    block = toys.ModuleListMoE()
    block.experts[3].w3.register_forward_hook(lambda *a: None)
    model = transfuse.rewrite(toys.TinyMoEModel(block), example_inputs=(torch.randn(2, 5, 32),))
    assert [s.tag for s in transfuse.report(model).skipped if s.kind == "moe"] == ["moe.hooked"]
    model = transfuse.rewrite(toys.TinyMoEModel(toys.ModuleListMoE()), example_inputs=(torch.randn(2, 5, 32),))
    assert transfuse.report(model).counts()["moe"] == 1
    model.block.experts.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="would not run"):
        model(torch.randn(2, 5, 32))


def test_compiled_rewritten_model_runs_hooks_as_the_compiled_stock_model_and_compiles_once_without(llama):
    from torch._dynamo.testing import CompileCounter

    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    stock, rewritten = (copy.deepcopy(m) for m in llama)
    torch._dynamo.reset()  # the forward's code object may hold other tests' entries up to the recompile limit
    counter = CompileCounter()
    compiled = torch.compile(rewritten, fullgraph=True, backend=counter)
    with torch.no_grad():
        compiled(ids), compiled(ids)
    assert counter.frame_count == 1  # no graph break, no recompile from the hook checks
    results = []
    for model in (stock, rewritten):
        torch._dynamo.reset()
        seen: list = []
        for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.act_fn"):
            _register(model.get_submodule(path), "forward", seen, change=1.5)
        with torch.no_grad():
            logits = torch.compile(model, fullgraph=True, backend="eager")(ids).logits
        results.append((len(seen), logits))
    assert results[1][0] == results[0][0] == 2
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-5)
