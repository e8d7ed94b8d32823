"""Batch-invariant mode: each row's numbers are the same bits alone, in batches of other sizes, at
other positions, and behind left padding; for every op the mode dispatches and for whole models.

Row-wise checks: a random batch; every row computed alone, then inside batches of other sizes
holding other random rows, at another position; compared with ``torch.equal``. Whole models:
the logits of a prompt alone and in a left-padded batch of 5, eagerly; each sample's loss in a
training-mode forward alone and in a batch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from transfuse import ops
from transfuse.ops import batch_invariant as bi
from transfuse.ops import conformance
from transfuse.ops.dispatch import Op, Provider, batch_invariant_mode
from transfuse.tiny import tiny_model


@contextlib.contextmanager
def mode():
    with batch_invariant_mode(), bi.InvariantFunctions():
        yield


def _rows_agree(fn, make, rows: int = 5, sizes=(1, 3, 8)) -> None:
    """``fn`` of each row of ``make(rows)`` equals ``fn`` of that row placed inside batches of the
    other ``sizes`` (other random rows around it, the row last, then first)."""
    torch.manual_seed(0)
    batch = make(rows)
    with mode():
        full = fn(batch)
        for i in range(rows):
            one = batch[i : i + 1]
            for size in sizes:
                company = make(max(size - 1, 0))
                for at in (0, company.shape[0]):
                    mixed = torch.cat([company[:at], one, company[at:]])
                    got = fn(mixed)[at]
                    assert torch.equal(got, full[i]), f"row {i} in a batch of {size} at {at}"


DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_matmul_give_each_row_the_same_bits_at_every_batch_size(dtype):
    w, b = torch.randn(24, 40).to(dtype), torch.randn(24).to(dtype)
    _rows_agree(lambda x: F.linear(x, w, b), lambda n: torch.randn(n, 40).to(dtype))
    _rows_agree(lambda x: x @ w.T, lambda n: torch.randn(n, 40).to(dtype))
    _rows_agree(lambda x: torch.matmul(x, w.T.unsqueeze(0)), lambda n: torch.randn(n, 3, 40).to(dtype))
    with mode():  # close to torch's own
        x = torch.randn(7, 40).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(F.linear(x, w, b).float(), F.linear(x.float(), w.float(), b.float()), atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("shape, dim", [((6,), 0), ((1, 9), -1), ((4, 9), -1), ((3, 5, 7), 1)])
def test_ordered_sums_scan_in_order_on_every_device(shape, dim):
    """The scan under ``ordered_sum`` runs along a dimension that is neither the innermost nor the
    tensor's only one, where torch's CUDA ``cumsum`` adds each sum's elements one after another
    (elsewhere it scans as a tree shaped by the row count, or with CUB): counted at every ``cumsum``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    scans = []

    class Scans(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.cumsum.default:
                x, along = args[0], args[1] % args[0].dim()
                scans.append((along != x.dim() - 1, x.numel() != x.shape[along]))
            return func(*args, **(kwargs or {}))

    x = torch.randn(shape)
    with Scans():
        total = bi.ordered_sum(x, dim)
    assert scans == [(True, True)]
    torch.testing.assert_close(total, x.double().sum(dim).float())


def test_sums_means_softmax_and_cross_entropy_are_row_invariant():
    _rows_agree(lambda x: x.sum(-1), lambda n: torch.randn(n, 77))
    _rows_agree(lambda x: x.pow(2).mean(-1, keepdim=True), lambda n: torch.randn(n, 33))
    _rows_agree(lambda x: F.softmax(x, dim=-1), lambda n: torch.randn(n, 50))
    _rows_agree(lambda x: torch.log_softmax(x, -1), lambda n: torch.randn(n, 50))
    # (each row's label from the row itself: its smallest logit's class)
    _rows_agree(lambda x: F.cross_entropy(x, x.argmin(-1), reduction="none"), lambda n: torch.randn(n, 50))
    with mode():
        x = torch.randn(4, 50)
        torch.testing.assert_close(F.softmax(x, -1), torch.softmax(x.clone(), -1).clone())


def test_attention_of_a_query_ignores_left_padding_and_the_batch():
    """A sequence's attention output alone equals its output behind any amount of left padding,
    among other sequences, with GQA and a boolean or additive causal mask."""
    torch.manual_seed(0)
    heads, kv_heads, dim, length = 4, 2, 16, 6
    q, k, v = (torch.randn(1, h, length, dim) for h in (heads, kv_heads, kv_heads))

    def causal(length: int, pad: int) -> torch.Tensor:
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        allowed[:, :pad] = False
        return allowed

    with mode():
        alone = F.scaled_dot_product_attention(q, k, v, attn_mask=causal(length, 0), enable_gqa=True)
        for pad, others in ((3, 2), (7, 4)):
            total = length + pad
            batch = [torch.randn(others + 1, h, total, dim) for h in (heads, kv_heads, kv_heads)]
            for t, own in zip(batch, (q, k, v)):
                t[others, :, pad:] = own[0]
            mask = torch.stack([causal(total, 0)] * others + [causal(total, pad)])[:, None]
            got = F.scaled_dot_product_attention(*batch, attn_mask=mask, enable_gqa=True)
            assert torch.equal(got[others, :, pad:], alone[0])
            additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
            got = F.scaled_dot_product_attention(*batch, attn_mask=additive, enable_gqa=True)
            assert torch.equal(got[others, :, pad:], alone[0])
        reference = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(alone, reference, atol=1e-5, rtol=1e-5)


def _norm_ops(device: str = "cpu"):
    spec = ops.RMSNormSpec()
    w = torch.randn(48, device=device)
    return {
        "rms_norm": lambda x: ops.rms_norm(x, w, 1e-6, spec),
        "fused_add_rms_norm": lambda x: torch.cat(ops.fused_add_rms_norm(x, x * 0.5 + 1, w, 1e-6, spec), -1),
        "gated_rms_norm": lambda x: ops.gated_rms_norm(x, x.flip(-1), w, 1e-6, spec, "silu"),
        "act_and_mul": lambda x: ops.act_and_mul(x, "silu"),
    }


@pytest.mark.parametrize("op", list(_norm_ops()))
def test_dispatched_ops_native_give_each_row_the_same_bits(op):
    fn = _norm_ops()[op]
    _rows_agree(fn, lambda n: torch.randn(n, 48))


# Where Triton kernels run: the GPU if there is one, else the CPU under the interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _no_triton(found: Op) -> str | None:
    """Why ``found``'s Triton provider does not run here (None: it does, on ``TRITON_DEVICE``)."""
    from transfuse.ops.triton import interpreting

    if not found.is_supported(found.providers["triton"]):
        return "Triton is not installed"
    if TRITON_DEVICE == "cpu" and not interpreting():
        return "no GPU, and Triton's interpreter is off (TRITON_INTERPRET=1 runs the kernels on the CPU)"
    return None


def _interpreted_only() -> str | None:
    """Why a test of the interpreter's launch choices does not run here (None: it does)."""
    from transfuse.ops.triton import interpreting

    if TRITON_DEVICE != "cpu":
        return ("it counts launches and tiles chosen for the interpreter (8 programs fill its device, tiles of 16); "
                "on a GPU benchmarks/bench_invariant_kernels.py and bench_invariant_moe.py check the same bits at real shapes")
    if not interpreting():
        return "Triton's interpreter is off (TRITON_INTERPRET=1 runs the kernels on the CPU)"
    return None


@pytest.fixture
def on_triton_device():
    """Tensors the test makes are on ``TRITON_DEVICE`` (the CPU's default is left alone)."""
    with torch.device(TRITON_DEVICE) if TRITON_DEVICE != "cpu" else contextlib.nullcontext():
        yield


@pytest.mark.parametrize("op", ["rms_norm", "gated_rms_norm", "act_and_mul"])
def test_triton_providers_give_each_row_the_same_bits(op):
    names = {"act_and_mul": ["silu_and_mul"]}.get(op, [op])
    for name in names:
        found = ops.get_op(name)
        if not found.is_supported(found.providers["triton"]):
            pytest.skip("Triton is not installed")
    fn = _norm_ops(TRITON_DEVICE)[op]
    for name in names:
        ops.set_priority(["triton"], op=name)
    try:
        x = torch.randn(2, 48, device=TRITON_DEVICE)
        with conformance.assumed(), ops.trace() as log:
            with mode():
                got = fn(x)
            _rows_agree(fn, lambda n: torch.randn(n, 48, device=TRITON_DEVICE), rows=2, sizes=(1, 3))
        assert {d.provider for d in log} == {"triton"}, log
        for name in names:
            ops.set_priority(["native"], op=name)
        with mode():
            torch.testing.assert_close(got, fn(x), atol=1e-5, rtol=1e-5)
    finally:
        for name in names:
            ops.set_priority(None, op=name)


def test_a_triton_provider_runs_its_host_code_outside_the_modes_handlers(monkeypatch):
    """A provider declared batch-invariant computes in its kernels: in the mode, none of the torch
    calls its host code makes goes through the mode's handlers; the native definition's do (they
    are what makes it invariant)."""
    found = ops.get_op("rms_norm")
    if not found.is_supported(found.providers["triton"]):
        pytest.skip("Triton is not installed")
    seen: list = []
    original = bi.InvariantFunctions.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(bi.InvariantFunctions, "__torch_function__", counting)
    x, w = torch.randn(3, 48, device=TRITON_DEVICE), torch.randn(48, device=TRITON_DEVICE)
    calls = {}
    try:
        for provider in ("triton", "native"):
            ops.set_priority([provider], op="rms_norm")
            with conformance.assumed(), ops.trace() as log, mode():
                seen.clear()
                ops.rms_norm(x, w, 1e-6)
                calls[provider] = len(seen)
            assert {d.provider for d in log} == {provider}
    finally:
        ops.set_priority(None, op="rms_norm")
    assert calls["triton"] == 0 and calls["native"] > 0, calls


def test_triton_gemm_and_attention_are_invariant_and_match_native(on_triton_device):
    """The GPU kernels of the mode (on a GPU, or interpreted): rows alone equal rows in a batch; a
    query alone equals the query behind left padding; each close to the native ordered form."""
    names = ("invariant_linear", "invariant_bmm", "invariant_attention")
    found = ops.get_op("invariant_linear")
    if why := _no_triton(found):
        pytest.skip(why)
    for name in names:
        ops.set_priority(["triton"], op=name)
    try:
        torch.manual_seed(0)
        w, b = torch.randn(24, 40), torch.randn(24)
        with conformance.assumed(), ops.trace() as log:
            _rows_agree(lambda x: F.linear(x, w, b), lambda n: torch.randn(n, 40), rows=3, sizes=(1, 3))
            x = torch.randn(4, 40)
            with mode():
                got = F.linear(x, w, b)
                batched = torch.bmm(torch.randn(2, 5, 16), torch.randn(2, 16, 7))
            torch.testing.assert_close(got, bi.invariant_linear_native(x, w, b), atol=1e-5, rtol=1e-5)
            assert batched.shape == (2, 5, 7)
            q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
            allowed = torch.ones(5, 5, dtype=torch.bool).tril()
            with mode():
                alone = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
                pad = 19
                batch = [torch.randn(2, 2, 5 + pad, 16) for _ in range(3)]
                for t, own in zip(batch, (q, k, v)):
                    t[1, :, pad:] = own[0]
                mask = torch.ones(5 + pad, 5 + pad, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
                mask[1, :, :, :pad] = False
                got = F.scaled_dot_product_attention(*batch, attn_mask=mask)
            assert torch.equal(got[1, :, pad:], alone[0])
            torch.testing.assert_close(alone, bi.invariant_attention_native(q, k, v, allowed), atol=1e-5, rtol=1e-5)
        assert {d.provider for d in log} == {"triton"} and {d.op for d in log} == set(names)
    finally:
        for name in names:
            ops.set_priority(None, op=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_gemm_gives_the_same_bits_in_one_launch_or_split_by_chunks(monkeypatch, dtype):
    """The GEMM sums a long reduction in chunks. Where the tiles are too few to fill the device (few
    rows) it runs a program per chunk and adds the partials after; otherwise one program takes
    every chunk. Both give the same bits, so a row's bits do not depend on which ran (interpreted)."""
    if why := _interpreted_only():
        pytest.skip(why)
    from transfuse.ops.triton import invariant

    from .test_triton_launch import _CountingJIT

    split = _CountingJIT(invariant._partial_kernel)
    monkeypatch.setattr(invariant, "_partial_kernel", split)
    torch.manual_seed(0)
    k = 3 * invariant.gemm_tiles(24, 70).chunk - 26  # three chunks, the last one partial
    a, b, bias = torch.randn(2, 37, k).to(dtype), torch.randn(2, k, 24).to(dtype), torch.randn(24).to(dtype)
    one = invariant.bmm(a, b, bias, dtype, split=False)
    assert split.calls == 0
    assert torch.equal(invariant.bmm(a, b, bias, dtype, split=True), one)
    assert split.calls == 1
    exact = (a.double() @ b.double() + bias.double()).to(dtype)
    torch.testing.assert_close(one, exact, **({} if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)))
    # Chosen by the launch's size: one row splits, many rows do not and take taller tiles; the
    # row's bits are the same.
    few = invariant.bmm(a[:1, 5:6], b[:1], bias, dtype)
    assert split.calls == 2
    many = invariant.bmm(a[:1].repeat(1, 4, 1), b[:1], bias, dtype)
    assert split.calls == 2
    assert invariant.gemm_tiles(24, k, 4 * 37).block_m > invariant.gemm_tiles(24, k, 37).block_m
    assert torch.equal(few[0, 0], one[0, 5]) and torch.equal(many[0, 5], one[0, 5])


@pytest.mark.parametrize("additive", [False, True], ids=["boolean", "additive"])
@pytest.mark.parametrize("pad", [5, 21])
def test_triton_attention_of_a_causal_prompt_is_the_same_bits_behind_left_padding(pad, additive, monkeypatch, on_triton_device):
    """A prompt over several blocks of keys, alone (``is_causal``, no mask) and left-padded in a
    batch (a boolean mask, or an additive one holding float32's lowest value as transformers'
    do), its query heads sharing key/value heads: the same bits for every real query, and for the
    prompt alone in programs of another number of rows (the Triton kernel, on a GPU or
    interpreted)."""
    found = ops.get_op("invariant_attention")
    if why := _no_triton(found):
        pytest.skip(why)
    from transfuse.ops.triton import invariant

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    _, keys, warps = invariant.attention_tiles(64, dim)  # (the key/value heads repeated: a row a query)
    length = 2 * keys + 5  # over three blocks of keys
    q = torch.randn(1, heads, length, dim)
    k, v = (torch.randn(1, kv_heads, length, dim) for _ in range(2))
    batch = [torch.randn(2, t.shape[1], length + pad, dim) for t in (q, k, v)]
    for t, own in zip(batch, (q, k, v)):
        t[0, :, pad:] = own[0]
    mask = torch.ones(length + pad, length + pad, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    mask[0, :, :, :pad] = False
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ops.set_priority(["triton"], op="invariant_attention")
    try:
        with conformance.assumed(), ops.trace() as log, mode():
            alone = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            padded = F.scaled_dot_product_attention(*batch, attn_mask=mask, enable_gqa=True)
        assert {d.provider for d in log} == {"triton"}
        assert torch.equal(padded[0, :, pad:], alone[0])
        torch.testing.assert_close(alone, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        other = 16 if invariant.attention_tiles(length, dim)[0] != 16 else 32
        monkeypatch.setattr(invariant, "attention_tiles", lambda *_: (other, keys, warps))
        with conformance.assumed(), mode():
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), alone)
    finally:
        ops.set_priority(None, op="invariant_attention")


@pytest.mark.parametrize("provider", ["native", "triton"])
def test_decode_attention_of_a_sequence_ignores_its_padding_and_the_batch(provider, request):
    """One query a sequence over buffers: a left-padded sequence among others gives what it gives
    alone over its own keys (Triton: the mode's walk from the first key, on a GPU or interpreted)."""
    found = ops.get_op("decode_attention")
    if provider == "triton" and (why := _no_triton(found)):
        pytest.skip(why)
    if provider == "triton":
        request.getfixturevalue("on_triton_device")
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length, pad = 3, 4, 2, 16, 20, 7
    q, k, v = torch.randn(batch, heads, 1, dim), torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    bias = torch.zeros(batch * kv_heads, 1, length)
    bias[kv_heads : 2 * kv_heads, :, :pad] = float("-inf")
    ops.set_priority([provider], op="decode_attention")
    try:
        with conformance.assumed(), ops.trace() as log, mode():
            together = ops.decode_attention(q, k, v, bias, 0.25)
            own = [t[1:2, :, pad:].contiguous() for t in (k, v)]
            alone = ops.decode_attention(q[1:2], *own, torch.zeros(kv_heads, 1, length - pad), 0.25)
        assert {d.provider for d in log} == {provider}
        assert torch.equal(together[1], alone[0])
        ops.set_priority(["native"], op="decode_attention")
        torch.testing.assert_close(together, ops.decode_attention(q, k, v, bias, 0.25), atol=1e-5, rtol=1e-5)
    finally:
        ops.set_priority(None, op="decode_attention")


def test_triton_decode_attention_reads_no_key_outside_the_kept_span(on_triton_device):
    """A buffer longer than its sequence: keys before the first kept one and after the last hold
    NaN (never written), and so does the slot the step's own key and value go to; the kernel
    writes them there and each row gives, finite, the bits it gives over its own keys alone. A
    read of any NaN would make the row NaN (the kernel, on a GPU or interpreted)."""
    found = ops.get_op("decode_attention")
    if why := _no_triton(found):
        pytest.skip(why)
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length, at = 3, 4, 2, 16, 60, 24
    # Kept keys of each sequence: a padded one, one from the start, one past the mask scan's first
    # block (32 keys interpreted).
    spans = [(7, 25), (0, 41), (36, 55)]
    q = torch.randn(batch, heads, 1, dim)
    k, v = (torch.full((batch, kv_heads, length, dim), float("nan")) for _ in range(2))
    bias = torch.full((batch * kv_heads, 1, length), float("-inf"))
    for i, (lo, hi) in enumerate(spans):
        k[i, :, lo:hi], v[i, :, lo:hi] = torch.randn(2, kv_heads, hi - lo, dim)
        bias[i * kv_heads : (i + 1) * kv_heads, :, lo:hi] = 0.0
    new_k, new_v = torch.randn(2, batch, kv_heads, 1, dim)
    k[:, :, at], v[:, :, at] = float("nan"), float("nan")
    position = torch.tensor([at])
    ops.set_priority(["triton"], op="decode_attention")
    try:
        with conformance.assumed(), mode():
            together = ops.decode_attention(q, k, v, bias, 0.25, new_k, new_v, position)
            assert torch.equal(k[:, :, at], new_k[:, :, 0]) and torch.equal(v[:, :, at], new_v[:, :, 0])
            for i, (lo, hi) in enumerate(spans):
                own = [t[i : i + 1, :, lo:hi].contiguous() for t in (k, v)]
                alone = ops.decode_attention(q[i : i + 1], *own, torch.zeros(kv_heads, 1, hi - lo), 0.25)
                assert torch.equal(together[i], alone[0]), f"sequence {i}"
        assert together.isfinite().all()
    finally:
        ops.set_priority(None, op="decode_attention")


@pytest.mark.parametrize("pad", [3, 40])
def test_triton_decode_step_is_the_last_row_of_its_padded_prompt(pad, on_triton_device):
    """A left-padded prompt's last query through the prompt's kernel (a boolean mask row a query)
    and the same query as a decode step over a longer buffer (one additive mask row for all its
    queries, scanned in wide blocks, the keys past the prompt masked): the same bits (the kernel,
    on a GPU or interpreted)."""
    found = ops.get_op("decode_attention")
    if why := _no_triton(found):
        pytest.skip(why)
    torch.manual_seed(0)
    heads, kv_heads, dim, length, spare = 4, 2, 16, 45, 30
    total = pad + length
    q = torch.randn(1, heads, total, dim)
    k, v = (torch.randn(1, kv_heads, total + spare, dim) for _ in range(2))
    mask = torch.ones(total, total, dtype=torch.bool).tril()[None, None].clone()
    mask[..., :pad] = False
    bias = torch.full((kv_heads, 1, total + spare), float("-inf"))
    bias[..., pad:total] = 0.0
    ops.set_priority(["triton"], op="decode_attention")
    ops.set_priority(["triton"], op="invariant_attention")
    try:
        with conformance.assumed(), ops.trace() as log, mode():
            prompt = F.scaled_dot_product_attention(q, k[:, :, :total], v[:, :, :total], attn_mask=mask, enable_gqa=True)
            step = ops.decode_attention(q[:, :, -1:].contiguous(), k, v, bias, dim**-0.5)
        assert {d.provider for d in log} == {"triton"}
        assert torch.equal(step[0, 0], prompt[0, :, -1])
    finally:
        ops.set_priority(None, op="decode_attention")
        ops.set_priority(None, op="invariant_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("provider", ["native", "triton"])
def test_decode_attention_of_a_row_is_the_modes_attention_of_that_row(provider, dtype, request):
    """A decode step attends through ``decode_attention`` over fixed buffers or a padded batch, and
    through ``scaled_dot_product_attention`` alone: in the mode both give a row the same bits."""
    found = ops.get_op("decode_attention")
    if provider == "triton" and (why := _no_triton(found)):
        pytest.skip(why)
    if provider == "triton":
        request.getfixturevalue("on_triton_device")
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length = 2, 4, 2, 16, 20
    q = torch.randn(batch, heads, 1, dim).to(dtype)
    k, v = (torch.randn(batch, kv_heads, length, dim).to(dtype) for _ in range(2))
    ops.set_priority([provider], op="decode_attention")
    ops.set_priority([provider], op="invariant_attention")
    try:
        with conformance.assumed(), mode():
            decoded = ops.decode_attention(q, k, v, torch.zeros(batch * kv_heads, 1, length, dtype=dtype), 0.25)
            attended = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
        assert torch.equal(decoded, attended.transpose(1, 2))
    finally:
        ops.set_priority(None, op="decode_attention")
        ops.set_priority(None, op="invariant_attention")


@pytest.mark.gpu
def test_eager_decoding_and_the_decode_steps_give_the_same_bits_on_the_gpu():
    """At Llama-3-8B's layer shapes (2 layers, bf16), a prompt decoded greedily in the mode gives
    every step's logits the same bits eagerly (attention through ``scaled_dot_product_attention``)
    and through the decode steps (the store's ``decode_attention``, replayed as CUDA graphs). The
    attention kernel's variants for the two calls are compiled apart; a row's softmax total once
    depended on which ran (``tl.sum``'s order follows the compiler's layout): on an H100 this
    configuration then differed at step 12 (``benchmarks/invariant_bisect.py --across --steps``)."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from transfuse.compile import eager_steps

    config = AutoConfig.for_model(
        "llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=32000, max_position_embeddings=8192, num_hidden_layers=2,
    )  # fmt: skip
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    transfuse.rewrite(model, batch_invariant=True)
    stepped = transfuse.decode_steps(copy.deepcopy(model))
    options = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, return_dict_in_generate=True, output_logits=True)
    for seed in range(1, 5):  # (the first: the bisection's prompt)
        generator = torch.Generator().manual_seed(seed)
        length = int(torch.randint(16, 121, (1,), generator=generator))
        prompt = torch.randint(1, config.vocab_size, (1, length), generator=generator).cuda()
        with torch.no_grad():
            eager = torch.stack(model.generate(prompt, attention_mask=torch.ones_like(prompt), **options).logits)
            steps = torch.stack(stepped.generate(prompt, attention_mask=torch.ones_like(prompt), **options).logits)
        assert eager_steps.stats(stepped)["replays"] > 0
        same = (eager == steps).flatten(1).all(-1)
        assert same.all(), f"a prompt of {length} tokens: steps {(~same).nonzero().flatten().tolist()} differ"


def test_rotary_gives_each_token_the_same_bits():
    torch.manual_seed(0)
    cos, sin = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def fn(x):
        q, k = ops.rotary(x, x * 2, cos, sin, 1)
        return torch.cat([q, k], -1)

    _rows_agree(fn, lambda n: torch.randn(n, 3, 1, 8))


def test_moe_experts_give_each_token_the_same_bits_whatever_the_token_count():
    torch.manual_seed(0)
    experts, hidden, inner, top_k = 4, 16, 8, 2
    w13, w2 = torch.randn(experts, 2 * inner, hidden) / 4, torch.randn(experts, hidden, inner) / 4
    router = torch.randn(experts, hidden)

    def fn(x):
        logits = F.linear(x, router)
        weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
        return ops.moe_experts(x, weights, ids, w13, w2)

    _rows_agree(fn, lambda n: torch.randn(n, hidden), sizes=(1, 3, 40))


def test_triton_moe_routes_and_runs_every_token_count_one_way_in_the_mode(monkeypatch):
    """The Triton routing and experts (interpreted) in the mode: a token's weights, ids and output
    are the same bits alone and among 2 or 39 other tokens. Counted at the kernels' host code: every
    call takes the grouped path with ``INVARIANT_CONFIG``'s reduction block, where out of the mode
    one token takes the decode path and 40 tokens other tiles."""
    from transfuse.ops.triton import moe as triton_moe
    from transfuse.ops.triton.moe_configs import INVARIANT_CONFIG

    if why := _interpreted_only():
        pytest.skip(why)
    paths = []
    for path in ("_decode", "_grouped"):
        run = getattr(triton_moe, path)
        monkeypatch.setattr(
            triton_moe, path, lambda *a, _run=run, _path=path: paths.append((_path, a[-1], a[0].shape[0])) or _run(*a)
        )
    torch.manual_seed(0)
    experts, hidden, inner, top_k = 4, 16, 8, 2
    w13, w2 = torch.randn(experts, 2 * inner, hidden) / 4, torch.randn(experts, hidden, inner) / 4
    router = torch.randn(experts, hidden)

    def fn(x):
        weights, ids = ops.moe_route(F.linear(x, router), top_k)
        return torch.cat([ops.moe_experts(x, weights, ids, w13, w2), weights, ids.to(x.dtype)], -1)

    for name in ("moe_route", "moe_experts"):
        ops.set_priority(["triton"], op=name)
    try:
        with conformance.assumed(), ops.trace() as log:
            _rows_agree(fn, lambda n: torch.randn(n, hidden), rows=2, sizes=(1, 3, 40))
            in_mode = list(paths)
            paths.clear()
            fn(torch.randn(1, hidden)), fn(torch.randn(40, hidden))
        assert {(d.op, d.provider) for d in log if d.op.startswith("moe")} == {("moe_route", "triton"), ("moe_experts", "triton")}
        assert {path for path, _, _ in in_mode} == {"_grouped"}
        assert {config.block_k for _, config, _ in in_mode} == {INVARIANT_CONFIG.block_k}
        assert {tokens for _, _, tokens in in_mode} >= {1, 40}
        assert paths[0][0] == "_decode" and paths[1][1] != in_mode[0][1]
    finally:
        for name in ("moe_route", "moe_experts"):
            ops.set_priority(None, op=name)


@pytest.mark.parametrize("provider", ["native", "triton"])
def test_grouped_matmul_gives_each_row_the_same_bits_in_any_group_layout(provider, request):
    """The MoE layer's grouped matmul in the mode: a row's product with its group's matrix is the
    same bits alone and among other rows of its group and of other groups (empty groups included),
    and rows past the last group are zeros. The Triton kernel (interpreted) reads the groups on the
    device; both are close to the float64 product."""
    found = ops.get_op("invariant_grouped_mm")
    if provider == "triton" and (why := _no_triton(found)):
        pytest.skip(why)
    if provider == "triton":
        request.getfixturevalue("on_triton_device")
    torch.manual_seed(0)
    groups, k, n = 3, 40, 24
    mats = torch.randn(groups, k, n)
    rows = torch.randn(9, k)
    ends = torch.tensor([4, 4, 8], dtype=torch.int32)  # group 1 empty; row 8 past the last group
    ops.set_priority([provider], op="invariant_grouped_mm")
    try:
        with conformance.assumed(), ops.trace() as log, mode():
            full = torch._grouped_mm(rows, mats, offs=ends)
            for i, group in ((0, 0), (3, 0), (5, 2), (7, 2)):
                alone = torch._grouped_mm(rows[i : i + 1], mats, offs=torch.tensor([1 if g >= group else 0 for g in range(groups)], dtype=torch.int32))
                assert torch.equal(alone[0], full[i])
        assert {d.provider for d in log} == {provider}
        assert torch.equal(full[8], torch.zeros(n))
        want = torch.cat([rows[:4].double() @ mats[0].double(), rows[4:8].double() @ mats[2].double()])
        torch.testing.assert_close(full[:8].double(), want, atol=1e-4, rtol=1e-4)
    finally:
        ops.set_priority(None, op="invariant_grouped_mm")


def test_the_mode_takes_only_providers_declared_invariant_and_ignores_deferral():
    def native(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    op = Op("test_batch_invariant_pick", native)
    op.register(Provider("plain", lambda x: x + 1, defers=lambda x: x.shape[0] >= 4, thresholds={"rows": (4,)}))
    op.register(Provider("steady", lambda x: x + 1, defers=lambda x: x.shape[0] < 4, batch_invariant=True))
    ops.set_priority(["plain", "steady"], op=op.name)
    try:
        assert op.select(torch.ones(2, 3)).name == "plain"
        assert op.select(torch.ones(8, 3)).name == "steady"
        with batch_invariant_mode():
            assert {op.select(torch.ones(n, 3)).name for n in (1, 2, 8, 5000)} == {"steady"}
    finally:
        ops.set_priority(None, op=op.name)


# ---------------------------------------------------------------------------------------------
# Whole models.


def _left_padded(prompt: torch.Tensor, vocab: int, row: int = 2, lengths=(8, 11, 0, 10, 5)):
    """A batch of 5 left-padded sequences of other random tokens, ``prompt`` as row ``row``."""
    g = torch.Generator().manual_seed(1)
    width = max(max(lengths), prompt.shape[1])
    ids = torch.randint(0, vocab, (5, width), generator=g)
    mask = torch.zeros(5, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        n = prompt.shape[1] if i == row else n
        mask[i, width - n :] = 1
    ids[row, width - prompt.shape[1] :] = prompt[0]
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "gemma2"])
def invariant_model(request):
    model = tiny_model(request.param).eval()
    transfuse.rewrite(model, batch_invariant=True, verify=False)
    return model


def test_a_prompts_logits_are_the_same_bits_alone_and_in_a_left_padded_batch(invariant_model):
    model = invariant_model
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(2))
    ids, mask, positions = _left_padded(prompt, vocab)
    with torch.no_grad():
        alone = model(prompt, attention_mask=torch.ones_like(prompt), position_ids=torch.arange(7)[None]).logits[0]
        batch = model(ids, attention_mask=mask, position_ids=positions).logits[2, -7:]
    assert torch.equal(alone, batch)
    report = str(transfuse.report(model))
    assert "batch-invariant mode: on" in report


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma2"])
def test_compiled_decode_steps_are_the_same_bits_alone_and_in_a_left_padded_batch(model_type):
    """``transfuse.compile`` in the mode (its default there: the pieces as traced), bfloat16: every
    generated step's logits for a prompt alone (its attention through scaled_dot_product_attention)
    and inside a left-padded batch (through decode_attention) are equal. Each call is one graph:
    the mode is entered around the compiled call, not traced (Dynamo breaks the graph at its
    context variable and compiles the model's forward as a frame every transformers model shares)."""
    from torch._dynamo.utils import counters

    model = tiny_model(model_type).to(torch.bfloat16).eval()
    transfuse.rewrite(model, batch_invariant=True, verify=False)
    transfuse.compile(model, cache_dir=False)
    counters["graph_break"].clear()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(2))
    ids, mask, _ = _left_padded(prompt, vocab)
    options = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options).logits
        batch = model.generate(ids, attention_mask=mask, **options).logits
    assert model._transfuse_compiled.calls["compiled"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(alone) == len(batch) == 3
    for step_alone, step_batch in zip(alone, batch):
        assert torch.equal(step_alone[0], step_batch[2])


def test_inductor_compiles_a_modes_pieces_with_eager_rounding_and_unsplit_reductions(monkeypatch):
    """What Inductor is asked for, counted at each piece it compiles: in the mode, intermediate
    values rounded as eager code rounds them and no reduction split by the row count; out of it,
    Inductor's defaults."""
    import torch._inductor.compile_fx as inductor

    seen = []

    def record(piece, inputs, *args, **kwargs):
        config = torch._inductor.config
        seen.append((config.emulate_precision_casts, config.split_reductions))
        return piece  # the piece as traced: what is counted here is the settings

    monkeypatch.setattr(inductor, "compile_fx", record)
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    for invariant in (True, False):
        model = tiny_model("llama", num_hidden_layers=1).eval()
        transfuse.rewrite(model, batch_invariant=invariant, verify=False)
        transfuse.compile(model, cache_dir=False, inductor=True)  # asked for: not the mode's default
        seen.clear()
        with torch.no_grad():
            model(prompt)
        assert seen and set(seen) == ({(True, False)} if invariant else {(False, True)})


def test_in_the_mode_compile_leaves_the_pieces_as_traced_unless_inductor_is_asked_for(monkeypatch):
    """Counted at Inductor's entry: a batch-invariant model's compiled pieces run as traced by
    default (code Inductor generated for an elementwise piece gave a row other bits in a batch on
    a GPU); a model out of the mode goes through Inductor as before."""
    import torch._inductor.compile_fx as inductor

    compiled = []

    def record(piece, inputs, *args, **kwargs):
        compiled.append(piece)
        return piece

    monkeypatch.setattr(inductor, "compile_fx", record)
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    for invariant in (True, False):
        model = tiny_model("llama", num_hidden_layers=1).eval()
        transfuse.rewrite(model, batch_invariant=invariant, verify=False)
        transfuse.compile(model, cache_dir=False)
        compiled.clear()
        with torch.no_grad():
            model(prompt)
        assert model._transfuse_compiled.calls["compiled"] > 0
        assert (len(compiled) == 0) == invariant


@pytest.mark.parametrize("inductor", [False, True], ids=["traced", "inductor"])
def test_compiled_prompts_attend_through_the_modes_attention(inductor):
    """Counted at the dispatcher: a compiled call's attention runs outside Dynamo (the
    ``cached_attention`` op), so outside the torch-function mode the forward enters; a prompt's
    attention there is the mode's ``invariant_attention`` (one per layer), never the library's SDPA,
    whose kernels choose their key blocks by the sequence's length."""
    from transfuse.ops import dispatch

    model = tiny_model("llama", num_hidden_layers=2).eval()
    transfuse.rewrite(model, batch_invariant=True, verify=False)
    transfuse.compile(model, inductor=inductor, cache_dir=False)
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), dispatch.trace() as log:
        model(prompt)
    assert model._transfuse_compiled.calls["compiled"] > 0
    assert [entry.op for entry in log].count("invariant_attention") == 2


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_compiled_and_eager_paths_dispatch_the_same_ops_in_the_mode(model_type):
    """Counted at the dispatcher, one prompt through the eager model and through the compiled one:
    the same ops in the same order, so a row meets the same providers' arithmetic on both paths.
    Out of the mode, compiled code traces the model's own rotary function instead of the rotary op
    (Inductor fuses it); in the mode that function's bf16 steps would round where a GPU rotary
    kernel does not."""
    from transfuse.ops import dispatch

    model = tiny_model(model_type, num_hidden_layers=2).eval()
    transfuse.rewrite(model, batch_invariant=True, verify=False)
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), dispatch.trace() as eager:
        expected = model(prompt).logits
    transfuse.compile(model, cache_dir=False)
    with torch.no_grad(), dispatch.trace() as compiled:
        got = model(prompt).logits
    assert model._transfuse_compiled.calls["compiled"] > 0
    assert [entry.op for entry in eager].count("rotary") == 2
    assert [entry.op for entry in compiled] == [entry.op for entry in eager]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_code_in_the_mode_computes_what_each_handler_computes_eagerly(backend):
    """The mode's handlers, called in one function compiled with ``fullgraph=True`` inside the mode
    (matmuls of every form, linear, reductions, softmax, attention and the transcendental functions,
    as methods and functions, with numeric and string arguments): each result is the eager call's
    bits. Dynamo traces the handlers; a graph break inside one makes it resume another handler's
    code (under torch 2.11 ``torch.result_type`` broke the graph in the matmul handler, and the
    rotary embedding's ``sin`` that followed came out as its ``cos``): ``fullgraph`` refuses one."""
    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, 5, 8, generator=g) + 0.1  # positive: log, sqrt and a fractional power are defined
    w = torch.randn(6, 8, generator=g)
    angles = torch.arange(5.0)[None, :, None] * torch.rand(1, 1, 4, generator=g)
    inv = torch.rand(4, 1, generator=g)
    targets = torch.randint(0, 8, (10,), generator=g)

    def calls(x, w, angles):
        freqs = (inv[None] @ angles.transpose(1, 2)).transpose(1, 2)  # the rotary embedding's batched matmul
        q = x.reshape(2, 5, 2, 4).transpose(1, 2)
        return (
            freqs, freqs.cos(), freqs.sin(), x @ w.T, torch.matmul(x, w.T), F.linear(x, w), torch.bmm(x, x.transpose(1, 2)),
            x.sum(-1), torch.mean(x, dim=-1), x.softmax(-1), F.log_softmax(x, dim=-1),
            F.scaled_dot_product_attention(q, q, q, is_causal=True), F.cross_entropy(x.reshape(10, 8), targets),
            x.cos(), x.sin(), torch.cos(x), torch.sin(x), x.exp(), torch.exp(x), x.log(), torch.tanh(x),
            x.sigmoid(), torch.sigmoid(x), x.rsqrt(), torch.sqrt(x), x.erf(), x.reciprocal(), x.pow(1.5),
            torch.pow(x, 2), F.silu(x), F.gelu(x), F.gelu(x, approximate="tanh"), F.elu(x - 0.5, 0.5),
            F.softplus(x), F.mish(x), F.selu(x - 0.5),
        )  # fmt: skip

    torch._dynamo.reset()
    with batch_invariant_mode(), bi.InvariantFunctions():
        expected = calls(x, w, angles)
        got = torch.compile(calls, backend=backend, fullgraph=True)(x, w, angles)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(have, want), f"call {i}"


