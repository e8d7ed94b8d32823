"""Rewritten models on a CUDA GPU, in bf16, with the platform's default providers (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse import ops
from transfuse.tiny import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3", "olmo2", "llama4_text"])
def test_rewritten_model_on_gpu_matches_in_bf16(model_type):
    model = tiny_model(model_type, dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 33), device="cuda")
    with torch.no_grad():
        before = model(input_ids=ids).logits.float()
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert report.counts().get("rms_norm") and report.counts().get("qkv")
    assert not [s for s in report.skipped if s.tag == "verify.mismatch"], report
    with ops.trace() as log, torch.no_grad():
        after = model(input_ids=ids).logits.float()
    providers = {d.op: d.provider for d in log}
    assert providers["rms_norm"] != "native", providers  # a GPU kernel ran
    assert ((after - before).abs().max() / before.abs().max()).item() < 2e-2


def test_from_pretrained_with_device_map_on_gpu(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    model = transfuse.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda")
    assert next(model.parameters()).device.type == "cuda"
    assert transfuse.report(model).counts() == {"rms_norm": 5, "add_rms_norm": 2, "qkv": 2, "gate_up": 2, "rotary": 2}
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]], device="cuda")).logits).all()
