"""transfuse.compile: attention with its cache outside the graph, the graph split there, pieces
compiled; answers compared with the same model run eagerly.

Most tests run the pieces as traced (``inductor=False``: the split and the attention op are
what is under test, and Inductor on CPU takes seconds a piece); one runs Inductor. The CUDA
graph tests run on a GPU only.
"""

from __future__ import annotations

import copy
import io
import re
import threading
import warnings

import pytest
import torch

import transfuse
from transfuse.compile import CompileError, backend, generate, is_compiled, warm_up
from transfuse.compile.attention import IMPLEMENTATION
from transfuse.tiny import tiny_model


# Rewritten CPU models by what made them: each test gets a deep copy (the rewrite of a seeded tiny
# model is the same every time; a copy is that model, its report included) and the random state
# the rewrite left, as if it had rewritten its own.
_REWRITTEN: dict[tuple, tuple[torch.nn.Module, torch.Tensor]] = {}


def _model(model_type: str = "llama", device: str = "cpu", dtype=torch.float32, **overrides):
    from transfuse.ops import dispatch

    key = (model_type, dtype, repr(sorted(overrides.items())), repr(sorted(dispatch._USER_PRIORITY.items())))
    if device == "cpu" and key in _REWRITTEN:
        model, rng = _REWRITTEN[key]
        torch.set_rng_state(rng)
        return copy.deepcopy(model)
    torch.manual_seed(0)
    model = tiny_model(model_type, **overrides).to(device, dtype).eval()
    transfuse.rewrite(model)
    if device == "cpu":
        _REWRITTEN[key] = (copy.deepcopy(model), torch.get_rng_state())
    return model


def _padded_batch(device: str = "cpu"):
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, 11), device=device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _word_tokenizer():
    """A transformers tokenizer of the tiny models' 256 ids (``t0`` ... ``t255``), made in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words)


def _streamed(model, ids, mask, **options):
    """``generate`` of one row with transformers' ``TextIteratorStreamer``: (tokens, streamed text)."""
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(_word_tokenizer(), timeout=60)  # (a loop that never ends the stream fails)
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=mask, streamer=streamer, do_sample=False, **options)
    return tokens, "".join(streamer)


def _words(ids):
    """The words ``_word_tokenizer`` decodes these ids to."""
    return [f"t{i}" for i in ids.tolist()]


def _generate(model, ids, mask, new=10, **extra):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, **extra)


CASES = {
    "llama": {},
    "mistral, sliding window 4": ("mistral", {"sliding_window": 4}),
    "gemma2, soft-capped, sliding window 4": ("gemma2", {"sliding_window": 4}),
    "gpt_oss, sinks, sliding window 4": ("gpt_oss", {"sliding_window": 4}),
    "qwen3_moe": ("qwen3_moe", {}),
    "cohere, rotary of interleaved pairs in float32": ("cohere", {}),
    "nemotron, partial rotary": ("nemotron", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_and_logits_match_the_eager_model(case):
    spec = CASES[case]
    model_type, overrides = (case, {}) if spec == {} else spec
    model = _model(model_type, **overrides)
    if "rotary" in case:  # the rewritten call, the op's in that layout, is in the compiled forward
        assert transfuse.report(model).counts().get("rotary"), transfuse.report(model)
    ids, mask = _padded_batch()
    want_tokens = _generate(model, ids, mask)
    with torch.no_grad():
        want_logits = model(ids, attention_mask=mask).logits
    transfuse.compile(model, inductor=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_tokens = _generate(model, ids, mask)
        with torch.no_grad():
            got_logits = model(ids, attention_mask=mask).logits
    # Dynamo warns of what it traces in transfuse's code (a cache wrapper, a graph break's cause):
    # a user compiling a rewritten model sees none of it.
    dynamo = [f"{w.filename}: {w.message}" for w in caught if "_dynamo" in w.filename]
    assert not dynamo, dynamo
    assert model._transfuse_compiled.calls["compiled"] == 11 and model._transfuse_compiled.calls["eager"] == 0
    assert torch.equal(got_tokens, want_tokens)
    real = mask.bool()  # padding positions' logits are never read
    torch.testing.assert_close(got_logits[real], want_logits[real], rtol=1e-5, atol=1e-5)


def test_the_window_and_the_padding_change_the_answer():
    """The cases above would pass with a mask that ignored them if these made no difference."""
    ids, mask = _padded_batch()
    windowed = _model("mistral", sliding_window=4)
    full = _model("mistral")
    with torch.no_grad():
        assert not torch.allclose(windowed(ids).logits, full(ids).logits)
        unpadded = full(ids).logits
        padded = full(ids, attention_mask=mask).logits
    assert not torch.allclose(unpadded[1, -1], padded[1, -1])


def test_inductor_pieces_split_at_every_attention_layer():
    model = _model("llama", num_hidden_layers=3)
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=4)
    before = backend.stats()
    transfuse.compile(model)
    got = _generate(model, ids, mask, new=4)
    after = backend.stats()
    assert torch.equal(got, want)
    graphs = after["graphs"] - before["graphs"]
    assert graphs == 2  # the prompt, then the decode step
    assert after["pieces"] - before["pieces"] == graphs * 4  # 3 layers: 4 pieces between and around


@pytest.mark.parametrize("kv_store", [False, True], ids=["cache", "store"])
def test_no_recompile_over_512_decode_steps(kv_store):
    """With the store, its capacity grows twice on the way (256, 512, 768 positions)."""
    model = _model("llama", num_hidden_layers=1, max_position_embeddings=1024)
    transfuse.compile(model, inductor=False, kv_store=kv_store)
    ids, mask = _padded_batch()
    _generate(model, ids, mask, new=3)
    before = backend.stats()["graphs"]
    tokens = _generate(model, ids, mask, new=512)
    assert tokens.shape[1] == ids.shape[1] + 512
    assert backend.stats()["graphs"] == before
    stores = model._transfuse_compiled.stores
    assert [store.capacity for store in stores.values()] == ([768] if kv_store else [])


def test_compiled_models_do_not_share_dynamo_s_recompile_budget():
    """Six compiled models in one process, each compiled for its own shapes (two graphs each: the
    prompt and a decode step): none falls back to running uncompiled (Dynamo allows 8 graphs per
    function it compiles; a shared budget would run out at the fifth model)."""
    ids, mask = _padded_batch()
    for _ in range(6):
        model = transfuse.compile(_model("llama", num_hidden_layers=1), inductor=False)
        before = backend.stats()["graphs"]
        _generate(model, ids, mask, new=2)
        assert backend.stats()["graphs"] == before + 2


def test_the_first_call_names_the_compilers_that_run(caplog):
    ids, mask = _padded_batch()
    for inductor, named in ((False, "Dynamo; the pieces run as traced"), (True, "Dynamo, Inductor")):
        model = transfuse.compile(_model("llama", num_hidden_layers=1), inductor=inductor, cache_dir=False)
        caplog.clear()
        with caplog.at_level("INFO", logger="transfuse"):
            with torch.no_grad():
                model(ids[:1, -3:])
        line = next(m for m in caplog.messages if "at its first calls" in m)
        assert f"({named};" in line, line


def test_the_cache_generate_returns_holds_every_token():
    model = _model("llama")
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=6, return_dict_in_generate=True)
    transfuse.compile(model, inductor=False)
    got = _generate(model, ids, mask, new=6, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    cache = getattr(got, "cache", None) or got.past_key_values
    cache_want = getattr(want, "cache", None) or want.past_key_values
    assert cache.get_seq_length() == cache_want.get_seq_length() == ids.shape[1] + 5
    # Padding tokens' keys are never attended to (and their hidden states are whatever the
    # masking makes of a query that may see nothing): compare the others.
    real = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], dim=1).bool()
    for layer, layer_want in zip(cache.layers, cache_want.layers):
        for got_, want_ in ((layer.keys, layer_want.keys), (layer.values, layer_want.values)):
            torch.testing.assert_close(got_.transpose(1, 2)[real], want_.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)


