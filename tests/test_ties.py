"""Tied weights: a rewrite makes no tie the stock model does not have.

The parts of a merged projection share the merged tensor's memory, yet every tie check
(transformers' storage grouping, accelerate's ``find_tied_parameters``, safetensors' shared-tensor
handling, ``tie_weights``) answers for a rewritten model what it answers for the stock one.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from accelerate.utils import find_tied_parameters
from safetensors.torch import load_file, save_model
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import _get_tied_weight_keys
from transformers.pytorch_utils import id_tensor_storage

import transfuse
from transfuse.rewriter.weights import merges_of, unmerge_linears
from transfuse.tiny import tiny_config

IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def _tied(model_type: str, tie: bool = True):
    torch.manual_seed(0)
    config = tiny_config(model_type)
    config.tie_word_embeddings = tie
    return AutoModelForCausalLM.from_config(config).eval()


def _storage_groups(model) -> list[list[str]]:
    """Names of the state dict grouped by storage, as transformers' tie checks group them."""
    groups = collections.defaultdict(list)
    for name, tensor in model.state_dict().items():
        groups[id_tensor_storage(tensor)].append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_tie_detection_answers_for_the_rewritten_model_what_it_answers_for_the_stock_one(model_type):
    stock = _tied(model_type)
    model = transfuse.rewrite(copy.deepcopy(stock))
    assert {"qkv"} <= set(transfuse.report(model).counts())
    assert _storage_groups(model) == _storage_groups(stock) == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert find_tied_parameters(model) == find_tied_parameters(stock) != []
    assert _get_tied_weight_keys(model) == _get_tied_weight_keys(stock)
    expanded = [m.get_expanded_tied_weights_keys(all_submodels=True) for m in (model, stock)]
    assert expanded[0] == expanded[1]
    # The parts are the merged tensor's own memory (no copy), each over a storage of its own.
    attention = model.model.layers[0].self_attn
    merged = attention.qkv_proj.weight
    state = attention.state_dict()
    start, end = merged.data_ptr(), merged.data_ptr() + merged.nbytes
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        assert start <= state[name].data_ptr() < end
        assert state[name].untyped_storage().data_ptr() == state[name].data_ptr()
    # tie_weights ties the declared pair and nothing else.
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model(IDS).logits, stock(IDS).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_and_save_pretrained_write_the_stock_keys_and_reload_without_warnings(tmp_path, tie):
    stock = _tied("llama", tie)
    model = transfuse.rewrite(copy.deepcopy(stock))
    save_model(model, tmp_path / "direct.safetensors")  # raised on shared tensors before
    save_model(stock, tmp_path / "stock.safetensors")
    direct, expected = load_file(tmp_path / "direct.safetensors"), load_file(tmp_path / "stock.safetensors")
    assert direct.keys() == expected.keys()
    assert all(torch.equal(direct[k], expected[k]) for k in expected)
    for name, source in (("rewritten", model), ("stock", stock)):
        source.save_pretrained(tmp_path / name)
    saved, stock_saved = (load_file(tmp_path / name / "model.safetensors") for name in ("rewritten", "stock"))
    assert saved.keys() == stock_saved.keys() and ("lm_head.weight" in saved) != tie
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "rewritten", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tie
    torch.testing.assert_close(reloaded.eval()(IDS).logits, stock(IDS).logits, rtol=1e-4, atol=1e-5)


def test_an_undone_merge_leaves_parts_with_storages_of_their_own():
    model = transfuse.rewrite(_tied("llama", tie=False))
    for module in model.modules():
        for into in list(merges_of(module)):
            unmerge_linears(module, into)
    assert _storage_groups(model) == []
