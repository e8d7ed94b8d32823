"""The MoE ops: native routing and experts against plain loops, autograd, compile, and the
Triton kernels (under TRITON_INTERPRET=1 on CPU, small shapes) against native."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transfuse.ops import ExpertsSpec, RoutingSpec, moe_experts, moe_experts_native, moe_route_native
from transfuse.ops.moe import moe_route

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "relu": F.relu,
}


def _reference_experts(x, weights, ids, w13, w2, b13, b2, spec: ExpertsSpec, alpha=1.0, limit=math.inf):
    """One token and one slot at a time, in float64."""
    x, weights, w13, w2 = x.double(), weights.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            w_in = w13[e] if spec.w13_transposed else w13[e].T  # [H, 2I]
            h = x[t] @ w_in + (b13[e].double() if b13 is not None else 0)
            first, second = (h[::2], h[1::2]) if spec.interleaved else h.chunk(2)
            gate, up = (first, second) if spec.gate_first else (second, first)
            if spec.activation == "clamped_swiglu":
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = (up + 1) * gate * torch.sigmoid(alpha * gate)
            else:
                a = ACTIVATIONS[spec.activation](gate) * up
            w_out = w2[e] if spec.w2_transposed else w2[e].T  # [I, H]
            out[t] += weights[t, j] * (a @ w_out + (b2[e].double() if b2 is not None else 0))
    return out


def _experts_case(spec: ExpertsSpec, tokens=5, hidden=40, inter=24, experts=6, top_k=3, bias=False, seed=0,
                  dtype=torch.float32):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    if spec.w13_transposed:
        w13 = w13.transpose(1, 2).contiguous()
    if spec.w2_transposed:
        w2 = w2.transpose(1, 2).contiguous()
    b13 = torch.randn(experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(experts, hidden, generator=g) if bias else None
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    cast = lambda t: t.to(dtype) if t is not None else None
    return cast(x), cast(weights), ids, cast(w13), cast(w2), cast(b13), cast(b2)


SPECS = [
    (ExpertsSpec("silu"), False),
    (ExpertsSpec("gelu", gate_first=False), False),
    (ExpertsSpec("gelu_tanh", w2_transposed=True), True),
    (ExpertsSpec("relu", w13_transposed=True), False),
    (ExpertsSpec("clamped_swiglu", interleaved=True, w13_transposed=True, w2_transposed=True), True),
]


@pytest.mark.parametrize("spec, bias", SPECS, ids=lambda v: v.describe() if isinstance(v, ExpertsSpec) else str(v))
def test_native_experts_equal_a_plain_loop_in_every_layout(spec, bias):
    x, weights, ids, w13, w2, b13, b2 = _experts_case(spec, bias=bias)
    got = moe_experts(x, weights, ids, w13, w2, spec, b13=b13, b2=b2, alpha=1.702, limit=0.8)
    want = _reference_experts(x, weights, ids, w13, w2, b13, b2, spec, alpha=1.702, limit=0.8)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec, bias", SPECS, ids=lambda v: v.describe() if isinstance(v, ExpertsSpec) else str(v))
def test_native_experts_gradients_equal_the_loop(spec, bias):
    """Every input's gradient, the routing weights' included (the router trains through them)."""
    tensors = [t.requires_grad_() if t is not None and t.is_floating_point() else t
               for t in _experts_case(spec, bias=bias)[:7]]  # fmt: skip
    x, weights, ids, w13, w2, b13, b2 = tensors
    inputs = [t for t in (x, weights, w13, w2, b13, b2) if t is not None]
    out = moe_experts(x, weights, ids, w13, w2, spec, b13=b13, b2=b2, alpha=1.702, limit=0.8)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    reference = _reference_experts(x, weights, ids, w13, w2, b13, b2, spec, alpha=1.702, limit=0.8)
    want = torch.autograd.grad(reference.square().sum(), inputs)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got.double(), expected.double(), rtol=1e-4, atol=1e-5)


def test_native_experts_are_two_grouped_matmuls_whatever_the_experts_hit(monkeypatch):
    spec = ExpertsSpec("silu")
    x, weights, _, w13, w2, _, _ = _experts_case(spec, tokens=4, experts=64, top_k=2)
    ids = torch.tensor([[3, 9], [9, 3], [3, 40], [40, 9]])
    calls = []
    grouped = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(tuple(a[1].shape)) or grouped(*a, **k))
    got = moe_experts_native(x, weights, ids, w13, w2, None, None, *spec.flags(), 1.0, math.inf)
    assert calls == [(64, 40, 48), (64, 24, 40)]  # gate/up, then down: all 64 experts, no loop
    torch.testing.assert_close(got.double(), _reference_experts(x, weights, ids, w13, w2, None, None, spec),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_native_experts_loop_where_grouped_matmul_has_no_kernel(monkeypatch):
    """float64 (no grouped_mm kernel) runs one matmul per hit expert, with the same result."""
    from transfuse.ops import moe as moe_module

    spec = ExpertsSpec("gelu", w2_transposed=True)
    x, weights, ids, w13, w2, b13, b2 = (t.double() if t is not None and t.is_floating_point() else t
                                         for t in _experts_case(spec, bias=True))  # fmt: skip
    calls = []
    looped = moe_module._looped_matmul
    monkeypatch.setattr(moe_module, "_looped_matmul", lambda *a: calls.append(1) or looped(*a))
    got = moe_experts_native(x, weights, ids, w13, w2, b13, b2, *spec.flags(), 1.0, math.inf)
    assert len(calls) == 2
    torch.testing.assert_close(got, _reference_experts(x, weights, ids, w13, w2, b13, b2, spec))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_experts_export_with_no_data_dependent_guard(dtype):
    """No host sync, no shape read off the data: ``torch.export`` traces the op with dynamic tokens
    (bf16 through ``torch._grouped_mm``, float32 through the opaque ``transfuse::grouped_matmul``)."""
    spec = ExpertsSpec("silu")
    x, weights, ids, w13, w2, _, _ = _experts_case(spec, tokens=6, dtype=dtype)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w13, self.w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)

        def forward(self, x, weights, ids):
            return moe_experts_native(x, weights, ids, self.w13, self.w2, None, None, *spec.flags(), 1.0, math.inf)

    tokens = torch.export.Dim("tokens", min=2, max=1024)
    model = Experts()
    exported = torch.export.export(model, (x, weights, ids), dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    other = _experts_case(spec, tokens=9, seed=1, dtype=dtype)
    torch.testing.assert_close(exported.module()(*other[:3]), model(*other[:3]))


def _reference_route(logits, bias, k, spec, n_group=1, topk_group=1, eps=None, minimum=None, scale=None):
    """Routing written out the long way, as models do (per token, in float64)."""
    weights, ids = [], []
    for row in logits.double():
        if spec.scoring == "topk_softmax":
            top, idx = row.topk(k)
            w = top.softmax(-1)
        elif spec.scoring == "topk_sigmoid":
            top, idx = row.topk(k)
            w = top.sigmoid()
        else:
            scores = row.softmax(-1) if spec.scoring == "softmax" else row.sigmoid()
            choice = scores + (bias.double() if bias is not None else 0)
            if spec.grouped:
                per = row.numel() // n_group
                group_score = choice.view(n_group, per).topk(2).values.sum(-1)
                keep = group_score.topk(topk_group).indices
                allowed = torch.zeros(n_group, dtype=torch.bool)
                allowed[keep] = True
                choice = choice.masked_fill(~allowed.repeat_interleave(per), -math.inf)
            idx = choice.topk(k).indices
            w = scores[idx]
        if spec.renormalize:
            total = w.sum() + (eps or 0.0)
            w = w / (max(total, minimum) if minimum is not None else total)
        if spec.scaled:
            w = w * scale
        order = idx.argsort()
        weights.append(w[order])
        ids.append(idx[order])
    return torch.stack(weights), torch.stack(ids)


ROUTINGS = [
    RoutingSpec("softmax"),
    RoutingSpec("softmax", renormalize=True),
    RoutingSpec("topk_softmax"),
    RoutingSpec("topk_sigmoid"),
    RoutingSpec("topk_sigmoid", float32=False, renormalize=True),
    RoutingSpec("sigmoid", correction_bias=True, renormalize=True, scaled=True),
    RoutingSpec("sigmoid", correction_bias=True, grouped=True, renormalize=True, scaled=True),
    RoutingSpec("softmax", correction_bias=True, renormalize=True),
]


def _route_args(spec: RoutingSpec, tokens=7, experts=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    bias = torch.randn(experts, generator=g) * 0.1 if spec.correction_bias else None
    numbers = dict(n_group=4, topk_group=2, renorm_eps=1e-20 if spec.scoring.endswith("sigmoid") else None,
                   renorm_min=1e-3 if spec.correction_bias and spec.scoring == "softmax" else None, scale=2.5)  # fmt: skip
    return logits, bias, numbers


def _sorted(weights, ids):
    order = ids.argsort(-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("spec", ROUTINGS, ids=RoutingSpec.describe)
def test_native_routing_equals_the_routing_written_out(spec):
    logits, bias, n = _route_args(spec)
    weights, ids = moe_route(logits, 3, spec, correction_bias=bias, n_group=n["n_group"], topk_group=n["topk_group"],
                             renorm_eps=n["renorm_eps"], renorm_min=n["renorm_min"], scale=n["scale"])  # fmt: skip
    want_w, want_ids = _reference_route(logits, bias, 3, spec, n["n_group"], n["topk_group"], n["renorm_eps"],
                                        n["renorm_min"], n["scale"])  # fmt: skip
    got_w, got_ids = _sorted(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w.double(), want_w, rtol=1e-6, atol=1e-7)


def test_routing_refuses_a_bias_the_spec_does_not_have():
    with pytest.raises(ValueError, match="correction_bias"):
        moe_route(torch.randn(2, 8), 2, RoutingSpec("softmax"), correction_bias=torch.zeros(8))


def _tie_order_reversed(logits, *rest):
    """Native's routing with the slots of each token's equal-logit experts in the other order."""
    weights, ids = moe_route_native(logits, *rest)
    by_id, first = ids.sort(dim=-1, descending=True, stable=True)
    second = logits.gather(-1, by_id).argsort(dim=-1, descending=True, stable=True)
    order = first.gather(-1, second)
    return weights.gather(-1, order), ids.gather(-1, order)


def _first_two_ids_swapped(logits, *rest):
    """Native's routing with each token's first two experts' ids exchanged (their weights kept)."""
    weights, ids = moe_route_native(logits, *rest)
    return weights, ids[:, [1, 0, *range(2, ids.shape[1])]]


