"""Probing, tracing, checking and undoing leave the model's state as it was.

A rewrite runs the model's own Python (the probe, traces on meta tensors, reference runs, the
checks of fused modules). Whatever a forward assigns (a rotary cache moved to the input's device,
a call counter, a global, the random state) is put back: after a rewrite, only what the fusions
changed differs; after a rewrite that fails, nothing does, compared attribute by attribute here.
"""

from __future__ import annotations

import copy
import random
import sys
import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import transfuse

VOCAB = 61
CALLS = 0  # bumped by CountingRotary: a global a forward rebinds


class CachedRotary(nn.Module):
    """The remote-code rotary: cos/sin kept in plain tensor attributes (no buffers), moved to the
    input's device in forward (under tracing: a meta device); a call counter; a random draw."""

    def __init__(self, dim: int, base: float = 10000.0, max_positions: int = 64):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()
        self.sin_cached = emb.sin()

    def forward(self, x, position_ids):
        self.cos_cached = self.cos_cached.to(x.device)
        self.sin_cached = self.sin_cached.to(x.device)
        return self.cos_cached[position_ids].to(x.dtype), self.sin_cached[position_ids].to(x.dtype)


class CountingRotary(CachedRotary):
    """Also counts its calls (an int attribute, a tensor written in place, a module global), keeps
    the last positions it saw, and draws a random number on every call."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.calls = 0
        self.seen = []
        self.register_buffer("tally", torch.zeros(()), persistent=False)

    def forward(self, x, position_ids):
        global CALLS
        CALLS += 1
        self.calls += 1
        self.seen.append(position_ids.shape[-1])
        self.tally += 1
        self.last_draw = torch.rand(())
        return super().forward(x, position_ids)


def _llama(rotary: type) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.model.rotary_emb = rotary(config.hidden_size // config.num_attention_heads)
    with torch.no_grad():  # non-zero norm weights: a fused norm that forgot its weight would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def _rewrite(model: nn.Module, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transfuse.rewrite(model, **kwargs)


@pytest.mark.parametrize("verify", [True, False])
def test_a_rotary_cache_kept_in_plain_attributes_survives_the_rewrite(verify):
    model = _llama(CachedRotary)
    original = copy.deepcopy(model)
    cos = model.model.rotary_emb.cos_cached
    _rewrite(model, verify=verify)
    assert {f.kind for f in transfuse.report(model).fusions} >= {"qkv", "gate_up", "rms_norm", "rotary"}
    assert model.model.rotary_emb.cos_cached is cos and not cos.is_meta
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, original(ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, original.generate(ids, max_new_tokens=5, do_sample=False))


# ---- the whole state, compared attribute by attribute --------------------------------------------


def _value(v):
    """What is compared of one non-tensor attribute: containers by their entries' identities."""
    if isinstance(v, dict):
        return ("dict", id(v), [(k, id(x)) for k, x in v.items()])
    if isinstance(v, (list, set)):
        return (type(v).__name__, id(v), sorted(id(x) for x in v) if isinstance(v, set) else [id(x) for x in v])
    return ("object", id(v))


def _whole_state(model: nn.Module) -> dict:
    """Every module's every attribute: tensors (plain attributes, buffers, parameters) by identity and
    value, everything else by identity (containers by their entries); the globals of the test's
    module; torch's and Python's random state."""
    state = {}
    for path, module in model.named_modules(remove_duplicate=False):
        entries = dict(vars(module))
        tensors = {**{f"attr {k}": v for k, v in entries.items() if isinstance(v, torch.Tensor)},
                   **{f"param {k}": v for k, v in module._parameters.items()},
                   **{f"buffer {k}": v for k, v in module._buffers.items()}}  # fmt: skip
        for key, t in tensors.items():
            state[(path, key)] = None if t is None else (id(t), t.device, t.dtype, t.detach().clone())
        for key, v in entries.items():
            if not isinstance(v, torch.Tensor):
                state[(path, f"attr {key}")] = _value(v)
    state["globals"] = {k: id(v) for k, v in vars(sys.modules[__name__]).items()}
    state["rng"] = (torch.get_rng_state(), random.getstate())
    return state


def _differences(before: dict, after: dict) -> list[str]:
    found = [f"{k} appeared" for k in after.keys() - before.keys()] + [f"{k} is gone" for k in before.keys() - after.keys()]
    for key in before.keys() & after.keys():
        a, b = before[key], after[key]
        if key == "rng":
            if not (torch.equal(a[0], b[0]) and a[1] == b[1]):
                found.append("the random state moved")
        elif isinstance(a, tuple) and len(a) == 4 and isinstance(a[3], torch.Tensor):
            if not (isinstance(b, tuple) and a[:3] == b[:3] and torch.equal(a[3], b[3])):
                found.append(f"{key} differs")
        elif a != b:
            found.append(f"{key} differs")
    return found


class _ReadsQueryWeight(nn.Module):
    """A model whose forward reads a projection's own weight: once q, k, v are merged it raises,
    and the rewrite fails part-way (in the whole model's check, after the fused modules ran)."""

    def __init__(self, inner: LlamaForCausalLM):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        weight = self.inner.model.layers[0].self_attn.q_proj._parameters["weight"]
        return self.inner(input_ids).logits * weight.norm()


def test_a_failed_rewrite_leaves_the_whole_model_state_as_it_was():
    model = _ReadsQueryWeight(_llama(CountingRotary))
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
    torch.manual_seed(5)
    before = _whole_state(model)
    with pytest.raises(transfuse.RewriteError, match="every fusion was undone and the model is as it was[.]$"):
        _rewrite(model, example_inputs=(ids,))
    assert _differences(before, _whole_state(model)) == []
    with torch.no_grad():
        assert torch.equal(model(ids), want)


def test_what_forwards_change_is_put_back_after_a_rewrite():
    model = _llama(CountingRotary)
    rotary = model.model.rotary_emb
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    calls, tally = CALLS, rotary.tally
    _rewrite(model)
    assert transfuse.report(model).fusions, "nothing was fused: the state would trivially be as it was"
    assert (rotary.calls, rotary.seen, CALLS, rotary.tally.item()) == (0, [], calls, 0.0)
    assert rotary.tally is tally and "last_draw" not in vars(rotary)
    assert torch.equal(torch.get_rng_state(), rng)
    with torch.no_grad():
        model(torch.randint(1, VOCAB, (1, 4)))
    assert (rotary.calls, rotary.seen, rotary.tally.item()) == (1, [4], 1.0)
