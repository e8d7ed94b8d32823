"""``generate`` on a rewritten model that is not compiled: decode steps through a key/value store
and, on CUDA, replayed as CUDA graphs of the eager forward (``transfuse/compile/eager_steps.py``).

Every answer is compared with the same model's ``generate`` with the path turned off
(``TRANSFUSE_STEP_GRAPHS=0``); the other tests set it on (``TRANSFUSE_STEP_GRAPHS=1``, the
default). On the CPU the path's steps run through the store
without graphs (``eager_steps.STORE = True``, the refusal of a CPU model lifted): the wiring, the
store's attention and the loops; the graphs themselves run on a GPU only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading

import pytest
import torch

import transfuse
from transfuse.compile import eager_steps
from transfuse.ops import dispatch, graphs
from transfuse.tiny import tiny_model

from .test_compile import _generated_in_two_threads
from .test_compile import _model as _rewritten
from .test_compile import _streamed as streamed
from .test_compile import _padded_batch as _batch


def _model(*args, **kwargs):
    """A rewritten tiny model with its decode steps on (``transfuse.decode_steps``)."""
    return transfuse.decode_steps(_rewritten(*args, **kwargs))


@pytest.fixture(autouse=True)
def path_on(monkeypatch):
    monkeypatch.setenv(eager_steps.ENV, "1")


@contextlib.contextmanager
def _path_turned_off(off):
    """Inside, the path is turned off (``TRANSFUSE_STEP_GRAPHS=0``) if ``off``."""
    saved = os.environ[eager_steps.ENV]
    if off:
        os.environ[eager_steps.ENV] = "0"
    try:
        yield
    finally:
        os.environ[eager_steps.ENV] = saved


def _generate(model, ids, mask, new=12, off=False, **options):
    with _path_turned_off(off), torch.no_grad():
        torch.manual_seed(5)
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, **options)

CASES = {
    "greedy": {"min_new_tokens": 12, "do_sample": False},
    "sampling": {"min_new_tokens": 12, "do_sample": True, "top_k": 20},
    "transformers' loop, logits": {"min_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True,
                                   "output_logits": True},
    "beam search": {"min_new_tokens": 12, "do_sample": False, "num_beams": 2},
}


def _same(got, want, case):
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), case
        return
    assert torch.equal(got.sequences, want.sequences), case
    assert len(got.logits) == len(want.logits), case
    for mine, theirs in zip(got.logits, want.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def _streamed(model, ids, mask, off=False, **options):
    """``generate`` of the first row with transformers' ``TextIteratorStreamer``: (tokens, text)."""
    with _path_turned_off(off):
        return streamed(model, ids[:1], mask[:1], **options)


def admitted_on_cpu(admission):
    """``eager_steps._admission`` with the refusal of weights off CUDA lifted."""

    def on_cpu(model):
        why, configs = admission(model)
        if why == "the model's weights are not all on one CUDA device":
            return None, eager_steps.check(model)
        return why, configs

    return on_cpu


@pytest.fixture
def store_on_cpu(monkeypatch):
    """The path's steps through the store on the CPU (no graphs there)."""
    monkeypatch.setattr(eager_steps, "STORE", True)
    monkeypatch.setattr(eager_steps, "_admission", admitted_on_cpu(eager_steps._admission))


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_steps_through_the_store_give_the_model_s_answers(model_type, store_on_cpu):
    model = _model(model_type)
    ids, mask = _batch()
    for case, options in CASES.items():
        want = _generate(model, ids, mask, off=True, **options)
        before = eager_steps.stats(model)
        got = _generate(model, ids, mask, **options)
        after = eager_steps.stats(model)
        _same(got, want, case)
        assert after["loops"] == before["loops"] + 1 and after["steps"] >= before["steps"] + 11, case
        assert after["refused"] is None and model.__dict__["_compiled_call_impl"] is None
    # End tokens that end some rows early: padded after them, the same as the model's own loop.
    greedy = _generate(model, ids, mask, **CASES["greedy"])
    ended = sorted({int(greedy[0, ids.shape[1] + 2]), int(greedy[1, ids.shape[1] + 5])})
    options = {"eos_token_id": ended, "pad_token_id": 0, "do_sample": False}
    assert torch.equal(_generate(model, ids, mask, **options), _generate(model, ids, mask, off=True, **options))