@pytest.mark.parametrize("provider, conformant", [(_tie_order_reversed, True), (_first_two_ids_swapped, False)])
def test_routing_conformance_compares_tied_experts_in_one_order(provider, conformant):
    """bfloat16 router logits tie often, and top-k leaves the order of equal values open (torch's
    CUDA top-k sorts its picks with an unstable sort): a provider that orders a token's tied experts
    otherwise is conformant; one that gives a weight to another expert is not."""
    from transfuse import ops
    from transfuse.ops import get_op

    g = torch.Generator().manual_seed(3)
    logits = (torch.randint(-3, 4, (64, 16), generator=g).float() / 2).to(torch.bfloat16)  # ties in most rows
    weights, ids = moe_route_native(logits, None, 4, "softmax", True, False, 1, 1, True, None, None, None, None)
    reordered = _tie_order_reversed(logits, None, 4, "softmax", True, False, 1, 1, True, None, None, None, None)
    assert not torch.equal(reordered[1], ids) and torch.equal(reordered[0], weights)  # the case is a real one
    ops.register_provider("moe_route", "reordered", provider, supports_args=lambda *a, **k: True)
    ops.set_priority(["reordered"], op="moe_route")
    try:
        with ops.trace() as calls:
            moe_route(logits, 4, RoutingSpec("softmax"))
        found = get_op("moe_route")._verdicts.values()
        verdict = next(v for verdicts in found for v in verdicts.values() if v.provider == "reordered")
    finally:
        ops.set_priority(None, op="moe_route")
        ops.unregister_provider("moe_route", "reordered")
    assert verdict.passed is conformant, verdict
    assert [c.provider for c in calls] == (["reordered"] if conformant else ["native"])