def test_calls_outside_the_path_run_the_eager_forward():
    model = _model("llama")
    ids, mask = _padded_batch()
    transfuse.compile(model, inductor=False)
    compiled = model._transfuse_compiled
    logits = model(ids, attention_mask=mask).logits  # records autograd: eager
    assert compiled.calls == {"compiled": 0, "eager": 1}
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None
    with torch.no_grad():
        model(ids, attention_mask=mask, output_attentions=True)
        model(ids, attention_mask=mask)
    assert compiled.calls == {"compiled": 1, "eager": 2}
    # The eager calls saw the model's own attention implementation, not the compile path's.
    assert model.config._attn_implementation != IMPLEMENTATION
    # A cache other than the dynamic one (here a static cache, positional input ids) is eager.
    from transformers import StaticCache

    with torch.no_grad():
        want = transfuse.rewrite(_model("llama"))(ids, past_key_values=StaticCache(config=model.config, max_cache_len=16))
        got = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=16))
    torch.testing.assert_close(got.logits, want.logits)
    assert compiled.calls == {"compiled": 1, "eager": 3}
    # A hook on the model itself runs: that call is eager too.
    seen = []
    handle = model.register_forward_hook(lambda module, args, output: seen.append(output.logits.shape))
    with torch.no_grad():
        model(ids, attention_mask=mask)
    handle.remove()
    assert seen == [(3, 11, 256)] and compiled.calls == {"compiled": 1, "eager": 4}


def test_models_the_path_cannot_hold_are_refused_with_a_reason():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64))
    with pytest.raises(CompileError, match="encoder-decoder"):
        transfuse.compile(t5)
    with pytest.raises(CompileError, match="not attention key/value layers"):
        transfuse.compile(tiny_model("qwen3_next"))
    with pytest.raises(CompileError, match="warm_up takes"):
        warm_up(tiny_model("llama"))


def test_deferred_stop_check_is_turned_on_for_cuda_for_caches_a_compiled_model_served():
    if not generate.supported():
        pytest.skip("this transformers has no DeferredStopCheck")
    from transformers import DynamicCache
    from transformers.generation.utils import DeferredStopCheck

    model = transfuse.compile(_model("llama"), inductor=False)
    cuda = torch.device("cuda")
    served, other = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 4)), past_key_values=served)
    assert DeferredStopCheck.is_supported(cuda, served, False, is_assistant=False)
    assert not DeferredStopCheck.is_supported(cuda, served, False, is_assistant=True)
    assert not DeferredStopCheck.is_supported(cuda, other, False, is_assistant=False)
    assert not DeferredStopCheck.is_supported(torch.device("cpu"), served, False, is_assistant=False)