@pytest.mark.parametrize("inductor", [False, True], ids=["traced", "inductor"])
def test_compiled_calls_choose_their_providers_inside_the_mode(monkeypatch, inductor):
    """Counted at each provider choice a compiled call makes when it runs: the mode is on there (a
    library op in compiled code chooses its provider, and a Triton kernel its launch, at run time;
    out of the mode those depend on the row count), for prompts and decode steps alike."""
    from transfuse.ops import dispatch

    seen = []
    select = dispatch.Op._select

    def recorded(self, grad, args, kwargs):
        seen.append((self.name, dispatch.batch_invariant_active()))
        return select(self, grad, args, kwargs)

    monkeypatch.setattr(dispatch.Op, "_select", recorded)
    model = tiny_model("llama", num_hidden_layers=1).eval()
    transfuse.rewrite(model, batch_invariant=True, verify=False)
    transfuse.compile(model, inductor=inductor, cache_dir=False)
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    seen.clear()
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    assert model._transfuse_compiled.calls["compiled"] > 0
    assert {"rms_norm", "invariant_linear"} <= {name for name, _ in seen}
    assert [name for name, active in seen if not active] == []


def test_each_samples_training_loss_is_the_same_bits_alone_and_in_a_batch(invariant_model):
    model = invariant_model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, vocab, (4, 9), generator=g)
    model.train()
    try:

        def losses(ids):
            logits = model(ids).logits
            with bi.InvariantFunctions():
                per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:], reduction="none")
                return per_token.mean(-1)

        together = losses(batch)
        for i in (0, 3):
            assert torch.equal(losses(batch[i : i + 1])[0], together[i])
        together.sum().backward()  # the mode's forms differentiate
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)