def _a_long_loop(device):
    """``generate`` of 300 tokens, the store growing on the way (256, then 512 positions): the
    same tokens as the path turned off; (tokens, the path's stats for the loop)."""
    model = _model("llama", device=device, num_hidden_layers=1, max_position_embeddings=1024)
    ids, mask = _batch(device)
    options = {"new": 300, "min_new_tokens": 300, "do_sample": False}
    want = _generate(model, ids, mask, off=True, **options)
    before = eager_steps.stats(model)
    got = _generate(model, ids, mask, **options)
    after = eager_steps.stats(model)
    assert torch.equal(got, want)
    assert after["loops"] == before["loops"] + 1 and after["steps"] == before["steps"] + 299
    return {name: after[name] - before[name] for name in ("replays", "capture_s")}


def test_a_long_loop_grows_its_store_and_gives_the_model_s_answers(store_on_cpu, monkeypatch):
    from transfuse.compile import kv_store

    capacities = []
    grow = kv_store.KVStore._grow

    def growing(self, need):
        grow(self, need)
        capacities.append(self.capacity)

    monkeypatch.setattr(kv_store.KVStore, "_grow", growing)
    assert _a_long_loop("cpu") == {"replays": 0, "capture_s": 0.0}
    assert capacities == [256, 512]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_long_loop_captures_again_where_its_store_grows():
    # A capture at the second step and at each growth (their second steps): all but a few replayed.
    assert _a_long_loop("cuda")["replays"] >= 299 - 6


def test_a_loop_with_transformers_streamer_goes_through_the_path_and_streams_every_token(store_on_cpu):
    model = _model("qwen3_moe")
    ids, mask = _batch()
    options = {"max_new_tokens": 12, "min_new_tokens": 12}
    want, want_text = _streamed(model, ids, mask, off=True, **options)
    loops = eager_steps.stats(model)["loops"]
    got, text = _streamed(model, ids, mask, **options)
    assert eager_steps.stats(model)["loops"] == loops + 1
    assert torch.equal(got, want) and text == want_text
    assert len(text.split()) == ids.shape[1] + 12  # the prompt, then every new token


def test_a_generate_call_in_another_thread_during_a_loop_runs_as_usual(store_on_cpu, monkeypatch):
    """While a loop runs its steps through the path, another thread's ``generate`` of the same
    model is refused (saying why) and its calls of the model, which reach the loop's object, run
    the model's own forward: both get the model's answers."""
    model = _model("llama", num_hidden_layers=2)
    ids, mask = _batch()
    options = {"new": 8, "min_new_tokens": 8, "do_sample": False}
    want = _generate(model, ids, mask, off=True, **options)
    want_other = _generate(model, ids[:1], mask[:1], off=True, **options)
    other = {}
    loop_step = eager_steps.EagerSteps.__call__

    def step(self, *args, **kwargs):
        if self.calls["store"] == 3 and not other:  # the loop's fourth step waits for the other call
            other["started"] = True

            def generate():
                other["tokens"] = _generate(model, ids[:1], mask[:1], **options)
                other["refused"] = eager_steps.stats(model)["refused"]

            thread = threading.Thread(target=generate)
            thread.start()
            thread.join()
        return loop_step(self, *args, **kwargs)

    monkeypatch.setattr(eager_steps.EagerSteps, "__call__", step)
    before = eager_steps.stats(model)
    got = _generate(model, ids, mask, **options)
    after = eager_steps.stats(model)
    assert torch.equal(got, want) and torch.equal(other["tokens"], want_other)
    assert other["refused"].startswith("another generate call of this model runs its steps through the path")
    assert after["loops"] == before["loops"] + 1 and after["steps"] == before["steps"] + 7
    assert model.__dict__["_compiled_call_impl"] is None


