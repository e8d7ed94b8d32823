"""LoRA (PEFT) on rewritten models, in both orders: adapters on merged projections train, save in
PEFT's own keys, load onto the stock model, and merge; adapters added before a rewrite are kept
and their projections refused with the reason."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse.ops import LinearPart
from transfuse.tiny import tiny_model

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter_targets(model) -> set[str]:
    return {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A" in name}


def _randomise_adapters(model, seed=0):
    """LoRA's B starts at zero: give every adapter weight random values, the same for a twin."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _pair(model_type, config, **overrides):
    stock = get_peft_model(tiny_model(model_type, **overrides), config)
    fused = tiny_model(model_type, **overrides)
    transfuse.rewrite(fused)
    fused = get_peft_model(fused, config)
    _randomise_adapters(stock)
    _randomise_adapters(fused)
    return stock, fused


def _ids(seq=12, seed=1):
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_adapters_on_merged_projections_train_like_the_stock_models(model_type):
    stock, fused = _pair(model_type, LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    assert _adapter_targets(fused) == _adapter_targets(stock) == set(TARGETS)
    ids = _ids()
    for model in (stock, fused):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    stock_grads = {n: p.grad for n, p in stock.named_parameters() if p.requires_grad}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
    assert stock_grads.keys() == fused_grads.keys() and all("lora_" in n for n in fused_grads)
    for name, want in stock_grads.items():
        assert ((fused_grads[name] - want).norm() / want.norm()).item() <= 1e-5, name
    merged = [m for m in fused.modules() if type(m).__name__ == "MergedProjection"]
    assert merged and not any(p.requires_grad for m in merged for p in m.parameters())  # the base stays frozen


def test_all_linear_and_the_default_targets_resolve_to_the_original_names():
    for config in (LoraConfig(r=4, target_modules="all-linear"), LoraConfig(r=4)):
        stock = get_peft_model(tiny_model("llama"), config)
        fused = tiny_model("llama")
        transfuse.rewrite(fused)
        fused = get_peft_model(fused, config)
        assert _adapter_targets(fused) == _adapter_targets(stock)
        assert not {"qkv_proj", "gate_up_proj"} & _adapter_targets(fused)


def test_an_adapter_round_trip_into_stock_peft_and_merge_and_unload(tmp_path):
    _, fused = _pair("llama", LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    fused.eval()
    ids = _ids()
    with torch.no_grad():
        want = fused(input_ids=ids).logits
    fused.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)
    stock = PeftModel.from_pretrained(tiny_model("llama"), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    for safe in (False, True):
        base = tiny_model("llama")
        transfuse.rewrite(base)
        merged = PeftModel.from_pretrained(base, tmp_path).eval().merge_and_unload(safe_merge=safe)
        assert isinstance(merged.model.layers[0].self_attn.q_proj, LinearPart)
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_disabled_adapters_give_the_base_model():
    _, fused = _pair("llama", LoraConfig(r=4, target_modules=["q_proj", "gate_proj"]))
    base = tiny_model("llama")
    ids = _ids()
    with torch.no_grad(), fused.disable_adapter():
        torch.testing.assert_close(fused(input_ids=ids).logits, base(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_before_the_rewrite_is_kept_and_the_merges_refused_with_the_reason():
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    _randomise_adapters(model)
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    transfuse.rewrite(model.base_model.model)
    report = transfuse.report(model.base_model.model)
    assert {(s.cls, s.tag) for s in report.skipped} == {("LlamaAttention", "qkv.adapter"), ("LlamaMLP", "gate_up.adapter")}
    assert report.counts() == {"rms_norm": 5, "add_rms_norm": 2, "rotary": 2}
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_a_lora_variant_is_a_clear_error():
    fused = tiny_model("llama")
    transfuse.rewrite(fused)
    model = get_peft_model(fused, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="DoRA"):
        model(input_ids=_ids())


def _train_step_grads(model, ids, seed):
    model.train()
    torch.manual_seed(seed)  # the adapters' dropout masks: drawn in the same order on both models
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_adapters_with_dropout_train_like_the_stock_models():
    stock, fused = _pair("llama", LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.3))
    ids = _ids()
    stock_loss, stock_grads = _train_step_grads(stock, ids, seed=5)
    fused_loss, fused_grads = _train_step_grads(fused, ids, seed=5)
    torch.testing.assert_close(fused_loss, stock_loss, rtol=1e-6, atol=0)
    for name, want in stock_grads.items():
        assert ((fused_grads[name] - want).norm() / want.norm()).item() <= 1e-5, name
    _, other = _train_step_grads(fused, ids, seed=6)  # other masks: the dropout is real
    assert not torch.allclose(other["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
                              fused_grads["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"])  # fmt: skip


def test_two_active_adapters_on_one_part_add_up_like_the_stock_models():
    config = LoraConfig(r=4, target_modules=["q_proj", "up_proj"])
    stock, fused = _pair("llama", config)
    for model in (stock, fused):
        model.add_adapter("second", LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "gate_proj"]))
        model.base_model.set_adapter(["default", "second"])
        _randomise_adapters(model, seed=3)
    ids = _ids()
    _, stock_grads = _train_step_grads(stock, ids, seed=0)
    _, fused_grads = _train_step_grads(fused, ids, seed=0)
    assert stock_grads.keys() == fused_grads.keys() and any(".second." in n for n in fused_grads)
    for name, want in stock_grads.items():
        assert ((fused_grads[name] - want).norm() / want.norm()).item() <= 1e-5, name


def test_under_autocast_adapters_train_like_the_stock_models():
    stock, fused = _pair("llama", LoraConfig(r=4, target_modules=TARGETS))
    ids = _ids()
    results = []
    for model in (stock, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_train_step_grads(model, ids, seed=0))
    (stock_loss, stock_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, stock_loss, rtol=2e-2, atol=0)
    for name, want in stock_grads.items():
        assert ((fused_grads[name] - want).norm() / want.norm()).item() <= 5e-2, name


def test_a_hook_on_a_wrapped_part_runs_as_on_the_stock_model():
    stock, fused = _pair("llama", LoraConfig(r=4, target_modules=["k_proj"]))
    results = []
    for model in (stock, fused):
        calls = []
        k_proj = model.base_model.model.model.layers[0].self_attn.k_proj
        k_proj.register_forward_hook(lambda module, args, out: (calls.append(out), out * 1.5)[1])
        with torch.no_grad():
            results.append((calls, model(input_ids=_ids()).logits))
    (stock_calls, stock_logits), (calls, logits) = results
    assert len(calls) == len(stock_calls) == 1
    torch.testing.assert_close(calls[0], stock_calls[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, stock_logits, rtol=1e-5, atol=1e-5)


def test_mixed_adapter_batches_run_as_on_the_stock_model():
    """PEFT passes ``adapter_names`` to its layers through forward hooks: the hooked parts run as modules."""
    logits = []
    for rewrite in (False, True):
        torch.manual_seed(0)
        base = tiny_model("llama")
        config = LoraConfig(r=4, target_modules=["q_proj", "up_proj"])
        model = get_peft_model(transfuse.rewrite(base) if rewrite else base, config, adapter_name="a")
        model.add_adapter("b", LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
        _randomise_adapters(model)
        with torch.no_grad():
            logits.append(model.eval()(input_ids=_ids(), adapter_names=["a", "b"]).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_a_gate_up_output_is_consumable_with_or_without_adapters_but_not_with_hooks():
    from transfuse.ops.act_and_mul import CONSUMABLE

    fused = tiny_model("llama")
    transfuse.rewrite(fused)
    mlp = fused.model.layers[0].mlp
    x = torch.randn(2, 3, fused.config.hidden_size)
    assert getattr(mlp.gate_up_proj(x), CONSUMABLE, False)
    handle = mlp.gate_up_proj.register_forward_hook(lambda *args: None)  # a hook sees the output
    assert not getattr(mlp.gate_up_proj(x), CONSUMABLE, False)
    handle.remove()
    model = get_peft_model(fused, LoraConfig(r=4, target_modules=["up_proj"]))
    assert getattr(model.base_model.model.model.layers[0].mlp.gate_up_proj(x), CONSUMABLE, False)


def test_adapters_train_like_the_stock_models_when_the_glu_backward_overwrites_its_input(triton_for):
    """The Triton GLU kernels (interpreted without a GPU), whose backward writes the gradient over
    the consumable gate/up output: with adapters on gate and up, the gradients are stock's."""
    stock, fused = _pair("llama", LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    ids = _ids()
    stock_loss, stock_grads = _train_step_grads(stock, ids, seed=0)
    with triton_for("silu_and_mul") as calls:
        fused_loss, fused_grads = _train_step_grads(fused, ids, seed=0)
    assert {(c.op, c.provider) for c in calls if c.op == "silu_and_mul"} == {("silu_and_mul", "triton")}
    torch.testing.assert_close(fused_loss, stock_loss, rtol=1e-6, atol=0)
    for name, want in stock_grads.items():
        assert ((fused_grads[name] - want).norm() / want.norm()).item() <= 1e-5, name


def test_adapters_under_torch_compile_train_like_the_stock_models():
    """One decoder layer: every adapted projection is in it, and Inductor's compile time grows with
    the graph."""
    stock, fused = _pair("llama", LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0), num_hidden_layers=1)
    ids = _ids()
    stock_loss, stock_grads = _train_step_grads(stock, ids, seed=0)
    compiled = torch.compile(fused)
    fused_loss, fused_grads = _train_step_grads(compiled, ids, seed=0)
    torch.testing.assert_close(fused_loss, stock_loss, rtol=1e-6, atol=0)
    for name, want in stock_grads.items():
        got = fused_grads.get(name, fused_grads.get("_orig_mod." + name))  # compile's wrapper prefixes the names
        assert ((got - want).norm() / want.norm()).item() <= 1e-5, name
