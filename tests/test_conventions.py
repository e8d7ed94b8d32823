"""transformers' conventions on rewritten models: dtype casts, tied weights, resized embeddings,
sharded checkpoints, the experts implementation."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse.ops import LinearPart, MergedProjection, MoE
from transfuse.rewriter.apply import is_fused
from transfuse.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "gemma2", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]


def _ids(model, seed=0):
    return torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type", FAMILIES)
def test_dtype_casts_carry_the_parts_with_them(model_type):
    """``model.to(dtype)`` and ``.half()`` give the merged tensors new storage; the parts under the
    original names are views of it afterwards (not of the tensors from before the cast)."""
    stock, model = tiny_model(model_type), transfuse.rewrite(tiny_model(model_type))
    parts = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearPart)]
    assert parts
    for name, part in parts:
        part.weight  # noqa: B018 - hand the views out before the cast, as a tool reading them would
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        cast(model), cast(stock)
        stock_params = dict(stock.named_parameters())
        for name, part in parts:
            assert part.weight.dtype == stock_params[f"{name}.weight"].dtype
            assert torch.equal(part.weight, stock_params[f"{name}.weight"])
            merged = part._merged.weight
            assert part.weight.data_ptr() >= merged.data_ptr()  # a view into the merged storage
            assert part.weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    ids = _ids(model)
    model.to(torch.bfloat16), stock.to(torch.bfloat16)
    assert (_logits(model, ids).float() - _logits(stock, ids).float()).abs().max().item() <= 0.1


def _tied_pairs_resolve(model):
    """Each ``_tied_weights_keys`` entry (target -> source) names a parameter of the model, and the
    two are one tensor; the pairs checked."""
    tied = model._tied_weights_keys
    assert isinstance(tied, dict) and tied, tied
    for target, source in tied.items():
        assert model.get_parameter(target) is model.get_parameter(source), (target, source)
    return tied


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tied_weights_stay_tied_and_reload_without_missing_keys(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(model_type, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    keys = dict(_tied_pairs_resolve(model))
    transfuse.rewrite(model)
    assert transfuse.report(model).fusions
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert _tied_pairs_resolve(model) == keys
    model.save_pretrained(tmp_path)
    reloaded, info = transfuse.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert transfuse.report(reloaded).fusions  # output_loading_info: the model is still rewritten
    assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight
    assert _tied_pairs_resolve(reloaded) == keys
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(model)
    got = _logits(reloaded, ids)
    assert torch.equal(got, _logits(model, ids))
    tolerance = 1e-5 if "moe" in transfuse.report(model).counts() else 0.0  # experts sum in another order
    torch.testing.assert_close(got, _logits(stock, ids), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_resize_token_embeddings_after_a_rewrite(model_type):
    model = transfuse.rewrite(tiny_model(model_type))
    stock = tiny_model(model_type)
    fused = sum(map(is_fused, model.modules()))
    for m in (model, stock):
        torch.manual_seed(5)
        m.resize_token_embeddings(300)
    assert fused and sum(map(is_fused, model.modules())) == fused  # still rewritten
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    out = _logits(model, ids)
    assert out.shape[-1] == 300
    assert (out - _logits(stock, ids)).abs().max().item() <= 1e-5
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), stock.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sharded_safetensors_save_loads_in_stock_transformers_bit_for_bit(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    original = tiny_model(model_type)
    model = transfuse.rewrite(tiny_model(model_type))
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.state_dict().keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert not any(isinstance(m, MergedProjection) for m in loaded.modules())


MOE_FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_switching_between_transformers_experts_kernels_keeps_the_fused_layer(model_type):
    """transformers' experts implementations are kernels for one function (generate switches
    grouped_mm to batched_mm on GPUs by itself); the fused layer is one more, and stays."""
    model = transfuse.rewrite(tiny_model(model_type))
    ids = _ids(model)
    before = _logits(model, ids)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers, transfuse.report(model)
    assert all(layer.experts_implementation == model.config._experts_implementation for layer in layers)
    stock = tiny_model(model_type)
    for other in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(other)  # every family here supports the switch
        assert model.config._experts_implementation == other
        assert [m for m in model.modules() if isinstance(m, MoE)] == layers  # the fused layers stay
        assert torch.equal(_logits(model, ids), before), other
        # The stock model gives the same function under each of them.
        stock.set_experts_implementation(other)
        torch.testing.assert_close(_logits(stock, ids), before, rtol=1e-5, atol=1e-5, msg=other)


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_an_experts_implementation_chosen_at_load_is_honoured_by_the_drop_in(model_type, tmp_path):
    """``from_pretrained(..., experts_implementation="eager")`` (the argument, or the config field
    it sets) and then the drop-in: the MoE blocks are still fused, the layer records the choice,
    and the logits are stock transformers' under the same choice."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM as Stock

    tiny_model(model_type).save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    stock = Stock.from_pretrained(tmp_path, experts_implementation="eager").eval()
    assert stock.config._experts_implementation == "eager"
    want = _logits(stock, ids)
    config = AutoConfig.from_pretrained(tmp_path, experts_implementation="eager")
    for model in (
        transfuse.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager"),
        transfuse.AutoModelForCausalLM.from_pretrained(tmp_path, config=config),
    ):
        assert model.config._experts_implementation == "eager"
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        assert layers and all(layer.experts_implementation == "eager" for layer in layers)
        assert "moe" in transfuse.report(model).counts()
        torch.testing.assert_close(_logits(model.eval(), ids), want, rtol=1e-5, atol=1e-5)