def test_routing_results_compare_pairs_in_one_order_among_equal_logits():
    """What conformance compares (the op's sampler): each token's (weight, id) pairs sorted by logit,
    then id. Tied experts in either order compare equal; a weight moved to another expert, or
    another expert chosen among those tied at the k-th place, does not."""
    from transfuse.ops import get_op

    sampler = get_op("moe_route").sampler
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]])
    args = (logits, None, 2, "topk_softmax", True, False, 1, 1, False, None, None, None, None)

    def compared(weights, ids):
        return sampler.comparable([torch.tensor([weights]), torch.tensor([ids])], args, {})

    want = compared([0.5, 0.5], [1, 2])
    for got in (compared([0.5, 0.5], [2, 1]), compared([0.5, 0.5], [1, 2])):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(compared([0.5, 0.5], [1, 4])[1], want[1])  # another expert of the tie
    assert not torch.equal(compared([0.7, 0.3], [2, 0])[0], compared([0.7, 0.3], [0, 2])[0])  # weights follow ids


def test_experts_op_compiles_without_graph_breaks():
    spec = ExpertsSpec("silu")
    x, weights, ids, w13, w2, _, _ = _experts_case(spec)
    compiled = torch.compile(lambda *a: moe_experts(*a, spec), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, weights, ids, w13, w2), moe_experts(x, weights, ids, w13, w2, spec))