def test_another_thread_s_forward_never_runs_while_a_step_switches_the_attention(store_on_cpu, monkeypatch):
    """A step switches the configs' attention implementation to the path's for its length; another
    thread's ``generate`` of the model, started in the middle of a step (found on the H200: its
    forward then reached the path's attention with a mask of its own and raised), waits for the
    step and runs the model's own forward: both answers are the model's."""
    import time

    from transfuse.compile import kv_store

    model = _model("llama", num_hidden_layers=2)
    ids, mask = _batch()
    options = {"new": 8, "min_new_tokens": 8, "do_sample": False}
    want = _generate(model, ids, mask, off=True, **options)
    want_other = _generate(model, ids[1:2], mask[1:2], off=True, **options)  # (a padded row)
    other, threads = {}, []
    attend = kv_store.KVStore.attend

    def attending(self, *args, **kwargs):
        if not threads:  # the first step's first layer: the switch is on
            def generate():
                try:
                    other["tokens"] = _generate(model, ids[1:2], mask[1:2], **options)
                except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                    other["error"] = exc

            threads.append(threading.Thread(target=generate))
            threads[0].start()
            time.sleep(0.5)  # (time for the other thread to reach the model's forward, if it can)
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(kv_store.KVStore, "attend", attending)
    got = _generate(model, ids, mask, **options)
    threads[0].join(timeout=120)
    assert "error" not in other, other.get("error")
    assert torch.equal(got, want) and torch.equal(other["tokens"], want_other)


@pytest.mark.parametrize("model_type", ["xglm", "falcon"])
def test_a_model_the_path_cannot_serve_gets_its_own_answers_and_later_loops_refused(model_type, store_on_cpu):
    """XGLM's attention is its own code, not transformers' attention functions, so the first step
    through the store leaves its layers unserved (their attention would have run without the
    cache); falcon's raises inside the path. Either way the step is answered by the model's own
    forward (nothing of the store's had reached the cache), with one warning, and the model's
    later loops are refused, saying why."""
    model = _model(model_type)
    ids, mask = _batch()
    options = CASES["transformers' loop, logits"]
    want = _generate(model, ids, mask, off=True, **options)
    with pytest.warns(UserWarning, match="runs its own forward from now on, not the decode path"):
        got = _generate(model, ids, mask, **options)
    _same(got, want, model_type)
    reason = eager_steps.stats(model)["failed"]
    expected = "_Unserved: of the cache's 2 layers, 2 did not attend" if model_type == "xglm" else "TypeError"
    assert reason.startswith(expected), reason
    _same(_generate(model, ids, mask, **options), want, model_type)
    assert eager_steps.stats(model)["refused"] == (
        f"a call of an earlier loop through the path failed where the model's own forward did not ({reason})"
    )


def test_a_model_that_caches_latents_runs_its_own_steps_without_a_warning(store_on_cpu, recwarn):
    """DeepSeek-V3's latent attention caches its compressed latents, not the keys and values it
    attends with: the store laid out from the cache cannot take them, so the first step is run by
    the model's own forward (nothing written), the loop's other steps too, and later loops are
    refused up front; no warning (nothing failed), the reason in ``stats``."""
    model = _model("deepseek_v3")
    ids, mask = _batch()
    options = CASES["transformers' loop, logits"]
    want = _generate(model, ids, mask, off=True, **options)
    _same(_generate(model, ids, mask, **options), want, "first loop")
    stats = eager_steps.stats(model)
    assert stats["loops"] == 1 and stats["steps"] == 0 and stats["failed"] is None, stats
    assert stats["refused"].startswith("its decode steps could not go through a key/value store (layer 0 attends")
    assert "latent attention caches its latents" in stats["refused"]
    _same(_generate(model, ids, mask, **options), want, "second loop")
    assert eager_steps.stats(model)["loops"] == 1
    assert eager_steps.stats(model)["refused"].startswith("an earlier loop's decode steps could not go through")
    assert not [w for w in recwarn if "transfuse" in str(w.message)]


