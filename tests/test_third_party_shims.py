"""The corpus shims (``benchmarks/third_party_shims.py``) on toy classes written as transformers 4.x
wrote them: an output dataclass with a ``past_key_values`` field, a model calling the old mask
helpers and ``init_weights`` in place of ``post_init``, an old ``tie_weights(self)``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.utils import ModelOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import third_party_shims as shims  # noqa: E402


def test_an_old_outputs_past_key_values_field_is_built_and_read_under_its_old_name():
    base = shims._adapted("ModelOutput", ModelOutput)

    @dataclass
    class OldOutput(base):
        last_hidden_state: torch.Tensor | None = None
        past_key_values: tuple | None = None
        hidden_states: tuple | None = None

    cache, hidden = (torch.ones(1),), torch.zeros(2)
    out = OldOutput(last_hidden_state=hidden, past_key_values=cache)
    assert out.past_key_values is cache and out["past_key_values"] is cache and out.to_tuple() == (hidden, cache)


class _OldModel(shims._adapted("PreTrainedModel", PreTrainedModel)):
    config_class = LlamaConfig
    tied = 0

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(4, 4)
        self.init_weights()  # the older API, where newer files call post_init

    def tie_weights(self):  # the old signature
        type(self).tied += 1

    def forward(self, mask):
        return self.get_extended_attention_mask(mask, mask.shape), self.get_head_mask(None, 3)


def test_an_old_model_builds_and_calls_the_old_mask_helpers():
    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=8)
    config.is_decoder = False  # what the old configurations set (the corpus gives it them)
    model = _OldModel(config)
    assert _OldModel.tied >= 1 and hasattr(model, "all_tied_weights_keys")
    mask = torch.tensor([[1, 1, 0]])
    extended, heads = model(mask)
    minimum = torch.finfo(torch.float32).min
    assert torch.equal(extended, torch.tensor([[[[0.0, 0.0, minimum]]]])) and heads == [None] * 3
    config.is_decoder = True  # causal as well
    extended, _ = model(torch.ones(1, 3, dtype=torch.long))
    assert torch.equal(extended[0, 0] == 0, torch.ones(3, 3).tril().bool())