# ---- Triton kernels, under the interpreter on CPU ----------------------------------------

triton_moe = pytest.importorskip("transfuse.ops.triton.moe", reason="triton is part of the dev dependencies")
from transfuse.ops.triton import moe_configs  # noqa: E402  (after the check that Triton is there)
# On a GPU machine the same tests run the compiled kernels; elsewhere conftest sets TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(tensors):
    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors)


def _poisoned_empty(monkeypatch):
    """Outputs and workspaces start as NaN (or huge ints): every element read must have been written."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(2**30 if t.dtype != torch.bool else 1)

    monkeypatch.setattr(torch, "empty", poisoned)


TRITON_CASES = [
    (ExpertsSpec("silu"), False, dict(tokens=1, top_k=2)),
    (ExpertsSpec("gelu", gate_first=False), False, dict(tokens=6, top_k=3)),
    (ExpertsSpec("clamped_swiglu", interleaved=True, w13_transposed=True, w2_transposed=True), True, dict(tokens=5)),
    (ExpertsSpec("clamped_swiglu"), False, dict(tokens=48, top_k=2)),  # minimax_m3's layout
]


@pytest.mark.parametrize(
    "spec, bias, shape", TRITON_CASES, ids=lambda v: v.describe() if isinstance(v, ExpertsSpec) else ""
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_experts_equal_native(spec, bias, shape, dtype, monkeypatch):
    args = _on_device(_experts_case(spec, bias=bias, dtype=dtype, **shape))
    want = moe_experts_native(*args, *spec.flags(), 1.702, 0.8)
    _poisoned_empty(monkeypatch)
    # Small tiles, so that several K steps and N blocks run and the odd sizes are masked.
    with moe_configs.using_config(moe_configs.MoEConfig(16, 16, 16, 4, 2)):
        got = triton_moe.moe_experts(*args, *spec.flags(), 1.702, 0.8)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# Every layout the kernels read, with shared experts (more pairs than experts used), one slot,
# all experts in use, odd and power-of-two sizes; (spec, bias, case shape).
DECODE_CASES = [
    (ExpertsSpec("silu"), False, dict(tokens=1, top_k=2, experts=4)),
    (ExpertsSpec("silu", interleaved=True), True, dict(tokens=1, top_k=8, experts=8)),
    (ExpertsSpec("gelu", gate_first=False), False, dict(tokens=3, top_k=3, experts=4)),
    (ExpertsSpec("gelu_tanh", w2_transposed=True), True, dict(tokens=2, top_k=1, experts=5)),
    (ExpertsSpec("relu", w13_transposed=True), False, dict(tokens=5, top_k=2, experts=16, hidden=64, inter=32)),
    (ExpertsSpec("clamped_swiglu", interleaved=True, w13_transposed=True, w2_transposed=True), True,
     dict(tokens=4, top_k=4, experts=8)),
    (ExpertsSpec("silu", interleaved=True, gate_first=False, w13_transposed=True), True, dict(tokens=2, top_k=3)),
    (ExpertsSpec("silu", w2_transposed=True), True, dict(tokens=2, top_k=10, experts=12)),  # 16 slots in a tile
]  # fmt: skip
# Largest error over the reference's largest magnitude. The interpreter rounds float32 to
# bfloat16 by truncation, and the kernels round where the models do (about 7 times).
SCALED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def _assert_close_to_scale(got, want):
    scale = want.float().abs().max().item()
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=SCALED_TOLERANCE[want.dtype] * scale)


@pytest.mark.parametrize("spec, bias, shape", DECODE_CASES, ids=lambda v: v.describe() if isinstance(v, ExpertsSpec) else "")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_path_equals_native(spec, bias, shape, dtype, monkeypatch):
    args = _on_device(_experts_case(spec, bias=bias, dtype=dtype, **shape))
    want = moe_experts_native(*args, *spec.flags(), 1.702, 0.8)
    _poisoned_empty(monkeypatch)
    # Small tiles, so that several K steps and N blocks run and the odd sizes are masked.
    with moe_configs.using_config(moe_configs.DecodeConfig(16, 16, 16, 16, 4, 2)):
        got = triton_moe.moe_experts(*args, *spec.flags(), 1.702, 0.8)
    _assert_close_to_scale(got, want)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_path_weighs_the_slots_in_the_models_dtype(weights_dtype, monkeypatch):
    """bf16 tokens with float32 routing weights add float32 products; with bf16 weights each
    product is rounded to bf16 first, as torch's type promotion does in the models."""
    spec = ExpertsSpec("silu")
    x, weights, ids, w13, w2, _, _ = _experts_case(spec, tokens=3, top_k=4, experts=8, dtype=torch.bfloat16)
    args = _on_device((x, weights.to(weights_dtype), ids, w13, w2, None, None))
    want = moe_experts_native(*args, *spec.flags(), 1.0, math.inf)
    _poisoned_empty(monkeypatch)
    with moe_configs.using_config(moe_configs.CONFIGS["decode"]):
        got = triton_moe.moe_experts(*args, *spec.flags(), 1.0, math.inf)
    _assert_close_to_scale(got, want)


