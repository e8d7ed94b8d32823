"""decode_attention (a decode step's cache write and attention in one op) and the compile path's
cache with room: the Triton kernel (interpreted on the CPU) against the native definition, and
``transfuse.compile``'s generation against the eager model's with the kernel in place."""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse import ops
from transfuse.compile import attention
from transfuse.ops import decode_attention_native
from transfuse.tiny import tiny_model

from .test_compile import _generate, _padded_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_first():
    ops.set_priority(["triton"], "decode_attention")
    yield
    ops.set_priority(None, "decode_attention")


def _inputs(batch, heads, kv_heads, dim, seen, capacity, dtype, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)  # noqa: E731
    query, key, value = make(batch, heads, 1, dim), make(batch, kv_heads, 1, dim), make(batch, kv_heads, 1, dim)
    keys, values = make(batch, kv_heads, capacity, dim), make(batch, kv_heads, capacity, dim)
    allowed = None
    if masked:
        allowed = (torch.rand(batch, seen + 1, generator=g) > 0.3).to(DEVICE)
        allowed[0] = False  # a sequence that may attend to nothing but the new token
    return query, key, value, keys, values, allowed


CASES = [  # batch, heads, kv heads, dim, cached tokens, capacity
    (1, 4, 2, 16, 0, 1),
    (2, 8, 2, 32, 37, 50),
    (1, 32, 8, 128, 200, 260),
    (3, 6, 6, 24, 70, 71),
]


@pytest.mark.parametrize("masked", [False, True], ids=["all", "padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_the_kernel_writes_the_token_and_attends_as_the_native_definition(triton_first, case, dtype, masked):
    query, key, value, keys, values, allowed = _inputs(*case, dtype, masked)
    seen = case[4]
    native_keys, native_values = keys.clone(), values.clone()
    want = decode_attention_native(query, key, value, native_keys, native_values, seen, allowed, case[3] ** -0.5)
    with ops.trace() as calls:
        got = ops.decode_attention(query, key, value, keys, values, seen, allowed, case[3] ** -0.5)
    assert [c.provider for c in calls] == ["triton"]
    assert torch.equal(keys, native_keys) and torch.equal(values, native_values)  # the token at its place, the rest kept
    assert got.shape == want.shape == (case[0], 1, case[1], case[3]) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_the_mask_and_the_cache_change_the_answer(triton_first):
    """The kernel's answer moves with what it is told to hide and with the cached keys."""
    query, key, value, keys, values, allowed = _inputs(2, 8, 2, 32, 37, 50, torch.float32, masked=True)
    everything = ops.decode_attention(query, key, value, keys.clone(), values.clone(), 37, None, 0.2)
    hidden = ops.decode_attention(query, key, value, keys.clone(), values.clone(), 37, allowed, 0.2)
    other = keys.clone()
    other[:, :, 5] += 1
    moved = ops.decode_attention(query, key, value, other, values.clone(), 37, None, 0.2)
    assert not torch.allclose(everything, hidden) and not torch.allclose(everything, moved)


def test_bad_shapes_are_refused_with_the_shapes():
    query, key, value, keys, values, _ = _inputs(1, 4, 2, 16, 3, 4, torch.float32, masked=False)
    with pytest.raises(ValueError, match="room for position 4"):
        ops.decode_attention(query, key, value, keys, values, 4, None, 0.25)
    with pytest.raises(ValueError, match="one token"):
        ops.decode_attention(query.expand(1, 4, 2, 16), key, value, keys, values, 2, None, 0.25)


def _layer(tokens: int, batch: int = 2, heads: int = 2, dim: int = 8):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.update(torch.randn(batch, heads, tokens, dim), torch.randn(batch, heads, tokens, dim), 0)
    return cache


def test_the_cache_layer_keeps_its_tensors_as_views_of_buffers_with_room_and_follows_crop_and_reorder():
    cache = _layer(5)
    layer = cache.layers[0]
    before = layer.keys.clone()
    new = torch.randn(2, 2, 1, 8)
    keys, values, seen = attention._room(cache, 0, new, new)
    assert seen == 5 and keys.shape[2] >= 6 and layer.keys.shape[2] == 6 and cache.get_seq_length() == 6
    assert torch.equal(layer.keys[:, :, :5], before) and layer.keys.data_ptr() == keys.data_ptr()
    keys[:, :, 5:6].copy_(new)  # what decode_attention writes
    again, _, seen = attention._room(cache, 0, new, new)
    assert seen == 6 and again is keys  # the same buffers: no copy
    cache.crop(-3)  # a shorter view of the same buffers (assisted decoding)
    cropped, _, seen = attention._room(cache, 0, new, new)
    assert seen == 4 and cropped is keys
    cache.reorder_cache(torch.tensor([1, 0]))  # beam search: new tensors
    reordered, _, seen = attention._room(cache, 0, new, new)
    assert seen == 5 and reordered is not keys and torch.equal(layer.keys[0, :, :4], before[1, :, :4])
    while layer.keys.shape[2] < reordered.shape[2]:  # fill the buffer: the next token grows it once
        reordered[:, :, layer.keys.shape[2] - 1].zero_()
        attention._room(cache, 0, new, new)
    grown, _, _ = attention._room(cache, 0, new, new)
    assert grown is not reordered and grown.shape[2] > reordered.shape[2]


@pytest.mark.parametrize("provider", ["triton", "native"])
def test_compiled_generation_with_the_cache_written_in_place_matches_the_eager_model(provider):
    """Padding, several layers, ten decode steps: tokens equal, and the cache the caller gets holds
    what the eager model's holds."""
    torch.manual_seed(0)
    model = transfuse.rewrite(tiny_model("llama").eval())
    ids, mask = _padded_batch()
    want = _generate(model, ids, mask, return_dict_in_generate=True)
    transfuse.compile(model, inductor=False)
    ops.set_priority([provider], "decode_attention")
    try:
        with ops.trace() as calls:
            got = _generate(model, ids, mask, return_dict_in_generate=True)
    finally:
        ops.set_priority(None, "decode_attention")
    assert torch.equal(got.sequences, want.sequences)
    steps = [c for c in calls if c.op == "decode_attention"]
    assert len(steps) == 9 * model.config.num_hidden_layers and {c.provider for c in steps} == {provider}
    for got_layer, want_layer in zip(got.past_key_values.layers, want.past_key_values.layers):
        real = mask.bool()[:, None, :, None].expand_as(want_layer.keys[:, :, : ids.shape[1]])
        torch.testing.assert_close(got_layer.keys[:, :, : ids.shape[1]][real], want_layer.keys[:, :, : ids.shape[1]][real])
        torch.testing.assert_close(got_layer.keys[:, :, ids.shape[1] :], want_layer.keys[:, :, ids.shape[1] :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slices", [1, 3, 40])
def test_the_positions_split_over_programs_give_the_same_answer(triton_first, monkeypatch, slices):
    """One program per (sequence, key/value head), a few slices combined by the second kernel, or
    one slice per block of positions: each against the native definition, padding included."""
    from transfuse.ops.triton import decode_attention as kernels

    query, key, value, keys, values, allowed = _inputs(2, 8, 2, 32, 150, 160, torch.float32, masked=True)
    allowed[1, 100:] = False  # whole slices with nothing to attend to
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 4 * slices)
    monkeypatch.setattr(kernels, "MIN_SLICE", 1)
    want = decode_attention_native(query, key, value, keys.clone(), values.clone(), 150, allowed, 0.2)
    got = ops.decode_attention(query, key, value, keys, values, 150, allowed, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