def test_the_compiled_model_knows_when_a_call_is_a_step_of_a_closed_decoding_loop():
    """Inside transformers' own loop with nothing of the caller's in it, every call of one
    ``generate`` sees the same loop token (a new one per ``generate``); a streamer, a processor
    holding a function, or a call of the model's own are not closed loops."""
    from transformers import LogitsProcessorList, StoppingCriteria
    from transformers.generation.streamers import BaseStreamer

    model = transfuse.compile(_model("llama", num_hidden_layers=1), inductor=False)
    compiled = model._transfuse_compiled
    inner, seen = compiled.compiled, []

    elsewhere = []

    def recording(*args, **kwargs):
        seen.append(compiled.loop)
        if not elsewhere:  # what another thread sees meanwhile
            thread = threading.Thread(target=lambda: elsewhere.append(compiled.loop))
            thread.start()
            thread.join()
        return inner(*args, **kwargs)

    compiled.compiled = recording
    ids, mask = _padded_batch()

    def loops(rows=3, **extra):
        seen.clear()
        _generate(model, ids[:rows], mask[:rows], new=4, **extra)
        return list(seen)

    first, second = loops(), loops()
    assert len(first) == 4 and first[0] is not None and all(token is first[0] for token in first)
    assert elsewhere == [None]  # another thread's calls are not the loop's steps
    assert second[0] is not None and second[0] is not first[0]
    assert all(token is not None for token in loops(num_beams=2))
    assert compiled.loop is None
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert seen[-1] is None

    class Streamer(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    assert set(loops(streamer=Streamer())) == {None}
    # transformers' own text streamers (with a tokenizer of its own) run nothing of the caller's.
    from transformers import TextIteratorStreamer, TextStreamer

    tokenizer = _word_tokenizer()
    for streamer in (TextStreamer(tokenizer), TextIteratorStreamer(tokenizer)):
        streamed = loops(rows=1, streamer=streamer)
        assert streamed[0] is not None and all(token is streamed[0] for token in streamed)

    class Printing(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            pass

    class Words(type(tokenizer)):
        pass

    assert set(loops(rows=1, streamer=Printing(tokenizer))) == {None}
    assert set(loops(rows=1, streamer=TextStreamer(Words(tokenizer_object=tokenizer.backend_tokenizer)))) == {None}
    assert set(loops(prefix_allowed_tokens_fn=lambda batch, tokens: list(range(256)))) == {None}
    assert set(loops(stopping_criteria=[Never()])) == {None}
    assert generate.closed({"logits_processor": LogitsProcessorList(), "streamer": None})


def test_a_model_whose_attention_is_its_own_code_is_answered_by_its_own_forward():
    """XGLM's attention does not call transformers' attention functions: the compiled prompt
    leaves its layers unserved, so the call is answered by the model's own forward (one warning)
    and so is every call after it; the answers are the model's."""
    model = _model("xglm")
    ids, mask = _padded_batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    want_tokens = _generate(model, ids, mask, new=6)
    transfuse.compile(model, inductor=False)
    with pytest.warns(UserWarning, match="runs its own forward from now on, not the decode path"), torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    compiled = model._transfuse_compiled
    assert compiled.abandoned.startswith("_Unserved: of the cache's 2 layers, 2 did not attend")
    assert torch.equal(_generate(model, ids, mask, new=6), want_tokens)
    assert compiled.calls["eager"] >= 7


def test_a_failed_call_leaves_a_sliding_window_cache_as_it_found_it():
    """Dory runs its middle layers in loops, each loop attending again with the same layer's
    cache: through the path the prompt's second loop raises after sliding-window cache layers
    grew. What the call wrote is undone and the model's own forward answers, as for XGLM."""
    import transformers

    if "dory" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no Dory")
    model = _model("dory")
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=6, output_logits=True, return_dict_in_generate=True)
    transfuse.compile(model, inductor=False)
    with pytest.warns(UserWarning, match="runs its own forward from now on"):
        got = _generate(model, ids, mask, new=6, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert model._transfuse_compiled.abandoned.startswith("RuntimeError")


def test_compiling_latent_attention_warns_of_the_cache_s_growth_and_it_is_what_it_says():
    """DeepSeek-V3 caches its compressed latents; the compiled calls cache what the attention op is
    handed, every head's keys and values: the warning's numbers are the two caches' per token."""
    model = _model("deepseek_v3")
    ids, mask = _padded_batch()

    def per_token(cache):
        layer = cache.layers[0]
        return layer.keys.shape[1] * layer.keys.shape[-1] + layer.values.shape[1] * layer.values.shape[-1]

    own = _generate(model, ids, mask, new=3, return_dict_in_generate=True, output_logits=True)
    with pytest.warns(UserWarning, match=r"caches its latents \((\d+) numbers.*\((\d+), ([\d.]+)x") as caught:
        transfuse.compile(model, inductor=False)
    (message,) = [str(w.message) for w in caught if "latents" in str(w.message)]
    numbers = [int(n) for n in re.findall(r"\((\d+)", message)]
    got = _generate(model, ids, mask, new=3, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(got.sequences, own.sequences)
    assert numbers == [per_token(own.past_key_values), per_token(got.past_key_values)] == [24, 128]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transfuse.compile(_model("llama"), inductor=False)  # (no latents, no warning)


def test_the_kept_cache_state_undoes_every_write_of_a_call():
    """``CacheState`` puts back a dynamic cache's layers, plain and sliding window (which drops
    its oldest tokens and counts what it saw), however many writes a call made."""
    from transformers import DynamicCache

    from transfuse.compile.calls import CacheState

    config = tiny_model("gemma2", sliding_window=4).config
    cache = DynamicCache(config=config)
    assert {type(layer).__name__ for layer in cache.layers} == {"DynamicLayer", "DynamicSlidingWindowLayer"}
    torch.manual_seed(0)

    def write(tokens):
        for index in range(len(cache.layers)):
            cache.update(torch.randn(2, 1, tokens, 8), torch.randn(2, 1, tokens, 8), index)

    write(3)
    before = [(layer.keys.clone(), layer.values.clone(), dict(vars(layer))) for layer in cache.layers]
    kept = CacheState(cache)
    write(5)
    write(1)
    assert cache.get_seq_length() == 9
    kept.restore()
    assert cache.get_seq_length() == 3
    for layer, (keys, values, attributes) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert vars(layer).keys() == attributes.keys()
        assert getattr(layer, "cumulative_length", 0) == attributes.get("cumulative_length", 0)
    write(2)  # and it grows again from there
    assert cache.get_seq_length() == 5


def test_models_that_decode_otherwise_are_refused_or_run_transformers_loop():
    """A model without transformers' dynamic cache (RWKV's state), or whose forward takes no
    positions, is refused; a model class that
    prepares its decode steps' inputs itself (GPT's whole text, without a cache) decodes in
    transformers' own loop, not the lean one."""
    with pytest.raises(CompileError, match="does not decode with transformers' dynamic cache"):
        transfuse.compile(tiny_model("rwkv"))
    # PLBart's decoder works out its positions from the cache's length (no position_ids to take).
    with pytest.raises(CompileError, match="forward takes no position_ids"):
        transfuse.compile(tiny_model("plbart"))
    assert not generate._prepares_inputs_as_transformers_does(tiny_model("openai-gpt"))
    assert generate._prepares_inputs_as_transformers_does(tiny_model("llama"))


def test_two_threads_decoding_at_once_each_read_their_own_cache():
    """Two compiled models decoding in two threads at once: while one thread's call is inside its
    forward (its cache and padding the call in progress), the other's call runs whole; each reads
    its own cache and gets its own model's answer."""
    first = transfuse.compile(_model("llama", num_hidden_layers=2), inductor=False)
    torch.manual_seed(7)
    second = transfuse.compile(transfuse.rewrite(tiny_model("llama", num_hidden_layers=2).eval()), inductor=False)
    ids, mask = _padded_batch()
    want = {name: _generate(model, ids[:rows], mask[:rows], new=6)
            for name, model, rows in (("first", first, 3), ("second", second, 1))}
    inside, done, got = threading.Event(), threading.Event(), {}
    first_forward, second_forward = first._transfuse_compiled.compiled, second._transfuse_compiled.compiled

    def paused(*args, **kwargs):  # the second model's third call waits, inside it, for the first's
        if not inside.is_set() and len(calls) == 2:
            inside.set()
            done.wait(timeout=60)
        calls.append(1)
        return second_forward(*args, **kwargs)

    def during(*args, **kwargs):  # the first model's calls run while the second's is paused
        if not done.is_set():
            assert inside.wait(timeout=60)
        return first_forward(*args, **kwargs)

    calls = []
    second._transfuse_compiled.compiled = paused
    first._transfuse_compiled.compiled = during
    thread = threading.Thread(target=lambda: got.update(second=_generate(second, ids[:1], mask[:1], new=6)))
    thread.start()
    try:
        got["first"] = _generate(first, ids, mask, new=6)
    finally:
        done.set()
        thread.join()
    assert torch.equal(got["first"], want["first"]) and torch.equal(got["second"], want["second"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_two_threads_generating_at_once_on_a_compiled_model_get_its_answers():
    model = transfuse.compile(_model("qwen3_moe", device="cuda"))
    ids, mask = _padded_batch("cuda")
    want = {rows: _generate(model, ids[:rows], mask[:rows], new=24) for rows in (1, 3)}
    got = _generated_in_two_threads(model, ids, mask, new=24)
    assert len(got) == 8 and all(torch.equal(tokens, want[rows]) for rows, tokens in got)


def _generated_in_two_threads(model, ids, mask, new, rounds=4):
    """``_generate`` of the first row in one thread and of all rows in another, at once, ``rounds``
    times each: [(rows, tokens)]; a call that raises fails the test."""
    got, errors = [], []

    def generate(rows):
        try:
            for _ in range(rounds):
                got.append((rows, _generate(model, ids[:rows], mask[:rows], new=new)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(rows,)) for rows in (1, ids.shape[0])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return got


LEAN_CASES = {
    "greedy": {"max_new_tokens": 10, "min_new_tokens": 10},
    "one token": {"max_new_tokens": 1},
    "a processor": {"max_new_tokens": 12, "repetition_penalty": 1.3},
    "sampling": {"max_new_tokens": 12, "do_sample": True, "top_k": 20, "temperature": 0.7},
    "two samples a prompt": {"max_new_tokens": 6, "do_sample": True, "num_return_sequences": 2},
    "end tokens": {"max_new_tokens": 20},  # an end token two of the rows emit
}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_the_lean_loop_returns_the_tokens_transformers_loop_returns(model_type):
    """The same compiled model, its closed loops run by transfuse (``_lean_sample``) and by
    transformers (a dict asked for: the lean loop returns only tokens): the same tokens for
    greedy, sampling from one seed, processors, and rows that end early (padded after, and the
    loop stopping before the length when every row has ended)."""
    model = transfuse.compile(_model(model_type), inductor=False)
    loops = model._transfuse_compiled.loops
    ids, mask = _padded_batch()
    greedy = _generate(model, ids, mask, new=8)
    ended = {int(greedy[0, ids.shape[1] + 2]), int(greedy[1, ids.shape[1] + 5])}
    for name, options in LEAN_CASES.items():
        if name == "end tokens":
            options = {**options, "eos_token_id": sorted(ended), "pad_token_id": 0}
        before = dict(loops)
        with torch.no_grad():
            torch.manual_seed(3)
            lean = model.generate(ids, attention_mask=mask, **options)
            torch.manual_seed(3)
            theirs = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options).sequences
        assert loops["transfuse"] == before["transfuse"] + 1 and loops["transformers"] == before["transformers"] + 1
        assert torch.equal(lean, theirs), name
        assert lean.is_contiguous()
    # A row alone stops at its end token, before the length.
    first_end = next(i for i, token in enumerate(greedy[0, ids.shape[1]:].tolist()) if token in ended)
    with torch.no_grad():
        alone = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=20, eos_token_id=sorted(ended), pad_token_id=0)
    assert torch.equal(alone, greedy[:1, : ids.shape[1] + first_end + 1])
    # With transformers' own streamer: the text both loops stream, every token once.
    for options in ({"max_new_tokens": 8}, {"max_new_tokens": 20, "eos_token_id": sorted(ended), "pad_token_id": 0}):
        before = dict(loops)
        lean, text = _streamed(model, ids[:1], mask[:1], **options)
        theirs, their_text = _streamed(model, ids[:1], mask[:1], return_dict_in_generate=True, **options)
        assert loops["transfuse"] == before["transfuse"] + 1 and loops["transformers"] == before["transformers"] + 1
        assert torch.equal(lean, theirs.sequences) and text == their_text and text.split() == _words(lean[0])
    assert lean.shape[1] == alone.shape[1]  # (the end token ended the row)


def test_under_a_deferred_stop_check_the_first_token_is_streamed_before_the_first_decode_step(monkeypatch):
    """Where the stop check hands tokens on a step late (transformers' ``DeferredStopCheck``, which
    transfuse turns on for CUDA; here on the CPU with events that do nothing), the lean loop gives
    the streamer the prompt's token as soon as it is chosen, before the first decode step is
    queued, and every token is streamed once: for a full length, one token, and rows that end."""
    from collections import deque

    from transformers import TextIteratorStreamer
    from transformers.generation import utils

    from transfuse.compile import generate as loop

    class Done:
        def record(self):
            pass

        def synchronize(self):
            pass

    checks = []

    class Deferred(utils.DeferredStopCheck):
        is_supported = staticmethod(lambda *args, **kwargs: True)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.slots = deque((flag, tokens, Done()) for flag, tokens, _ in self.slots)

        def __call__(self, *args):
            checks.append(len(streamed))
            return super().__call__(*args)

    streamed = []  # the number of checks made when each put reached the streamer
    original_put = TextIteratorStreamer.put

    def put(self, value):
        streamed.append(len(checks))
        return original_put(self, value)

    monkeypatch.setattr(loop, "_check_class", lambda: Deferred)
    monkeypatch.setattr(TextIteratorStreamer, "put", put)
    eager = _model("llama")  # not compiled: transformers' own loop, its stop check not deferred on a CPU
    model = transfuse.compile(_model("llama"), inductor=False)
    ids, mask = _padded_batch()
    greedy = _generate(model, ids[:1], mask[:1], new=6)
    end = int(greedy[0, ids.shape[1] + 2])
    for options in ({"max_new_tokens": 6, "min_new_tokens": 6}, {"max_new_tokens": 1}, {"max_new_tokens": 12, "eos_token_id": end, "pad_token_id": 0}):
        streamed.clear(), checks.clear()
        tokens, text = _streamed(model, ids[:1], mask[:1], **options)
        assert checks, "the deferred check ran"
        with torch.no_grad():
            assert torch.equal(tokens, eager.generate(ids[:1], attention_mask=mask[:1], do_sample=False, **options)), options
        assert streamed[:2] == [0, 0], streamed  # the prompt, then its token before any check (and step)
        assert text.split() == _words(tokens[0]), options
        assert len(streamed) == tokens.shape[1] - ids.shape[1] + 1  # the prompt and each token once
    assert tokens.shape[1] == ids.shape[1] + 3  # (the end token ended the row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_the_lean_loop_on_cuda_replays_its_steps_and_stops_where_transformers_loop_does(model_type):
    """On CUDA: the store, whole-call replays and the deferred stop check under the lean loop."""
    model = transfuse.compile(_model(model_type, device="cuda"))
    compiled = model._transfuse_compiled
    ids, mask = _padded_batch("cuda")
    greedy = _generate(model, ids, mask, new=8)
    ended = sorted({int(greedy[0, ids.shape[1] + 2]), int(greedy[1, ids.shape[1] + 5])})
    for options in ({"max_new_tokens": 24, "min_new_tokens": 24}, {"max_new_tokens": 24, "eos_token_id": ended, "pad_token_id": 0}):
        with torch.no_grad():
            lean = model.generate(ids, attention_mask=mask, **options)
            replays = compiled.call_graphs.replays
            lean_again = model.generate(ids, attention_mask=mask, **options)
            replayed = compiled.call_graphs.replays - replays
            theirs = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **options).sequences
        assert torch.equal(lean, theirs) and torch.equal(lean_again, theirs)
        assert replayed >= lean.shape[1] - ids.shape[1] - 2  # every decode step but the first
        # With transformers' own streamer: streamed a step late, each token once.
        replays = compiled.call_graphs.replays
        tokens, text = _streamed(model, ids[:1], mask[:1], **options)
        # (one row: a batch size of its own, whose first two decode steps compile and capture)
        assert compiled.call_graphs.replays - replays >= tokens.shape[1] - ids.shape[1] - 3
        with torch.no_grad():
            alone = model.generate(ids[:1], attention_mask=mask[:1], do_sample=False, **options)
        assert torch.equal(tokens, alone) and text.split() == _words(tokens[0])
    # (the first greedy loop, then per options the two lean ones, the streamed and the one-row one)
    assert compiled.loops["transfuse"] == 9 and compiled.call_graphs.failed is None


def test_the_lean_loop_leaves_to_transformers_what_it_does_not_do():
    from transformers import DynamicCache, StoppingCriteria

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = transfuse.compile(_model("llama", num_hidden_layers=1), inductor=False)
    loops = model._transfuse_compiled.loops
    ids, mask = _padded_batch()
    end = int(_generate(model, ids, mask, new=2)[0, -1])
    for options in (
        {"return_dict_in_generate": True, "output_scores": True},  # more than tokens asked for
        {"max_time": 60.0},  # a stopping criterion other than length and end tokens
        {"num_beams": 2},  # not sampling
        # a cache of the caller's, with end tokens: a step past the end would stay in it
        {"past_key_values": DynamicCache(config=model.config), "eos_token_id": end, "pad_token_id": 0},
    ):
        before = loops["transfuse"]
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=4, **options)
        assert loops["transfuse"] == before, options
    # A cache of the caller's with no end token: the lean loop, and the cache holds every token.
    model.generation_config.eos_token_id = None  # (the tiny model's config has one)
    cache = DynamicCache(config=model.config)
    before = loops["transfuse"]
    got = _generate(model, ids, mask, new=4, past_key_values=cache, pad_token_id=0)
    assert loops["transfuse"] == before + 1
    assert cache.get_seq_length() == got.shape[1] - 1
    assert set(loops) == {"transfuse", "transformers"}
    with torch.no_grad():  # a criterion of the caller's: not a closed loop at all
        before = dict(loops)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, stopping_criteria=[Never()])
    assert loops == before


def test_a_copy_or_pickle_of_a_compiled_model_is_the_model_uncompiled(tmp_path):
    model = transfuse.compile(_model("llama"), inductor=False)
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=4)
    torch.save(model, tmp_path / "model.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert not is_compiled(twin) and twin._compiled_call_impl is None
        assert torch.equal(_generate(twin, ids, mask, new=4), want)
        transfuse.compile(twin, inductor=False)
        assert torch.equal(_generate(twin, ids, mask, new=4), want) and is_compiled(twin)
    assert is_compiled(model)


def test_the_backend_is_registered_for_torch_compile():
    model = _model("llama")
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend="transfuse")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_cuda_graphs_replay_the_pieces_with_the_eager_answers(model_type):
    model = _model(model_type, device="cuda")
    ids, mask = _padded_batch("cuda")
    want = _generate(model, ids, mask, new=16)
    transfuse.compile(model, kv_store=False)
    before = backend.stats()
    first = _generate(model, ids, mask, new=16)
    second = _generate(model, ids, mask, new=16)
    after = backend.stats()
    assert torch.equal(first, want) and torch.equal(second, want)
    assert after["captures"] > before["captures"]
    assert after["replays"] - before["replays"] >= 2 * 14 * 3  # every piece of most decode steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_generate_on_cuda_defers_its_stop_check_and_stops_where_eager_does(monkeypatch):
    if not generate.supported():
        pytest.skip("this transformers has no DeferredStopCheck")
    from transformers.generation import utils

    model = _model("llama", device="cuda")
    ids, mask = _padded_batch("cuda")
    eos = int(_generate(model, ids, mask, new=6)[0, ids.shape[1] + 3])  # a token the first row emits
    want = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    made = []
    original = utils.DeferredStopCheck.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(utils.DeferredStopCheck, "__init__", counting)
    transfuse.compile(model)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    assert made, "generate did not defer its stop check"
    assert torch.equal(got, want)