def test_decode_path_runs_for_few_pairs_and_the_grouped_path_for_more(monkeypatch):
    spec = ExpertsSpec("silu")
    ran = []
    for path in ("_decode", "_grouped"):
        real = getattr(triton_moe, path)
        monkeypatch.setattr(triton_moe, path, lambda *a, real=real, path=path: ran.append(path) or real(*a))
    for tokens in (2, 3):  # 8 experts, top-3: 6 pairs fit the decode path, 9 do not
        args = _on_device(_experts_case(spec, tokens=tokens, top_k=3, experts=8))
        want = moe_experts_native(*args, *spec.flags(), 1.0, math.inf)
        torch.testing.assert_close(triton_moe.moe_experts(*args, *spec.flags(), 1.0, math.inf), want)
    assert ran == ["_decode", "_grouped"]
    assert moe_configs.regime(1, 8, 128) == moe_configs.regime(8, 8, 128) == "decode"
    assert moe_configs.regime(16, 8, 128) == "tiny" and moe_configs.regime(4096, 8, 128) == "large"


def test_a_configuration_too_large_for_the_device_is_shrunk_and_remembered(monkeypatch):
    """Should Triton refuse a configuration for want of shared memory, the call still succeeds
    with a smaller one, and later calls start from that one."""
    from triton.runtime.errors import OutOfResources

    spec = ExpertsSpec("silu")
    args = _on_device(_experts_case(spec, tokens=4, top_k=2, experts=4))
    want = moe_experts_native(*args, *spec.flags(), 1.0, math.inf)
    tried = []
    real = triton_moe._grouped

    def short_of_shared_memory(*a):
        tried.append(a[-1])
        if a[-1].num_stages > 2:
            raise OutOfResources(245760, 232448, "shared memory")
        return real(*a)

    monkeypatch.setattr(triton_moe, "_grouped", short_of_shared_memory)
    monkeypatch.setattr(triton_moe, "_SHRUNK", {})
    config = moe_configs.MoEConfig(16, 16, 16, 4, 4)
    with moe_configs.using_config(config):
        for _ in range(2):
            torch.testing.assert_close(triton_moe.moe_experts(*args, *spec.flags(), 1.0, math.inf), want)
    assert [c.num_stages for c in tried] == [4, 3, 2, 2]
    assert {c.block_m for c in tried} == {16}