def test_under_autograd_the_forward_runs_the_kernels_and_the_backward_is_the_reference_functions():
    """A forward that needs a backward still runs what a no-grad forward runs (the invariant
    kernels have no backward of their own; the native definition's products, kept by autograd,
    would take rows x outputs x inputs memory): the same bits, no cumulative sum recorded, and the
    gradients of ``F.linear`` / ``torch.bmm`` / SDPA at the same inputs."""
    torch.manual_seed(0)
    x = torch.randn(5, 40, requires_grad=True)
    w = torch.randn(24, 40, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    a, c = torch.randn(4, 5, 7, requires_grad=True), torch.randn(4, 7, 3, requires_grad=True)
    cases = [
        (lambda: F.linear(x, w, b), lambda: F.linear(x, w, b), (x, w, b)),
        (lambda: torch.matmul(a, c), lambda: torch.bmm(a, c), (a, c)),
        (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            (q, k, v),
        ),
    ]
    for invariant, reference, inputs in cases:
        with mode():
            with torch.no_grad():
                plain = invariant()
            out = invariant()
        assert torch.equal(out, plain)
        seen, stack = set(), [out.grad_fn]
        while stack:  # every node of the recorded graph
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack += [n for n, _ in node.next_functions]
        names = {type(n).__name__ for n in seen}
        assert not any("Cumsum" in name for name in names), names
        upstream = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, upstream)
        expected = torch.autograd.grad(reference(), inputs, upstream)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("masked", [False, True], ids=["is_causal", "boolean mask"])