def test_the_model_is_left_as_it_was_when_the_loop_raises(store_on_cpu):
    model = _model(num_hidden_layers=1)
    ids, mask = _batch()

    class Boom(Exception):
        pass

    calls = []

    @functools.wraps(type(model).forward)  # (its signature: the path reads the forward's parameters)
    def raises_at_the_third_call(*args, **kwargs):  # the prompt's, a step's, then this
        calls.append(1)
        if len(calls) > 2:
            raise Boom
        return type(model).forward(model, *args, **kwargs)

    model.forward = raises_at_the_third_call
    with pytest.raises(Boom):
        _generate(model, ids, mask, do_sample=False)
    assert model.__dict__["_compiled_call_impl"] is None
    del model.forward
    assert torch.equal(_generate(model, ids, mask, do_sample=False), _generate(model, ids, mask, off=True, do_sample=False))


_CLASSES_CHANGED = """
import sys

import torch

import transfuse
from transfuse.tiny import tiny_model


def snapshot():
    found = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] == "transformers":
            for key, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == name:
                    found.update({(key, attribute): id(member) for attribute, member in list(vars(value).items())})
    return found


def changed(before, after):
    return sorted(".".join(key) for key in after if before.get(key) != after[key])


model = tiny_model("llama", num_hidden_layers=1).eval()
ids = torch.randint(0, 256, (1, 5))
with torch.no_grad():
    model.generate(ids, max_new_tokens=2, do_sample=False)  # (transformers' own imports on the way)
    before = snapshot()
    transfuse.rewrite(model)
    model.generate(ids, max_new_tokens=2, do_sample=False)
    after = snapshot()
    print(changed(before, after))
    transfuse.decode_steps(model)
    model.generate(ids, max_new_tokens=2, do_sample=False)
    print(changed(after, snapshot()))
"""


def test_a_rewrite_changes_no_transformers_class_and_decode_steps_wrap_only_the_loops():
    """In a fresh process: every attribute of every transformers class is the same object after a
    rewrite and a ``generate``; ``decode_steps`` then wraps the two decoding loops and the deferred
    stop check, and nothing else."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CLASSES_CHANGED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    by_rewrite, by_decode_steps = done.stdout.strip().splitlines()[-2:]
    assert by_rewrite == "[]"
    assert by_decode_steps == "['DeferredStopCheck.is_supported', 'GenerationMixin._beam_search', 'GenerationMixin._sample']"


def test_decode_steps_are_the_model_s_own(store_on_cpu):
    """Two rewritten models in one process: the one given decode steps takes them, the other runs
    transformers' loop untouched (never asked); a copy keeps them; a model that was not rewritten is
    refused with the way out; the report of a plain rewrite says how to get them; the drop-in gives them."""
    from transfuse.api import DECODE_STEPS_NOTE
    from transfuse.compile import generate

    given, plain = _model(num_hidden_layers=1), _rewritten(num_hidden_layers=1)
    ids, mask = _batch()
    assert torch.equal(_generate(given, ids, mask, do_sample=False), _generate(plain, ids, mask, do_sample=False))
    assert eager_steps.stats(given)["loops"] == 1
    assert eager_steps.stats(plain) == eager_steps._fresh()
    assert eager_steps.refusal(plain) == "its decode steps are not turned on (transfuse.decode_steps(model) turns them on)"
    assert generate.served_by(copy.deepcopy(given)) is eager_steps.for_loop
    assert DECODE_STEPS_NOTE in transfuse.report(plain).notes and "transfuse.decode_steps(model)" in DECODE_STEPS_NOTE
    with pytest.raises(ValueError, match=r"LlamaForCausalLM was not: call transfuse.rewrite\(model\) first"):
        transfuse.decode_steps(tiny_model("llama", num_hidden_layers=1))
    loaded = transfuse.AutoModelForCausalLM.from_config(tiny_model("llama", num_hidden_layers=1).config)
    assert generate.served_by(loaded) is eager_steps.for_loop


def test_moe_layers_replay_small_batches_only_where_the_caller_asked():
    """A rewrite leaves the fused MoE layers' small-batch graphs off (its verification runs their
    code); ``decode_steps`` and ``transfuse.compile`` turn them on, for their model's layers only."""
    from transfuse.ops import MoE

    models = [_rewritten("qwen3_moe", num_hidden_layers=1) for _ in range(3)]
    flags = lambda model: [m.graph_small_batches for m in model.modules() if isinstance(m, MoE)]  # noqa: E731
    assert [flags(model) for model in models] == [[False]] * 3
    transfuse.decode_steps(models[0])
    transfuse.compile(models[1], inductor=False)
    assert [flags(model) for model in models] == [[True], [True], [False]]


