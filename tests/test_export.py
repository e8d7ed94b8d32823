"""``torch.export`` of rewritten models: every family that exports stock exports rewritten (MoE
included: the experts' grouped matmuls have no host sync), with the same logits."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "gemma2", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]


def _export(model, ids):
    return torch.export.export(model, (), {"input_ids": ids, "use_cache": False})


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_rewritten_models_export_where_stock_ones_do(model_type):
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    try:
        _export(tiny_model(model_type), ids)
    except Exception as exc:  # the stock model does not export: nothing to hold the rewrite to
        pytest.skip(f"the stock {model_type} does not export either ({type(exc).__name__})")
    model = tiny_model(model_type)
    transfuse.rewrite(model)
    assert transfuse.report(model).fusions
    exported = _export(model, ids)
    other = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=other, use_cache=False).logits
    torch.testing.assert_close(exported.module()(input_ids=other, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
