"""Parameters and modules the model holds in several places stay one after a rewrite: the fusions that
would copy them or take their place at one of them are refused with a reason, the others are made."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import transfuse
from transfuse.tiny import tiny_config

IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def _shared(change):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    change(stock.model.layers)
    return stock, transfuse.rewrite(copy.deepcopy(stock))


def _train_step(model) -> None:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    model.eval()


def _share_q_weight(layers):
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight


def _share_up_weight(layers):
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight


def _share_k_module(layers):
    layers[1].self_attn.k_proj = layers[0].self_attn.k_proj


@pytest.mark.parametrize(
    "change,kind,tag",
    [(_share_q_weight, "qkv", "qkv.shared-weight"), (_share_up_weight, "gate_up", "gate_up.shared-weight"),
     (_share_k_module, "qkv", "qkv.shared-module")],
)  # fmt: skip
def test_a_shared_parameter_or_module_refuses_only_the_fusions_that_would_split_it(change, kind, tag):
    stock, model = _shared(change)
    report = transfuse.report(model)
    assert sorted((s.path, s.tag) for s in report.skipped if s.kind == kind) == [
        (f"model.layers.{i}.{'self_attn' if kind == 'qkv' else 'mlp'}", tag) for i in (0, 1)
    ]
    assert kind not in report.counts() and report.counts()["rms_norm"] == 5  # the rest of the model is fused
    other = "gate_up" if kind == "qkv" else "qkv"
    assert report.counts()[other] == 2
    assert model.state_dict().keys() == stock.state_dict().keys()
    for m in (stock, model):
        _train_step(m)
    layers = model.model.layers
    one = {
        "qkv.shared-module": lambda: layers[1].self_attn.k_proj is layers[0].self_attn.k_proj,
        "qkv.shared-weight": lambda: layers[1].self_attn.q_proj.weight is layers[0].self_attn.q_proj.weight,
        "gate_up.shared-weight": lambda: layers[1].mlp.up_proj.weight is layers[0].mlp.up_proj.weight,
    }
    assert one[tag]()  # still one parameter (one storage, one gradient)
    after, stock_after = model.state_dict(), stock.state_dict()
    assert all(torch.allclose(after[k], stock_after[k], rtol=1e-4, atol=1e-6) for k in stock_after)
    torch.testing.assert_close(model(IDS).logits, stock(IDS).logits, rtol=1e-4, atol=1e-5)


def test_a_block_shared_whole_with_its_children_is_fused_once_for_every_place():
    def share_attention(layers):
        layers[1].self_attn = layers[0].self_attn

    stock, model = _shared(share_attention)
    layers = model.model.layers
    assert layers[1].self_attn is layers[0].self_attn and "qkv_proj" in layers[0].self_attn._modules
    assert model.state_dict().keys() == stock.state_dict().keys()
    torch.testing.assert_close(model(IDS).logits, stock(IDS).logits, rtol=1e-4, atol=1e-5)