def test_loops_the_path_does_not_take_say_why(monkeypatch):
    model = _model(num_hidden_layers=1)
    ids, mask = _batch()
    monkeypatch.delenv(eager_steps.ENV)
    with torch.no_grad():
        assert eager_steps.refusal(model) == (
            "the model's weights are not all on one CUDA device" if eager_steps.ON_BY_DEFAULT
            else f"off ({eager_steps.ENV}=1 turns it on)"
        )
    monkeypatch.setenv(eager_steps.ENV, "0")
    with torch.no_grad():
        assert eager_steps.refusal(model) == f"turned off ({eager_steps.ENV}=0)"
    monkeypatch.setenv(eager_steps.ENV, "1")
    _generate(model, ids, mask, new=2)
    assert eager_steps.stats(model)["refused"] == "the model's weights are not all on one CUDA device"
    _generate(model, ids, mask, new=2, off=True)
    assert eager_steps.stats(model)["refused"].startswith("turned off")
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    _generate(model, ids, mask, new=2)
    assert eager_steps.stats(model)["refused"] == "model.layers.0.mlp has a forward hook (it would run once, at the capture)"
    handle.remove()
    # transformers' own output recorders (installed once hidden states are asked for) are no reason.
    with torch.no_grad():
        model(ids, attention_mask=mask, output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules())
    with torch.no_grad():
        assert eager_steps.refusal(model) == "the model's weights are not all on one CUDA device"
        model.train()
        assert eager_steps.refusal(model) == "the model is in training mode"
        model.eval()
    assert eager_steps.refusal(model) == "autograd is recording"
    stock = tiny_model("llama", num_hidden_layers=1).eval()
    _generate(stock, ids, mask, new=2)
    assert eager_steps.stats(stock) == {
        "loops": 0, "steps": 0, "replays": 0, "capture_s": 0.0, "refused": None, "failed": None
    }
    flash = _model(num_hidden_layers=1)
    flash.config._attn_implementation_internal = "flash_attention_2"
    with torch.no_grad():
        assert eager_steps.refusal(stock) == (
            "its decode steps are not turned on (transfuse.decode_steps(model) turns them on)"
        )
        assert "attn_implementation='sdpa'" in eager_steps.refusal(flash)


def test_a_loop_with_a_static_cache_runs_as_usual(store_on_cpu):
    model = _model(num_hidden_layers=1)
    ids, mask = _batch()
    options = {"min_new_tokens": 4, "do_sample": False, "cache_implementation": "static"}
    got = _generate(model, ids, mask, new=4, **options)
    assert eager_steps.stats(model)["refused"] == "the cache is a StaticCache, not transformers' dynamic one"
    assert torch.equal(got, _generate(model, ids, mask, new=4, off=True, **options))


