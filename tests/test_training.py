"""Training rewritten models: the loss and the gradient of every parameter, under its original
state_dict name (merged parameters split by part, stacked experts by expert), against the stock
model's, in float32 on the CPU; gradient checkpointing; the kernels' backward inside a model."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse import ops
from transfuse.ops import conformance
from transfuse.tiny import tiny_model

# laguna: gated attention, whose q, k, v and gate merge four ways; deepseek_v3: MLA's pair, on the
# forward specialised to q_lora_rank; bart: q, k, v on its self-attention path; qwen3_next: gated
# norms and linear attention's pair.
FAMILIES = [
    "llama", "qwen3", "gemma2", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "laguna", "bart", "qwen3_next",
]  # fmt: skip
# tiny_model leaves bart's decoder (the causal LM) at its default depth and width, 12 layers of 4096
# features: two layers of 128 hold the same projections.
SMALLER = {"bart": {"decoder_layers": 2, "decoder_ffn_dim": 128}}


def _tiny(model_type: str, **overrides):
    return tiny_model(model_type, **{**SMALLER.get(model_type, {}), **overrides}).train()


def grad_state(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under the state_dict name of the tensor it is (the same hooks that
    save merged and stacked parameters under their original keys split the gradients)."""
    params = list(model.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _step(model, ids, labels):
    torch.manual_seed(0)  # dropout (bart's) draws the same masks in both models
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss  # tiny bart and qwen3_next cannot cache
    loss.backward()
    return loss.detach()


def _batch(seed=3, length=24):
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[1, :5] = -100
    return ids, labels


def _compare(stock, fused, ids, labels):
    want, got = _step(stock, ids, labels), _step(fused, ids, labels)
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item()), (got.item(), want.item())
    stock_grads, fused_grads = grad_state(stock), grad_state(fused)
    assert stock_grads.keys() == fused_grads.keys()
    worst = {}
    for name, w in stock_grads.items():
        if w.is_floating_point() and w.norm() > 0:
            # Relative to the stock gradient, or to 1e-6 where that is float noise around a true
            # zero (a key bias: softmax ignores what it adds to a row, bart's is 3e-12).
            worst[name] = ((fused_grads[name] - w).norm() / max(w.norm(), 1e-6)).item()
    assert worst and max(worst.values()) <= 1e-5, max(worst.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_loss_and_every_gradient_equal_the_stock_models(model_type):
    stock, fused = _tiny(model_type), _tiny(model_type)
    transfuse.rewrite(fused)
    assert transfuse.report(fused).fusions
    _compare(stock, fused, *_batch())


@pytest.mark.slow
def test_a_four_way_merged_projection_trains_like_stock_under_torch_compile():
    from transfuse.ops.layers import MergedProjection

    torch._dynamo.reset()
    # One dense layer: the merge is the attention's; Inductor's compile time grows with the graph.
    one = dict(num_hidden_layers=1, layer_types=["full_attention"], num_attention_heads_per_layer=[4], mlp_layer_types=["dense"])
    stock, fused = _tiny("laguna", **one), _tiny("laguna", **one)
    transfuse.rewrite(fused)
    assert any(isinstance(m, MergedProjection) and len(m.parts) == 4 for m in fused.modules())
    _compare(torch.compile(stock), torch.compile(fused), *_batch())


@pytest.mark.slow
# (MLA's pair trains eagerly above; the stock tiny deepseek_v3 and minicpm3 do not compile here.)
@pytest.mark.parametrize("model_type", ["bart", "qwen3_next"])
def test_specialised_forwards_pairs_and_gated_norms_train_like_stock_under_torch_compile(model_type):
    torch._dynamo.reset()
    # (qwen3_next: one layer, of the kind both of its tiny layers are; Inductor's compile time
    # grows with the graph)
    layers = {"num_hidden_layers": 1} if model_type == "qwen3_next" else {}
    stock, fused = _tiny(model_type, **layers), _tiny(model_type, **layers)
    transfuse.rewrite(fused)
    assert "qkv" in transfuse.report(fused).counts()
    _compare(torch.compile(stock), torch.compile(fused), *_batch())


@pytest.mark.slow
def test_library_ops_with_their_backward_train_like_stock_under_torch_compile():
    """In library mode the rotary and act_and_mul library ops run under autograd with their
    registered backward (on the GPU the default wherever Triton's backward kernels run): the
    gradients through Inductor's graph are stock's."""
    torch._dynamo.reset()
    stock, fused = tiny_model("llama").train(), tiny_model("llama").train()
    transfuse.rewrite(fused)
    assert {"rotary", "gate_up", "qkv"} <= set(transfuse.report(fused).counts())
    ops.set_compile_mode("library", "rotary")
    ops.set_compile_mode("library", "silu_and_mul")
    try:
        with ops.trace() as calls:
            _compare(torch.compile(stock), torch.compile(fused), *_batch())
    finally:
        ops.set_compile_mode(None, "rotary")
        ops.set_compile_mode(None, "silu_and_mul")
        torch._dynamo.reset()
    assert {"rotary", "silu_and_mul"} <= {c.op for c in calls}, calls


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_layers_compiled_one_by_one_compile_once_for_all_as_stock_s_do(model_type):
    """Regional compilation (``layer.compile()`` for each decoder layer, which cuts compile time):
    Dynamo guards a module's forward by its function, which every rewritten layer shares, so the
    layers share one graph as stock's do; with 10 layers, a guard per layer would recompile until
    Dynamo's limit (8) and leave the last layers eager. Loss and gradients stay stock's."""
    from torch._dynamo.utils import counters

    graphs = {}
    stock, fused = (tiny_model(model_type, num_hidden_layers=10).train() for _ in range(2))
    transfuse.rewrite(fused)
    for name, model in (("stock", stock), ("fused", fused)):
        torch._dynamo.reset()
        counters.clear()
        for layer in model.model.layers:
            layer.compile(backend="eager")
        _step(model, *_batch())
        graphs[name] = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
    torch._dynamo.reset()
    assert graphs["fused"] == graphs["stock"], graphs
    for model in (stock, fused):
        model.zero_grad()
    _compare(stock, fused, *_batch())


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_gradient_checkpointing(model_type):
    stock, fused = tiny_model(model_type).train(), tiny_model(model_type).train()
    transfuse.rewrite(fused)
    for model in (stock, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert fused.is_gradient_checkpointing
    _compare(stock, fused, *_batch())


def test_the_kernels_backward_inside_a_model():
    """The Triton kernels (interpreted on the CPU) with their own backward, in a training step
    (of 8 tokens: the interpreter's time grows with the tokens). Their conformance checks, which
    interpreted take most of a minute, are assumed (``test_conformance`` runs them)."""
    stock, fused = tiny_model("llama").train(), tiny_model("llama").train()
    transfuse.rewrite(fused)
    ops.set_priority(["triton"])
    try:
        with conformance.assumed(), ops.trace() as calls:
            _compare(stock, fused, *_batch(length=8))
    finally:
        ops.set_priority(None)
    used = {(c.op, c.provider) for c in calls if c.grad}
    assert {("rms_norm", "triton"), ("silu_and_mul", "triton")} <= used, used


def test_moe_training_runs_grouped_matmuls_not_a_loop_over_experts(monkeypatch):
    from transfuse.ops import moe as moe_module

    looped = []
    monkeypatch.setattr(moe_module, "_looped_matmul", lambda *a: looped.append(1))
    fused = tiny_model("qwen3_moe").train()
    transfuse.rewrite(fused)
    with ops.trace() as calls:
        _step(fused, *_batch())
    assert [c.provider for c in calls if c.op == "moe_experts"] == ["native", "native"]
    assert looped == []


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_bf16_gradients_on_the_gpu_are_as_accurate_as_the_stock_models(model_type):
    """Every fusion, the fused loss included, in bf16 on the GPU: each parameter's gradient errs
    against a float32 run of the stock model no more than 1.5x the stock model's own bf16 error."""
    reference = tiny_model(model_type).cuda().train()
    stock = tiny_model(model_type).cuda().to(torch.bfloat16).train()
    fused = tiny_model(model_type).cuda().to(torch.bfloat16).train()
    transfuse.rewrite(fused, fusions=["rms_norm", "add_rms_norm", "qkv", "gate_up", "moe", "linear_cross_entropy"])
    ids, labels = (t.cuda() for t in _batch())
    for model in (reference, stock, fused):
        _step(model, ids, labels)
    exact, want, got = grad_state(reference), grad_state(stock), grad_state(fused)
    error = lambda g, e: ((g.float() - e).norm() / e.norm()).item()  # noqa: E731
    compared = 0
    for name, e in exact.items():
        if not e.is_floating_point() or e.norm() == 0:
            continue
        compared += 1
        assert error(got[name], e) <= 1.5 * error(want[name], e) + 1e-3, (name, error(got[name], e), error(want[name], e))
    assert compared > 10


@pytest.mark.gpu
def test_compiled_training_on_the_gpu_runs_the_backward_kernels_and_matches_stock():
    """Under ``torch.compile`` with autograd on the GPU, rotary and act_and_mul run as library ops
    by default, their gradients from the Triton backward kernels (float32: stock's within 1e-5)."""
    torch._dynamo.reset()
    stock, fused = tiny_model("llama").cuda().train(), tiny_model("llama").cuda().train()
    transfuse.rewrite(fused)
    ids, labels = (t.cuda() for t in _batch())
    try:
        with ops.trace() as calls:
            _compare(torch.compile(stock), torch.compile(fused), ids, labels)
    finally:
        torch._dynamo.reset()
    used = {(c.op, c.provider) for c in calls}
    assert {("rotary", "triton"), ("silu_and_mul", "triton")} <= used, used