def test_an_experts_implementation_from_outside_transformers_is_refused_with_the_way_out():
    from transformers.integrations.moe import ExpertsInterface

    model = transfuse.rewrite(tiny_model("qwen3_moe"))
    ids = _ids(model)
    before = _logits(model, ids)
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    ExpertsInterface.register("user_kernel", ExpertsInterface._global_mapping["batched_mm"])
    try:
        model.set_experts_implementation("user_kernel")
        with pytest.raises(RuntimeError, match=r"experts implementation is now 'user_kernel'.*without the 'moe' fusion"):
            _logits(model, ids)
    finally:
        model.set_experts_implementation(layer.experts_implementation)
        ExpertsInterface._global_mapping.pop("user_kernel", None)
    assert torch.equal(_logits(model, ids), before)


def _plan_entries_used(plan, model):
    """The entries of a parallel plan that match a module or parameter name of ``model``."""
    import re

    found = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    found |= {n.rsplit(".", 1)[0] for n, _ in model.named_parameters()}
    regexes = {p: re.compile(re.escape(p).replace(r"\*", r"\d+")) for p in plan}
    return {p for p, r in regexes.items() if any(r.fullmatch(n) for n in found)}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_tp_plan_entry_still_names_a_module_or_parameter(model_type):
    """transformers' own check of a plan (each entry matches a parameter or a module), on the
    rewritten model: merged parts stay under their names, packed experts keep their tensors.
    Entries the stock model does not use either (dense MLPs of an all-MoE tiny model) are left out."""
    stock, model = tiny_model(model_type), transfuse.rewrite(tiny_model(model_type))
    assert transfuse.report(model).fusions
    plan = getattr(stock, "tp_plan", None) or stock._tp_plan
    if not plan:
        pytest.skip(f"{model_type} has no tensor-parallel plan")
    assert _plan_entries_used(plan, stock) and _plan_entries_used(plan, model) == _plan_entries_used(plan, stock)
    # The rewritten model's plan adds an entry for each merged projection of column-parallel parts, and it
    # names one.
    added = {k: v for k, v in (getattr(model, "tp_plan", None) or model._tp_plan).items() if k not in plan}
    assert set(added.values()) <= {"transfuse_merged_colwise"}
    assert _plan_entries_used(added, model) == set(added)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_every_ep_plan_entry_still_names_a_module_or_parameter(model_type):
    """The same for the expert-parallel plan: the fused MoE block keeps its experts module and
    the packed tensors under their names. (Names only: no expert-parallel run.)"""
    stock, model = tiny_model(model_type), transfuse.rewrite(tiny_model(model_type))
    assert any(f.kind == "moe" for f in transfuse.report(model).fusions)
    plan = getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None)
    if not plan:
        pytest.skip(f"{model_type} has no expert-parallel plan in this transformers")
    assert _plan_entries_used(plan, stock) == set(plan)
    assert _plan_entries_used(plan, model) == set(plan)