def test_a_loop_of_a_few_tokens_runs_as_usual(store_on_cpu):
    model = _model(num_hidden_layers=1)
    ids, mask = _batch()
    few = eager_steps.MIN_NEW_TOKENS - 1
    got = _generate(model, ids, mask, new=few, do_sample=False)
    assert eager_steps.stats(model)["refused"] == (
        f"the loop makes at most {few} new tokens, fewer than {eager_steps.MIN_NEW_TOKENS} "
        "(a capture would not pay for itself)"
    )
    assert eager_steps.stats(model)["loops"] == 0
    assert torch.equal(got, _generate(model, ids, mask, new=few, off=True, do_sample=False))
    _generate(model, ids, mask, new=few + 1, do_sample=False)
    assert eager_steps.stats(model)["loops"] == 1 and eager_steps.stats(model)["refused"] is None


def test_a_compiled_model_takes_its_own_path(store_on_cpu):
    model = transfuse.compile(_model(num_hidden_layers=1), inductor=False)
    ids, mask = _batch()
    _generate(model, ids, mask, new=3, do_sample=False)
    assert eager_steps.stats(model)["loops"] == 0
    assert model._transfuse_compiled.loops["transfuse"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_on_cuda_steps_replay_as_graphs_with_the_model_s_answers(model_type):
    model = _model(model_type, device="cuda")
    ids, mask = _batch("cuda")
    for case, options in CASES.items():
        want = _generate(model, ids, mask, new=24, off=True, **options)
        for _ in range(2):  # each loop captures its own graph
            before = eager_steps.stats(model)
            got = _generate(model, ids, mask, new=24, **options)
            after = eager_steps.stats(model)
            _same(got, want, case)
            assert after["failed"] is None and after["refused"] is None, case
            assert after["replays"] - before["replays"] >= 24 - 3, case  # every step but the prompt's and two
            assert after["capture_s"] > before["capture_s"], case  # each loop captures its own
    # End tokens: the stop check read a step late, the extra step undone.
    greedy = _generate(model, ids, mask, new=24, **CASES["greedy"])
    ended = sorted({int(greedy[0, ids.shape[1] + 2]), int(greedy[1, ids.shape[1] + 5])})
    options = {"eos_token_id": ended, "pad_token_id": 0, "do_sample": False}
    assert torch.equal(_generate(model, ids, mask, new=24, **options), _generate(model, ids, mask, new=24, off=True, **options))
    # Streamed a step late where the check defers: the same text, the extra token never streamed.
    for stop in ({"eos_token_id": ended[:1], "pad_token_id": 0}, {}):
        loops, replays = eager_steps.stats(model)["loops"], eager_steps.stats(model)["replays"]
        got, text = _streamed(model, ids, mask, max_new_tokens=24, **(stop or {"min_new_tokens": 24}))
        assert eager_steps.stats(model)["loops"] == loops + 1
        # (a row that ends at its third token stops before any replay: the capture is at the second)
        assert eager_steps.stats(model)["replays"] > replays or stop
        want, want_text = _streamed(model, ids, mask, off=True, max_new_tokens=24, **(stop or {"min_new_tokens": 24}))
        assert torch.equal(got, want) and text == want_text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("path", ["on", "off"])
def test_on_cuda_two_threads_generating_at_once_get_the_model_s_answers(model_type, path, monkeypatch):
    """Two threads call ``generate`` on one model at once, again and again: one loop at a time
    takes the path (capturing while the other thread runs kernels), the other runs as usual; no
    call fails and every answer is the model's. With the path off, the MoE blocks' own graphs are
    shared by the two threads."""
    model = _model(model_type, device="cuda")
    ids, mask = _batch("cuda")
    options = {"new": 24, "min_new_tokens": 24, "do_sample": False}
    want = {rows: _generate(model, ids[:rows], mask[:rows], off=True, **options) for rows in (1, 3)}
    monkeypatch.setenv(eager_steps.ENV, "1" if path == "on" else "0")
    got = _generated_in_two_threads(model, ids, mask, new=24)
    assert len(got) == 8 and all(torch.equal(tokens, want[rows]) for rows, tokens in got)
    assert (eager_steps.stats(model)["replays"] > 0) == (path == "on")
    assert model.__dict__.get("_compiled_call_impl") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_each_loop_sees_weights_and_attributes_changed_before_it():
    """Graphs live for one loop: weights changed in place or replaced, and an attribute the forward
    reads, are all seen by the next ``generate``."""
    model = _model("llama", device="cuda")
    ids, mask = _batch("cuda")
    options = {"min_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    first = _generate(model, ids, mask, **options)
    changes = [
        lambda: model.model.layers[0].mlp.down_proj.weight.data.mul_(-1.5),
        lambda: setattr(model.model.layers[1].self_attn.o_proj.weight, "data", torch.randn_like(model.model.layers[1].self_attn.o_proj.weight) * 0.2),
        lambda: setattr(model.model.norm, "variance_epsilon", 0.5),
    ]
    previous = first
    for change in changes:
        change()
        got = _generate(model, ids, mask, **options)
        _same(got, _generate(model, ids, mask, off=True, **options), "changed")
        # (the logits, not the tokens: a tiny model's greedy tokens may survive a change)
        assert not torch.equal(got.logits[-1], previous.logits[-1])
        previous = got
    assert eager_steps.stats(model)["failed"] is None


class _OpTrace(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op a call issues, as a graph would hold it: the op, its tensors' shapes, dtypes and
    strides, every argument that is not a tensor (a Python number baked into the op), the values
    of tensors made from Python numbers (``torch.tensor(n)``), and where each tensor it reads
    comes from: made earlier in the call, one of the call's inputs (a graph copies those into
    buffers of its own), or from outside the call (a weight, the store, a module's cached tensor:
    a graph reads those at the address they had at the capture, so the address is recorded).
    Inside transfuse's own library ops (``transfuse::cached_attention``) the ops they issue are
    recorded too."""

    def __init__(self, inputs):
        super().__init__()
        self.ops = []
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.made: set[int] = set()

    def _source(self, tensor):
        storage = tensor.untyped_storage().data_ptr()
        if storage in self.made:
            return "made"
        if storage in self.inputs:
            return "input"
        return ("outside", storage, tensor.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        made_from_numbers = func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
        described = tuple(
            (tuple(a.shape), a.dtype, a.stride(), tuple(a.tolist()) if made_from_numbers else self._source(a))
            if isinstance(a, torch.Tensor) else a
            for a in flat
        )
        self.ops.append((str(func), described))
        inside = graphs._library_function(func)
        if inside is not None:  # one of transfuse's library ops: what it issues is recorded too
            with self:
                out = inside(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out

    def launch(self, kernel, grid, args, kwargs):
        """A Triton kernel's launch (interpreted, not a torch op): its tensors as above, and every
        number it is given (a length passed as an int would be baked into a graph), its grid
        included."""
        described = tuple(
            (tuple(a.shape), a.dtype, a.stride(), self._source(a)) if isinstance(a, torch.Tensor) else a
            for a in (*args, *sorted(kwargs.items()))
        )
        grid = grid if isinstance(grid, tuple) else "a function of its arguments"
        self.ops.append((f"triton.{kernel}", (grid, *described)))


def tracing_steps(traces):
    """An ``EagerSteps.__init__`` whose loops record each step's ops (``_OpTrace``) in ``traces``."""
    made = eager_steps.EagerSteps.__init__

    def recording(self, model, configs):
        made(self, model, configs)
        forward = self.compiled

        def traced(*args, **kwargs):
            with _OpTrace([v for v in kwargs.values() if isinstance(v, torch.Tensor)]) as trace:
                output = forward(*args, **kwargs)
            traces.append(trace.ops)
            return output

        self.compiled = traced

    return recording


@pytest.fixture
def kernel_launches_traced(monkeypatch):
    """Interpreted Triton launches recorded in the active ``_OpTrace``; the interpreter's own
    copies of the arguments, torch ops a GPU does not issue, kept out of the trace."""
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, _OpTrace) and not warmup:
            mode.launch(self.fn.__name__, grid, args, kwargs)
        with torch.utils._python_dispatch._disable_current_modes():
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)