def test_warm_up_compiles_ahead_of_the_first_generate():
    model = transfuse.compile(_model("llama", num_hidden_layers=1), inductor=False)
    seconds = warm_up(model, batch_sizes=(1, 2), prompt_length=6, new_tokens=3)
    assert sorted(seconds) == [1, 2] and all(s > 0 for s in seconds.values())
    before = backend.stats()["graphs"]
    ids = torch.randint(0, 256, (2, 6))
    _generate(model, ids, torch.ones_like(ids), new=5)
    assert backend.stats()["graphs"] == before  # the prompt and decode graphs were made


# -- decode steps through a KVStore (keys and values in buffers with room) ----------------------


def _logits_of_generate(model, ids, mask, new):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_decode_steps_through_the_store_match_the_eager_model(model_type):
    model = _model(model_type)
    ids, mask = _padded_batch()
    want_tokens, want_logits = _logits_of_generate(model, ids, mask, 12)
    transfuse.compile(model, inductor=False, kv_store=True)
    got_tokens, got_logits = _logits_of_generate(model, ids, mask, 12)
    compiled = model._transfuse_compiled
    assert compiled.store_refused is None and len(compiled.stores) == 1
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_the_store_grows_and_the_cache_holds_every_token(monkeypatch):
    from transfuse.compile import kv_store

    monkeypatch.setattr(kv_store, "GRANULE", 4)
    model = _model("llama")
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=30, return_dict_in_generate=True)
    transfuse.compile(model, inductor=False, kv_store=True)
    got = _generate(model, ids, mask, new=30, return_dict_in_generate=True)
    (store,) = model._transfuse_compiled.stores.values()
    assert store.generation >= 4 and store.capacity >= ids.shape[1] + 30
    assert torch.equal(got.sequences, want.sequences)
    cache, cache_want = got.past_key_values, want.past_key_values
    assert cache.get_seq_length() == cache_want.get_seq_length() == ids.shape[1] + 29
    real = torch.cat([mask, torch.ones(3, 29, dtype=mask.dtype)], dim=1).bool()
    for layer, layer_want, keys in zip(cache.layers, cache_want.layers, store.keys):
        assert layer.keys.data_ptr() == keys.data_ptr()  # views of the store's buffers
        for got_, want_ in ((layer.keys, layer_want.keys), (layer.values, layer_want.values)):
            torch.testing.assert_close(got_.transpose(1, 2)[real], want_.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)
    # ... and it is still a cache transformers' own way of saving takes, with the same tokens.
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, cache.layers))


