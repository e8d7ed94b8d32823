"""Layers offloaded by accelerate (``device_map`` with disk offload: their parameters on the meta device
in a model that has real ones) are refused, each fusion once, for the modules it concerns only: a kind
that does not match a module's class (gate_up on an attention block) is not reported for it."""

from __future__ import annotations

from collections import Counter

import torch
from transformers import AutoModelForCausalLM

import transfuse
from transfuse.tiny import tiny_model


def test_an_offloaded_layer_is_refused_once_per_fusion_that_concerns_it(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
        "model.rotary_emb": "cpu", "lm_head": "cpu",
    }  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "off")
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    transfuse.rewrite(model)
    report = transfuse.report(model)
    offloaded = [(s.kind, s.path) for s in report.skipped if s.tag == "instance.offloaded"]
    assert sorted(offloaded) == [
        ("add_rms_norm", "model.layers.1"),
        ("gate_up", "model.layers.1.mlp"),
        ("qkv", "model.layers.1.self_attn"),
        ("rms_norm", "model.layers.1.input_layernorm"),
        ("rms_norm", "model.layers.1.post_attention_layernorm"),
        ("rotary", "model.layers.1.self_attn"),
    ], offloaded
    assert Counter(kind for kind, _ in offloaded) == {"rms_norm": 2, "add_rms_norm": 1, "qkv": 1, "rotary": 1, "gate_up": 1}
    # The layer on the CPU fuses as it would alone.
    assert {f.path for f in report.fusions if f.path.startswith("model.layers.0")} >= {
        "model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp",
    }  # fmt: skip
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
