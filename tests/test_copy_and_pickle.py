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
from transfuse.rewriter.apply import is_fused
from transfuse.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "gemma2", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
ALL_KINDS = ["rms_norm", "qkv", "gate_up", "moe", "linear_cross_entropy"]


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


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gpt_oss"])
def test_torch_save_and_load_in_this_process(model_type, tmp_path):
    model = _rewritten(model_type)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)


_LOAD = textwrap.dedent(
    """
    import sys, torch, transfuse
    from transfuse.rewriter.apply import is_fused
    model = torch.load(sys.argv[1], weights_only=False)
    ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[3])
    print(sum(map(is_fused, model.modules())))
    """
)


def test_torch_load_in_a_fresh_process_makes_the_rewrite_again(tmp_path):
    model = _rewritten("llama")
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    torch.save(ids, tmp_path / "ids.pt")
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "model.pt"), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) == sum(map(is_fused, model.modules()))
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


def test_a_copy_still_saves_the_original_keys(tmp_path):
    from transformers import AutoModelForCausalLM

    clone = copy.deepcopy(_rewritten("llama"))
    clone.save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "model.layers.0.self_attn.q_proj.weight" in stock.state_dict()
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(stock(ids).logits, clone(ids).logits, atol=1e-5)
