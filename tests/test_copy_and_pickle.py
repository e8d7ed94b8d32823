"""Rewritten models copy and pickle: ``copy.deepcopy``, ``torch.save(model)`` and ``torch.load`` in
this process and in a fresh one give a model that is still rewritten, still an instance of its
class, independent of the original, and gives the same outputs."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import transfuse
from transfuse.ops import LinearPart, MergedProjection
from transfuse.rewriter.apply import REWRITTEN_ATTR, is_fused
from transfuse.rewriter.source import rewrite_of
from transfuse.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "gemma2", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
ALL_KINDS = transfuse.fusers.kinds()  # the opt-in loss with every default kind


def runs_its_rewrite(model) -> int:
    """How many rewritten modules run their rewrite bound to themselves (the same logits would come
    from the original forward too, so a copy that lost its rewrites would pass on logits alone);
    raises where one does not."""
    rewritten = [m for m in model.modules() if REWRITTEN_ATTR in m.__dict__]
    for module in rewritten:
        forward = module.__dict__.get("forward")
        assert rewrite_of(forward) is module.__dict__[REWRITTEN_ATTR] and forward.__self__ is module, module
    return len(rewritten)


def _ids():
    return torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))


def _rewritten(model_type):
    model = tiny_model(model_type)
    transfuse.rewrite(model, fusions=ALL_KINDS)
    return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_deepcopy_is_rewritten_independent_and_equal(model_type):
    model = _rewritten(model_type)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    clone = copy.deepcopy(model)
    assert type(clone) is type(model) and transfuse.report(clone).counts() == transfuse.report(model).counts()
    assert runs_its_rewrite(clone) == runs_its_rewrite(model) > 0
    assert sum(map(is_fused, clone.modules())) == sum(map(is_fused, model.modules()))
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, want)
    merged = [m for m in clone.modules() if isinstance(m, MergedProjection)]
    originals = {id(p) for p in model.parameters()}
    assert not any(id(p) in originals for p in clone.parameters())
    if merged:  # the parts of the copy are views of the copy's merged weights
        part = next(m for m in clone.modules() if isinstance(m, LinearPart))
        assert any(part.weight.data_ptr() == m.weight.data_ptr() for m in merged)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
        assert torch.equal(model(ids).logits, want)


def _stock_logits(model_type, ids):
    """The unmodified model's logits (same seed, so the same weights as ``_rewritten``'s)."""
    with torch.no_grad():
        return tiny_model(model_type)(ids).logits


@pytest.mark.parametrize("model_type", FAMILIES)
def test_torch_save_and_load_in_this_process(model_type, tmp_path):
    model = _rewritten(model_type)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is type(model)
    assert runs_its_rewrite(loaded) == runs_its_rewrite(model) > 0
    assert transfuse.report(loaded).counts() == transfuse.report(model).counts()
    assert sum(map(is_fused, loaded.modules())) == sum(map(is_fused, model.modules())) > 0
    originals = {id(p) for p in model.parameters()}
    assert not any(id(p) in originals for p in loaded.parameters())
    with torch.no_grad():
        got = loaded(ids).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _stock_logits(model_type, ids), rtol=1e-5, atol=1e-5)


_LOAD = textwrap.dedent(
    """
    import json, sys, torch, transfuse
    from transfuse.rewriter.apply import is_fused
    from tests.test_copy_and_pickle import runs_its_rewrite
    torch.set_num_threads(int(sys.argv[4]))  # the parent's: bit-equal sums need the same split
    model = torch.load(sys.argv[1], weights_only=False)
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[3])
    print(json.dumps([sum(map(is_fused, model.modules())), transfuse.report(model).counts(), runs_its_rewrite(model)]))
    """
)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_torch_load_in_a_fresh_process_makes_the_rewrite_again(model_type, tmp_path):
    import json

    model = _rewritten(model_type)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "model.pt"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"),
         str(torch.get_num_threads())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    fused, counts, running = json.loads(done.stdout.strip().splitlines()[-1])
    assert fused == sum(map(is_fused, model.modules())) > 0
    assert running == runs_its_rewrite(model) > 0
    assert counts == transfuse.report(model).counts()
    got = torch.load(tmp_path / "out.pt")
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _stock_logits(model_type, ids), rtol=1e-5, atol=1e-5)


def test_a_copy_still_saves_the_original_keys(tmp_path):
    from transformers import AutoModelForCausalLM

    clone = copy.deepcopy(_rewritten("llama"))
    clone.save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn.q_proj.weight" in stock.state_dict()
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(stock(ids).logits, clone(ids).logits, atol=1e-5)