@pytest.mark.parametrize("spec", ROUTINGS, ids=RoutingSpec.describe)
def test_triton_routing_equals_native(spec, monkeypatch):
    logits, bias, n = _on_device(_route_args(spec, tokens=19))
    args = (logits, bias, 3, spec.scoring, spec.float32, spec.grouped, n["n_group"], n["topk_group"], spec.renormalize,
            n["renorm_eps"], n["renorm_min"], n["scale"] if spec.scaled else None, None)  # fmt: skip
    want = _sorted(*moe_route_native(*args))
    _poisoned_empty(monkeypatch)
    got = _sorted(*triton_moe.moe_route(*args))
    assert torch.equal(got[1], want[1])
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pairs, experts, block_m", [(13, 8, 16), (200, 128, 16), (6000, 8, 64), (5000, 128, 32)])
def test_alignment_groups_every_pair_by_expert_in_aligned_blocks(pairs, experts, block_m, monkeypatch):
    """Few pairs take the one-program path, many the count/offsets/scatter path; tiles of many
    experts hold fewer pairs, so those loop over several tiles per program."""
    ids = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    max_blocks = pairs // block_m + min(pairs, experts) + 1
    _poisoned_empty(monkeypatch)
    size = triton_moe._workspace_size(pairs, experts, block_m, max_blocks)
    meta = torch.empty(size, dtype=torch.int32, device=DEVICE)
    triton_moe._align(ids, experts, block_m, max_blocks, meta)
    meta, ids = meta.cpu(), ids.cpu()
    block_expert, block_end, sorted_ids = meta[:max_blocks], meta[max_blocks : 2 * max_blocks], meta[2 * max_blocks :]
    seen = []
    for b in range(max_blocks):
        e = int(block_expert[b])
        if e < 0:
            assert all(int(x) < 0 for x in block_expert[b:])  # only trailing blocks are unused
            break
        rows = sorted_ids[b * block_m : max(b * block_m, min((b + 1) * block_m, int(block_end[b])))]
        assert bool((ids[rows.long()] == e).all())
        seen += rows.tolist()
    assert sorted(seen) == list(range(pairs))