# Ops whose result the host needs the device's values for (``.item()``, ``bool(t)``, shapes that
# depend on values).
_READ_ON_THE_HOST = {
    "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default", "aten.nonzero.default",
    "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default", "aten.repeat_interleave.Tensor",
}


@pytest.fixture(params=["native", "triton"])
def providers(request, triton_for, model_type):
    """The ops' providers a step runs: the CPU's own, or the Triton kernels a GPU runs (their Python
    wrappers and launches, which a capture holds too), interpreted on CPU tensors. Yields the
    provider expected to run the step's attention, and the model of ``model_type`` with its decode
    steps on, rewritten with the CPU's providers before the Triton ones are put first (the steps
    are what is recorded; interpreted, the rewrite's checks would take minutes)."""
    if request.param == "native":
        yield "native", _model(model_type)
        return
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's providers on CPU tensors need its interpreter (no GPU)")
    model = _model(model_type)
    request.getfixturevalue("kernel_launches_traced")
    with triton_for(*(name for name, op in dispatch._OPS.items() if "triton" in op.providers)):
        yield "triton", model


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_a_step_issues_the_same_ops_at_every_position(model_type, providers, store_on_cpu, monkeypatch):
    """What makes a captured step right at every later position: the step's forward issues the
    same ops with the same shapes and the same Python numbers at every step of a loop, and reads
    every tensor it does not make or take as an input at the same address (the position, the
    padding and the cache's length reach it only through tensors whose addresses are fixed; no
    module swaps a cached tensor between steps), and none of them reads values on the host.
    Recorded on the CPU, where the path runs the forward at every step, with the CPU's providers
    and with the GPU's Triton kernels (interpreted; each launch recorded with its arguments and
    grid, as a graph holds it)."""
    providers, model = providers
    ids, mask = _batch()
    traces = []
    monkeypatch.setattr(eager_steps.EagerSteps, "__init__", tracing_steps(traces))
    with dispatch.trace() as calls:
        _generate(model, ids, mask, new=12, min_new_tokens=12, do_sample=False)
    ran = {(call.op, call.provider) for call in calls}
    assert ("decode_attention", providers) in ran, sorted(ran)
    assert len(traces) == 11  # every step after the prompt's
    assert len(traces[0]) > 50
    # No op reads a tensor's values on the host (a capture cannot hold one; on CUDA it fails it).
    for trace in traces:
        assert not {op for op, _ in trace} & _READ_ON_THE_HOST
    # The second step is the one captured; the first may also do work cached for later calls (the
    # Triton rotary's wrapper works out its output's layout on meta tensors once per shape).
    captured = traces[1]
    launched = {op for op, _ in captured if op.startswith("triton.")}
    if providers == "triton":  # the norms', rotary's, the GLU's or the experts', attention's
        assert len(launched) >= 4, launched
    else:
        assert not launched
    for position, trace in enumerate(traces[2:], start=2):
        assert trace == captured, f"the step at position {position} issues other ops than the captured one"


def test_lora_adapters_decode_through_the_path_and_each_loop_sees_them_switched(store_on_cpu):
    peft = pytest.importorskip("peft")
    model = _model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)).eval()
    with torch.no_grad():
        for name, p in sorted(lora.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    ids, mask = _batch()
    options = {"min_new_tokens": 12, "do_sample": False}
    with_adapter = _generate(lora, ids, mask, **options)
    assert eager_steps.stats(model)["refused"] is None and eager_steps.stats(model)["steps"] >= 11
    assert torch.equal(with_adapter, _generate(lora, ids, mask, off=True, **options))
    with lora.disable_adapter():
        without = _generate(lora, ids, mask, **options)
        assert torch.equal(without, _generate(lora, ids, mask, off=True, **options))
    assert not torch.equal(without, with_adapter)
    assert torch.equal(_generate(lora, ids, mask, **options), with_adapter)