def test_a_cache_kept_from_an_earlier_call_keeps_its_tokens():
    """A second generate of the same shapes takes the store; the first call's cache, which
    held views of it, is given its own copies first."""
    model = _model("llama")
    ids, mask = _padded_batch()
    other = torch.randint(0, 256, ids.shape, generator=torch.Generator().manual_seed(5))
    want = _generate(model, ids, mask, new=6, return_dict_in_generate=True).past_key_values
    transfuse.compile(model, inductor=False, kv_store=True)
    kept = _generate(model, ids, mask, new=6, return_dict_in_generate=True).past_key_values
    snapshot = [layer.keys.clone() for layer in kept.layers]
    _generate(model, other, mask, new=6)
    (store,) = model._transfuse_compiled.stores.values()
    for layer, before in zip(kept.layers, snapshot):
        assert layer.keys.data_ptr() not in {k.data_ptr() for k in store.keys}
        assert torch.equal(layer.keys, before)
    # ... and the kept cache decodes on from where it was, as the eager model does.
    step = torch.randint(0, 256, (3, 1))
    longer = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        name = model._transfuse_compiled.cache_name
        got = model(step, attention_mask=longer, **{name: kept}).logits
        expected = model._call_impl(step, attention_mask=longer, **{name: want}).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_layer_the_store_cannot_serve_turns_it_off_with_the_answers_intact():
    """Gemma 2 with every layer full attention: plain dynamic layers, but soft-capped scores."""
    model = _model("gemma2", layer_types=["full_attention"] * 2, num_hidden_layers=2)
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=5)
    transfuse.compile(model, inductor=False, kv_store=True)
    got = _generate(model, ids, mask, new=5)
    compiled = model._transfuse_compiled
    assert "soft-capping" in compiled.store_refused and not compiled.stores
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_a_decode_step_is_one_cuda_graph_with_the_eager_answers(model_type):
    model = _model(model_type, device="cuda")
    ids, mask = _padded_batch("cuda")
    want_tokens, want_logits = _logits_of_generate(model, ids, mask, 16)
    transfuse.compile(model, replay=False)  # every step through Dynamo to the step's graph
    before = backend.stats()
    first_tokens, first_logits = _logits_of_generate(model, ids, mask, 16)
    middle = backend.stats()
    second_tokens, second_logits = _logits_of_generate(model, ids, mask, 16)
    after = backend.stats()
    assert model._transfuse_compiled.store_refused is None
    assert middle["step_captures"] == before["step_captures"] + 1
    assert after["step_captures"] == middle["step_captures"]  # the second call replays the first's
    # One replay a decode step (15, and one more where generate's deferred stop check runs a
    # step it then drops), and no piece replayed on its own but the prompt's.
    assert 15 <= after["step_replays"] - middle["step_replays"] <= 16
    pieces = model.config.num_hidden_layers + 1
    assert after["replays"] - middle["replays"] - (after["step_replays"] - middle["step_replays"]) <= pieces
    for tokens, logits in ((first_tokens, first_logits), (second_tokens, second_logits)):
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_release_drops_the_stores_and_the_next_call_makes_one_again():
    model = _model("llama", num_hidden_layers=1)
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=4)
    transfuse.compile(model, inductor=False, kv_store=True)
    kept = _generate(model, ids, mask, new=4, return_dict_in_generate=True)
    compiled = model._transfuse_compiled
    (store,) = compiled.stores.values()
    transfuse.compile.release(model)
    assert not compiled.stores
    from transfuse.compile import kv_store

    assert not kv_store.live(store.key())  # no graph replays it again
    assert kept.past_key_values.get_seq_length() == ids.shape[1] + 3  # the kept cache still holds its tokens
    assert torch.equal(_generate(model, ids, mask, new=4), want)
    assert len(compiled.stores) == 1
    with pytest.raises(CompileError):
        transfuse.compile.release(_model("llama", num_hidden_layers=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", ["default", "every_guard", "trusted"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_whole_calls_replay_and_notice_new_weights(model_type, options):
    model = _model(model_type, device="cuda")
    ids, mask = _padded_batch("cuda")
    want_tokens, want_logits = _logits_of_generate(model, ids, mask, 16)
    assert transfuse.compile(copy.deepcopy(model), replay=False)._transfuse_compiled.call_graphs is None
    trust_modules = options == "trusted"
    transfuse.compile(model, trust_modules=trust_modules, replay=True if options == "every_guard" else None)
    compiled = model._transfuse_compiled
    calls = compiled.call_graphs
    _logits_of_generate(model, ids, mask, 16)
    checks, serving = [], compiled.dynamo.serving
    compiled.dynamo.serving = lambda f_locals: checks.append(1) or serving(f_locals)
    before = calls.replays
    got_tokens, got_logits = _logits_of_generate(model, ids, mask, 16)
    assert calls.failed is None and calls.refused is None
    assert 15 <= calls.replays - before <= 16  # every decode step replayed
    # generate's loop being closed, Dynamo's guards are checked before its first replay only.
    assert len(checks) == 1
    compiled.dynamo.serving = serving

    def steps_of_the_caller_s_own():
        """Decode steps outside generate: replayed after a check each, by default not at all
        (the check of every guard is as dear as Dynamo)."""
        from transformers import DynamicCache

        checks.clear()
        compiled.dynamo.serving = lambda f_locals: checks.append(1) or serving(f_locals)
        before = calls.replays
        cache, step_mask = DynamicCache(config=model.config), mask
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
            for _ in range(5):
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
                model(ids[:, -1:], attention_mask=step_mask, past_key_values=cache)
        compiled.dynamo.serving = serving
        if options == "default":
            assert calls.replays == before and not checks
        else:
            assert len(checks) >= calls.replays - before
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    # New weights (a new tensor where the old one was): the replay notices and captures again.
    head = model.get_output_embeddings()
    head.weight.data = head.weight.data * 2
    with torch.no_grad():
        step = model._call_impl(ids, attention_mask=mask).logits[:, -1]
    assert not torch.allclose(step, want_logits[:, 0], atol=1e-3)
    _, doubled = _logits_of_generate(model, ids, mask, 16)
    torch.testing.assert_close(doubled[:, 0], step, rtol=1e-4, atol=1e-4)
    compiled_impl = model._compiled_call_impl
    model._compiled_call_impl = None
    try:
        _, eager_doubled = _logits_of_generate(model, ids, mask, 16)
    finally:
        model._compiled_call_impl = compiled_impl
    torch.testing.assert_close(doubled, eager_doubled, rtol=1e-4, atol=1e-4)
    # A parameter object replaced by another (its old tensor still where it was): noticed too.
    replaced = head.weight
    head.weight = torch.nn.Parameter(replaced.detach() * 0.5)
    try:
        _, halved = _logits_of_generate(model, ids, mask, 16)
        torch.testing.assert_close(halved[:, 0], 0.5 * doubled[:, 0], rtol=1e-3, atol=1e-3)
    finally:
        head.weight = replaced
    if trust_modules:
        steps_of_the_caller_s_own()
        return
    # A plain attribute the forward reads: Dynamo's guards fail, that step goes through Dynamo
    # (which recompiles), and the steps after it are replayed from a new capture.
    norm = model.model.norm
    norm.eps = 0.5
    before = calls.replays
    _, wide = _logits_of_generate(model, ids, mask, 16)
    assert calls.replays - before >= 12
    model._compiled_call_impl = None
    try:
        _, eager_wide = _logits_of_generate(model, ids, mask, 16)
    finally:
        model._compiled_call_impl = compiled_impl
    assert not torch.allclose(wide, doubled, atol=1e-2)
    torch.testing.assert_close(wide, eager_wide, rtol=1e-4, atol=1e-4)
    steps_of_the_caller_s_own()


def test_the_replay_snapshot_notices_what_a_trusted_model_may_still_change():
    """``CallGraphs``' check before a replay (the walk done once, flat lists read at each call):
    in-place updates are fine (the graph reads the weights where they are); a replaced parameter,
    a replaced or added submodule, a new buffer, new data, another training mode, a new hook are not."""
    from transfuse.compile.replay import _Snapshot

    model = _model("llama", num_hidden_layers=2)
    snapshot = _Snapshot(model)
    assert snapshot.holds() and len(snapshot.tensors) == len(list(model.parameters())) + len(list(model.buffers()))
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert snapshot.holds()
    changes = [
        lambda m: setattr(m.lm_head, "weight", torch.nn.Parameter(m.lm_head.weight.detach().clone())),
        lambda m: setattr(m.lm_head.weight, "data", m.lm_head.weight.data.clone()),
        lambda m: setattr(m.model.layers[0], "mlp", copy.deepcopy(m.model.layers[0].mlp)),
        lambda m: m.model.norm.register_buffer("extra", torch.zeros(1)),
        lambda m: m.model.layers[1].add_module("extra", torch.nn.Identity()),
        lambda m: m.model.layers[1].train(),
        lambda m: m.model.layers[0].self_attn.register_forward_hook(lambda *args: None),
    ]
    for change in changes:
        changed = copy.deepcopy(model)
        snapshot = _Snapshot(changed)
        change(changed)
        assert not snapshot.holds(), change


def _served_calls(model):
    """Wrap the compiled function so every call records the Dynamo entry its locals select
    (``DynamoEntries.serving``, evaluated inside the call's own context)."""
    compiled = model._transfuse_compiled
    inner = compiled.compiled
    seen = []

    def call(*args, **kwargs):
        output = inner(*args, **kwargs)
        frame = {"args": args, "kwargs": kwargs}
        seen.append((frame, compiled.dynamo.serving(frame)))
        return output

    compiled.compiled = call
    return seen


@pytest.mark.parametrize("trust_modules", [False, True], ids=["every_guard", "trusted"])
def test_dynamo_s_guards_name_the_entry_a_call_runs_and_fail_on_what_changed(trust_modules):
    """What a replay checks: the entry Dynamo would run for a decode step is found from its
    guards alone, its frame changes nothing outside the graph, and its guards fail for the grad
    mode or autocast, with the module guards on or off; what the forward reads through a module
    (an epsilon, the configs' attention implementation) fails them only with the module guards on
    (where our own snapshot sees nothing: the modules and weights are the same objects)."""
    from transfuse.compile.calls import attention_implementation
    from transfuse.compile.replay import _Snapshot

    model = _model("llama")
    ids, mask = _padded_batch()
    transfuse.compile(model, inductor=False, kv_store=True, trust_modules=trust_modules)
    compiled = model._transfuse_compiled
    assert compiled.dynamo.available
    seen = _served_calls(model)
    _generate(model, ids, mask, new=4)
    (_, prompt), *steps = seen
    assert prompt is not None and all(served is not None for _, served in steps)
    decode = {served[1] for _, served in steps}
    assert len(decode) == 1 and prompt[1] not in decode  # the prompt and the decode steps: two entries
    frame, served = steps[-1]
    assert compiled.dynamo.refusal(served) is None
    assert compiled.dynamo.effects[served[1]] is None
    snapshot = _Snapshot(model)
    with torch.no_grad():
        with attention_implementation(compiled.configs, IMPLEMENTATION):
            assert compiled.dynamo.serving(frame)[0] is served[0]
            model.model.norm.eps = model.model.norm.eps * 10
            assert snapshot.holds()
            assert (compiled.dynamo.serving(frame) is None) is not trust_modules
            model.model.norm.eps = model.model.norm.eps / 10
            assert compiled.dynamo.serving(frame)[0] is served[0]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert compiled.dynamo.serving(frame) is None
        # Outside the call's context the configs name their own attention.
        assert (compiled.dynamo.serving(frame) is None) is not trust_modules
    assert compiled.dynamo.serving(frame) is None  # the grad mode on


def test_a_compiled_call_that_changes_an_attribute_is_not_replayed():
    """Dynamo's compiled code sets the attribute in Python after the graph; a replay of the
    graph would not, so such an entry is refused, with or without the module guards."""
    model = _model("llama")
    norm = model.model.norm

    class Counting(type(norm)):
        def forward(self, hidden):
            self.calls = self.calls + 1
            return super().forward(hidden)

    norm.__class__ = Counting
    norm.calls = 0
    transfuse.compile(model, inductor=False, kv_store=True)
    compiled = model._transfuse_compiled
    seen = _served_calls(model)
    _generate(model, ids := _padded_batch()[0], torch.ones_like(ids), new=3)
    assert norm.calls == len(seen) == 3  # Dynamo's code sets it after each graph
    # Each call recompiles (its guards hold the count), and every compile knows why it may not be replayed.
    assert len(compiled.dynamo.effects) == 3
    for compile_id, effects in compiled.dynamo.effects.items():
        assert effects is not None and effects.startswith("sets") and effects.endswith("model.norm.calls"), effects
        refusal = compiled.dynamo.refusal((compile("graph()", "<t>", "eval"), compile_id))
        assert refusal == f"the compiled call {effects} outside its graph"


def test_replay_refusals():
    """A replay needs a known entry with nothing known to be outside its graph and no graph break."""
    from transfuse.compile.replay import DynamoEntries

    entries = DynamoEntries(_served_calls)
    plain, resumed = compile("graph()", "<t>", "eval"), compile("__resume_at_12_3(graph())", "<t>", "eval")
    entries.effects.update({"0/0": None, "0/1": "sets x.y"})
    assert entries.refusal((plain, "0/0")) is None
    assert "graph breaks" in entries.refusal((resumed, "0/0"))
    assert entries.refusal((plain, "0/1")) == "the compiled call sets x.y outside its graph"
    assert "unknown" in entries.refusal((plain, "5/0"))
    assert "no compiled entry" in entries.refusal(None)


def test_beam_search_through_the_store_matches_the_eager_model():
    """Beam search reorders the cache every step (new tensors, not the store's views): the store
    takes the reordered keys and values in again, and the beams are the eager model's."""
    model = _model("llama")
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, new=8, num_beams=3)
    transfuse.compile(model, inductor=False, kv_store=True)
    got = _generate(model, ids, mask, new=8, num_beams=3)
    compiled = model._transfuse_compiled
    assert compiled.calls["eager"] == 0 and compiled.store_refused is None and len(compiled.stores) == 1
    assert torch.equal(got, want)


def test_a_cache_whose_layers_hold_different_lengths_takes_the_cache_s_own_path():
    from transformers import DynamicCache

    from transfuse.compile import kv_store

    model = _model("llama")
    cache = DynamicCache(config=model.config)
    kv = model.config.num_key_value_heads
    dim = model.config.hidden_size // model.config.num_attention_heads
    cache.update(torch.randn(1, kv, 5, dim), torch.randn(1, kv, 5, dim), 0)
    assert kv_store.signature(cache, 5) is None  # the second layer holds nothing
    cache.update(torch.randn(1, kv, 4, dim), torch.randn(1, kv, 4, dim), 1)
    assert kv_store.signature(cache, 5) is None  # ... and then fewer positions
    transfuse.compile(model, inductor=False, kv_store=True)
    compiled = model._transfuse_compiled
    assert compiled._store(cache, torch.zeros(1, 1, dtype=torch.long), None, 5) is None and not compiled.stores


def test_graph_keys_leave_the_model_s_tensors_out_and_a_failed_capture_warns_once():
    weight = torch.nn.Parameter(torch.ones(3))
    piece = backend.GraphedPiece(lambda w, x: w + x, "p0", lambda: {weight.data_ptr()}, copy_outputs=True)
    assert piece._shapes((weight, torch.zeros(2, 3))) == (torch.Size([2, 3]),)
    assert piece._shapes((weight, torch.zeros(4, 3))) == (torch.Size([4, 3]),)
    with pytest.warns(UserWarning, match="piece p0 runs without a CUDA graph: capturing failed \\(RuntimeError: boom\\)"):
        piece._capture_failed(("a",), RuntimeError("boom\nsecond line"), "piece p0 runs without a CUDA graph")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        piece._capture_failed(("b",), RuntimeError("again"), "piece p0 runs without a CUDA graph")
    assert piece._failed == {("a",), ("b",)} and piece.failed == "RuntimeError: boom"
