"""decode_attention: the native op against attention written out in float64, and the triton
provider against both, with and without writing the token, over one and several chunks a head.

The reference is ``softmax(scaling * q k^T + bias) v`` in float64 on the same inputs (the
buffers after the token's write). A result passes when its relative error against the reference
is within ``_factor`` of native's own error (``test_kernels_backward``'s rule) or ``_floor``.
The buffers the kernel writes must hold exactly what native's ``index_copy_`` leaves there, and
nothing else may change. New tensors start as NaN (``poisoned_allocations``), so an output
element the kernel never writes cannot pass. Under Triton's interpreter these run on CPU tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from transfuse import ops
from transfuse.ops import decode_attention, decode_attention_native
from transfuse.ops.triton import decode_attention as triton_decode  # noqa: F401 (TUNING)

from .test_kernels import DEVICE, DTYPES, poisoned_allocations  # noqa: F401 (fixture)
from .test_kernels_backward import _error, _factor, _floor, seeded, triton_first  # noqa: F401 (fixtures)

# (batch, heads, kv_heads, length, dim, splits): grouped heads, one head a key/value head, a
# length no multiple of the block, one chunk a head (the first kernel writes the output) and
# several (the combine kernel does), more than the combine kernel reads as one tile (35 chunks of
# one block: a whole tile of 32 and a partial one), a head size no power of two.
CASES = [
    (1, 8, 2, 100, 32, None),
    (2, 8, 2, 130, 32, 3),
    (1, 4, 4, 64, 16, 1),
    (1, 4, 2, 35 * 64 - 10, 16, 35),
    (3, 6, 2, 200, 24, 2),
]
assert max(case[-1] or 0 for case in CASES) > triton_decode._COMBINE_SPLITS


def _inputs(batch, heads, kv_heads, length, dim, dtype, position):
    """query (a transposed view, as attention's projections give it), buffers, the token, and a
    bias that allows the positions up to the token's but masks a prefix of the first sequence
    (left padding)."""
    query = torch.randn(batch, 1, heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, length, dim, device=DEVICE, dtype=dtype)
    values = torch.randn(batch, kv_heads, length, dim, device=DEVICE, dtype=dtype)
    key = torch.randn(batch, kv_heads, 1, dim, device=DEVICE, dtype=dtype)
    value = torch.randn(batch, kv_heads, 1, dim, device=DEVICE, dtype=dtype)
    allowed = (torch.arange(length, device=DEVICE) <= position.to(DEVICE))[None].repeat(batch, 1)
    allowed[0, :5] = False
    bias = torch.zeros(batch, kv_heads, 1, length, device=DEVICE, dtype=dtype)
    bias.masked_fill_(~allowed[:, None, None, :], -math.inf)
    return query, keys, values, key, value, bias.reshape(batch * kv_heads, 1, length)


def _reference(query, keys, values, bias, scaling):
    batch, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    expand = lambda t: t.double().repeat_interleave(heads // kv_heads, dim=1)  # noqa: E731
    scores = query.double() @ expand(keys).transpose(2, 3) * scaling
    scores = scores + bias.double().reshape(batch, kv_heads, 1, 1, -1).expand(-1, -1, heads // kv_heads, -1, -1).reshape(scores.shape)
    return (scores.softmax(-1) @ expand(values)).transpose(1, 2)


@pytest.fixture
def tuning():
    yield triton_decode.TUNING
    triton_decode.TUNING.clear()


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_decode_attention_matches_the_reference(triton_first, tuning, poisoned_allocations, dtype, write):
    provider = ops.get_op("decode_attention").providers["triton"]
    assert provider.supported()
    for batch, heads, kv_heads, length, dim, splits in CASES:
        what = f"{dtype} {'write' if write else 'read'} {(batch, heads, kv_heads, length, dim)} splits {splits}"
        tuning.clear()
        if splits:
            tuning["splits"] = splits
        position = torch.tensor([length // 2 + 3], device=DEVICE)
        query, keys, values, key, value, bias = _inputs(batch, heads, kv_heads, length, dim, dtype, position)
        token = (key, value, position) if write else ()
        scaling = dim**-0.5
        native_keys, native_values = keys.clone(), values.clone()
        want = decode_attention_native(query, native_keys, native_values, bias, scaling, *token)
        assert provider.supports_args(query, keys, values, bias, scaling, *token), f"{what}: refused"
        with ops.trace() as calls:
            got = decode_attention(query, keys, values, bias, scaling, *token)
        assert [c.provider for c in calls] == ["triton"], f"{what}: {calls}"
        assert torch.equal(keys, native_keys) and torch.equal(values, native_values), f"{what}: buffers differ from native's"
        ref = _reference(query, keys, values, bias, scaling)
        assert got.shape == want.shape == (batch, 1, heads, dim) and got.is_contiguous()
        limit = max(_factor(dtype) * _error(want, ref), _floor(dtype))
        assert _error(got, ref) <= limit, f"{what}: {_error(got, ref):.3g} against native's {_error(want, ref):.3g}"


def test_native_matches_the_reference(seeded):
    query, keys, values, key, value, bias = _inputs(2, 8, 2, 70, 16, torch.float64, torch.tensor([40]))
    position = torch.tensor([40], device=DEVICE)
    got = decode_attention_native(query, keys, values, bias, 0.3, key, value, position)
    assert torch.equal(keys[:, :, 40:41], key) and torch.equal(values[:, :, 40:41], value)
    torch.testing.assert_close(got, _reference(query, keys, values, bias, 0.3), rtol=1e-12, atol=1e-12)


def test_a_masked_position_never_counts(triton_first, seeded):
    """A key the bias masks changes nothing, even where its value is huge."""
    query, keys, values, key, value, bias = _inputs(1, 4, 2, 90, 16, torch.float32, torch.tensor([60]))
    first = decode_attention(query, keys, values, bias, 0.25)
    values[:, :, 70:] = 1e30
    keys[:, :, :5] = 1e30  # the first sequence's padding
    assert torch.equal(decode_attention(query, keys, values, bias, 0.25), first)


def test_bad_arguments_are_refused_with_a_reason():
    query, keys, values, key, value, bias = _inputs(1, 4, 2, 10, 8, torch.float32, torch.tensor([3]))
    position = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match="one query per sequence"):
        decode_attention(query.expand(-1, -1, 2, -1), keys, values, bias, 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        decode_attention(query[:, :3], keys, values, bias, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(query, keys, values[:, :, :5], bias, 1.0)
    with pytest.raises(ValueError, match="bias"):
        decode_attention(query, keys, values, bias[:, :, :5], 1.0)
    with pytest.raises(ValueError, match="all of key, value and position"):
        decode_attention(query, keys, values, bias, 1.0, key, value)
    decode_attention(query, keys, values, bias, 1.0, key, value, position)


def test_arguments_the_kernel_refuses(triton_first):
    provider = ops.get_op("decode_attention").providers["triton"]
    query, keys, values, key, value, bias = _inputs(1, 4, 2, 10, 8, torch.float32, torch.tensor([3]))
    position = torch.tensor([3], device=DEVICE)
    assert provider.supports_args(query, keys, values, bias, 1.0, key, value, position)
    refused = {
        "mixed dtypes": (query, keys.double(), values.double(), bias, 1.0),
        "float64": (query.double(), keys.double(), values.double(), bias.double(), 1.0),
        "a strided head dimension": (query, keys[..., ::2], values, bias, 1.0),
        "a position of two elements": (query, keys, values, bias, 1.0, key, value, torch.tensor([3, 4], device=DEVICE)),
        "an int32 position": (query, keys, values, bias, 1.0, key, value, position.int()),
        "a bias with gaps between rows": (query, keys, values, torch.cat([bias, bias], -1)[..., :10], 1.0),
    }
    for what, args in refused.items():
        assert not provider.supports_args(*args), what


def test_a_gradient_runs_native(triton_first, seeded):
    query, keys, values, _, _, bias = _inputs(1, 4, 2, 20, 8, torch.float32, torch.tensor([12]))
    query.requires_grad_()
    with ops.trace() as calls:
        out = decode_attention(query, keys, values, bias, 0.5)
    assert [c.provider for c in calls] == ["native"]
    out.sum().backward()
    assert query.grad is not None and not query.grad.isnan().any()


def test_the_kernel_runs_by_default_on_a_gpu_platform(seeded, monkeypatch):
    """No gate of its own: with no user setting, a GPU platform's own priority (triton first)
    sends a call the kernel supports to it; the CPU platform's sends it to native."""
    from transfuse.ops import dispatch, platform

    monkeypatch.delenv("TRANSFUSE_OP_PRIORITY", raising=False)
    monkeypatch.delenv("TRANSFUSE_FORCE_NATIVE", raising=False)
    query, keys, values, _, _, bias = _inputs(1, 4, 2, 20, 8, torch.float32, torch.tensor([12]))
    providers = {}
    try:
        for name in ("cuda", "cpu"):
            chosen = platform.Platform(name, name, platform.BUILTIN_PRIORITY[name])
            monkeypatch.setattr(dispatch, "current_platform", lambda chosen=chosen: chosen)
            dispatch.refresh()
            with ops.trace() as calls:
                decode_attention(query, keys, values, bias, 0.5)
            providers[name] = [c.provider for c in calls]
    finally:
        monkeypatch.undo()
        dispatch.refresh()
    assert providers == {"cuda": ["triton"], "cpu": ["native"]}
