"""A model the caller drops is freed, weights and all, however transfuse prepared it: rewritten,
its decode steps on (``transfuse.decode_steps``) or compiled (``transfuse.compile``), after it
generated; and a compiled model's Dynamo entries and compiled graphs go with it.

Dynamo keeps what it is handed past the model's life: every backend ``torch.compile`` is given,
and the compiled entries of a function with their guards and the globals those read, on the
function's code. What transfuse hands it must not hold the model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import transfuse
from transfuse.compile import CompileError, backend
from transfuse.compile.replay import _entry_list
from transfuse.tiny import tiny_model


def _generate(model, device: str, new: int) -> torch.Tensor:
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (2, 7), device=device)
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )


def _prepared(how: str, device: str):
    model = transfuse.rewrite(tiny_model("llama", num_hidden_layers=1).to(device))
    if how == "decode_steps":
        transfuse.decode_steps(model)
    elif how == "compiled":
        transfuse.compile(model, inductor=False, cache_dir=False)
    elif how == "compiled, Inductor":
        transfuse.compile(model, cache_dir=False)
    return model


def _recording_backend(monkeypatch) -> list:
    """What each call of the compile backend got and made: (its keyword arguments, a weak
    reference to the compiled graph)."""
    calls = []
    compile_graph = backend.compile_graph

    def recording(gm, example_inputs, **options):
        made = compile_graph(gm, example_inputs, **options)
        calls.append((options, weakref.ref(made)))
        return made

    monkeypatch.setattr(backend, "compile_graph", recording)
    return calls


HOW = ["rewritten", "decode_steps", "compiled", pytest.param("compiled, Inductor", marks=[pytest.mark.slow])]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", HOW)
def test_a_dropped_model_is_freed_with_its_weights(how, device, monkeypatch):
    calls = _recording_backend(monkeypatch)
    model = _prepared(how, device)
    # On a GPU, enough new tokens for decode steps captured and replayed as graphs.
    _generate(model, device, new=10)
    compiled = how.startswith("compiled")
    if compiled:
        assert model._transfuse_compiled.calls["compiled"] > 0 and calls  # the compiled path ran
        code = model._transfuse_compiled.dynamo.code
        entries = _entry_list() or (lambda code: [None])  # (a torch without the list: not counted)
        assert entries(code)
    weights = [weakref.ref(t) for t in (*model.parameters(), *model.buffers())]
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None
    assert not [w for w in weights if w() is not None]
    if compiled:
        # Dynamo's entries of the compiled function are dropped with the model; the compiled
        # graphs they held become garbage in that collection, and go at the next.
        assert not _entry_list() or not _entry_list()(code)
        gc.collect()
        assert not [made for _, made in calls if made() is not None]
        # What the backend was handed outlives the model in Dynamo, and says it is gone if called.
        options = calls[0][0]
        with pytest.raises(CompileError, match="was freed"):
            options["static_pointers"]()
        with pytest.raises(CompileError, match="was freed"):
            options["on_frame"]()


def test_a_model_compiled_after_another_was_freed_answers_as_its_eager_self():
    """Dropping a compiled model drops its own Dynamo entries only: a model compiled before or
    after it, or the same model compiled again, still compiles and answers as eager."""
    eager = transfuse.rewrite(tiny_model("llama", num_hidden_layers=1))
    want = _generate(eager, "cpu", new=6)
    kept = transfuse.compile(transfuse.rewrite(tiny_model("llama", num_hidden_layers=1)), inductor=False)
    assert torch.equal(_generate(kept, "cpu", new=6), want)
    dropped = transfuse.compile(transfuse.rewrite(tiny_model("llama", num_hidden_layers=1)), inductor=False)
    assert torch.equal(_generate(dropped, "cpu", new=6), want)
    del dropped
    gc.collect()
    assert torch.equal(_generate(kept, "cpu", new=6), want)
    transfuse.compile(kept, inductor=False)  # compiled again: the first compiled state goes
    gc.collect()
    assert torch.equal(_generate(kept, "cpu", new=6), want)
    assert kept._transfuse_compiled.calls["compiled"] > 0
    later = transfuse.compile(transfuse.rewrite(tiny_model("llama", num_hidden_layers=1)), inductor=False)
    assert torch.equal(_generate(later, "cpu", new=6), want)
    assert later._transfuse_compiled.calls["compiled"] > 0