def test_triton_attention_trains_with_sdpa_s_values_and_gradients(masked, on_triton_device):
    """The mode's Triton attention (on a GPU or interpreted) in a forward that needs a backward: SDPA's values to
    float32 rounding, from the kernel (its row totals a product), and SDPA's gradients at the same
    inputs, exactly (the reference backward); causal, or through a boolean mask with one sequence
    left-padded."""
    found = ops.get_op("invariant_attention")
    if why := _no_triton(found):
        pytest.skip(why)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    arguments = dict(is_causal=True)
    if masked:
        mask = torch.ones(6, 6, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
        mask[1, :, 2:, :2] = False  # the second sequence starts at 2 (its padding attends to itself)
        arguments = dict(attn_mask=mask)
    ops.set_priority(["triton"], op="invariant_attention")
    try:
        with conformance.assumed(), ops.trace() as log, mode():
            out = F.scaled_dot_product_attention(q, k, v, **arguments)
    finally:
        ops.set_priority(None, op="invariant_attention")
    assert {d.provider for d in log} == {"triton"}
    reference = F.scaled_dot_product_attention(q, k, v, **arguments)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), upstream)
    expected = torch.autograd.grad(reference, (q, k, v), upstream)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_the_mode_off_leaves_the_model_and_dispatch_as_they_were(monkeypatch):
    model = tiny_model("llama").eval()
    transfuse.rewrite(model, verify=False)
    assert "forward" not in model.__dict__ and not bi.is_enabled(model)
    assert transfuse.report(model).batch_invariant is None
    monkeypatch.setenv("TRANSFUSE_BATCH_INVARIANT", "1")
    other = tiny_model("llama").eval()
    transfuse.rewrite(other, verify=False)
    assert bi.is_enabled(other) and not bi.is_enabled(model)
    transfuse.rewrite(other, verify=False, batch_invariant=False)
    assert not bi.is_enabled(other)


def test_the_drop_in_loader_and_compile_take_the_argument():
    config = tiny_model("llama").config
    loaded = transfuse.AutoModelForCausalLM.from_config(config, verify=False, batch_invariant=True)
    assert bi.is_enabled(loaded) and transfuse.report(loaded).batch_invariant is not None
    transfuse.compile(loaded, batch_invariant=False)
    assert not bi.is_enabled(loaded)
    transfuse.compile(loaded, batch_invariant=True)
    assert bi.is_enabled(loaded)


class _LayerNormed(nn.Module):
    """A model-specific module the mode does not replace: torch's layer norm."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.proj(x))


def test_the_report_lists_what_the_mode_cannot_make_invariant():
    model = _LayerNormed()
    transfuse.rewrite(model, batch_invariant=True, verify=False, example_inputs=(torch.randn(2, 8),))
    found = transfuse.report(model).batch_invariant
    assert "torch.nn.functional.layer_norm" in found
    assert "layer_norm" in str(transfuse.report(model))
