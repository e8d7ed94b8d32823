"""Provider conformance: a provider wrong at some shapes, some data or in its backward never runs
where it is wrong, in a rewritten model or on a direct call of the op.

Each wrong provider is a ``tests.faults.Fault``: native, then off by a percent where its condition
holds (one row, a batch, above a declared row count, a decode path's token count, an idle expert,
a long cache). Before conformance, every one of them was kept by a rewrite whose probe (one
sequence of 32 tokens) never took the faulty branch.
"""

from __future__ import annotations

import pytest
import torch

import transfuse
from transfuse import ops
from transfuse.ops import conformance, get_op
from transfuse.tiny import tiny_model

from .faults import CONDITIONS, Fault, installed, template, witness

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [(op, condition) for op, conditions in CONDITIONS.items() for condition in conditions]


def _error(dtype: torch.dtype) -> float:
    return 0.003 if dtype == torch.float32 else 0.01


def _faulty_verdict(op: str, args: tuple, kwargs: dict, grad: bool = False) -> conformance.Verdict:
    found = get_op(op).verdicts((grad, get_op(op).sampler.key(args, kwargs)))
    return next(v for v in found if v.provider == "faulty")


# ---- op level: every op, every condition, every dtype ----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op,condition", CASES, ids=[f"{o}-{c}" for o, c in CASES])
def test_a_provider_wrong_at_some_shapes_never_runs_there(op, condition, dtype):
    fault = Fault(op, condition, _error(dtype))
    args, kwargs = template(op, dtype)
    with installed(fault):
        get_op(op)(*args, **kwargs)  # a model's call: its configuration is checked at every class
        verdict = _faulty_verdict(op, args, kwargs)
        assert not verdict.passed and verdict.tag == "verify.provider", verdict
        wrong_args, wrong_kwargs = witness(fault, args, kwargs)
        assert fault.applies(*wrong_args, **wrong_kwargs)
        with ops.trace() as calls:
            got = get_op(op)(*wrong_args, **wrong_kwargs)
    assert [c.provider for c in calls] != ["faulty"]
    want = get_op(op).native.impl(*witness(fault, args, kwargs)[0])
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)  # on the CPU the next provider is native or rounds as native does


def test_an_honest_provider_passes_every_class():
    args, kwargs = template("rms_norm", torch.bfloat16)
    with installed(Fault("rms_norm", "rows >= 65", 0.0)):
        get_op("rms_norm")(*args, **kwargs)
        verdict = _faulty_verdict("rms_norm", args, kwargs)
    assert verdict.passed
    assert {"1 row", "3 rows", "2 sequences of 5", "7 rows cut from wider rows", "64 rows", "65 rows"} <= set(verdict.classes)


def test_a_threshold_nobody_declared_is_not_sought():
    """What the declarations are for: the same fault, its row count undeclared, passes the classes."""
    fault = Fault("rms_norm", "rows >= 65", 0.01)
    args, kwargs = template("rms_norm", torch.bfloat16)
    ops.register_provider("rms_norm", "faulty", fault.provider(), differentiable=True)  # no thresholds
    ops.set_priority(["faulty"], op="rms_norm")
    try:
        get_op("rms_norm")(*args, **kwargs)
        assert _faulty_verdict("rms_norm", args, kwargs).passed
    finally:
        ops.set_priority(None, op="rms_norm")
        ops.unregister_provider("rms_norm", "faulty")


def test_a_configuration_first_seen_where_nothing_can_be_checked_runs_native():
    """Under a fake-tensor trace (as inside a CUDA-graph capture) no check can run: native does,
    and the provider is judged at the next ordinary call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = template("rms_norm", torch.float32)
    with installed(Fault("rms_norm", "always", 0.0)):
        with FakeTensorMode() as mode:
            fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            assert not conformance.can_check_now(fake, {})
            assert get_op("rms_norm").select(*fake).name == "native"
        assert get_op("rms_norm").verdicts((False, get_op("rms_norm").sampler.key(args, kwargs))) == []
        with ops.trace() as calls:
            get_op("rms_norm")(*args, **kwargs)
    assert [c.provider for c in calls] == ["faulty"]


class _WrongGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, *flags):
        with torch.enable_grad():
            leaf_x, leaf_w = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = ops.rms_norm_native(leaf_x, leaf_w, eps, *flags)
        ctx.save_for_backward(leaf_x, leaf_w, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        leaf_x, leaf_w, out = ctx.saved_tensors
        gx, gw = torch.autograd.grad(out, (leaf_x, leaf_w), grad)
        return gx * 1.01, gw, None, None, None, None, None, None


def test_a_backward_kernel_is_judged_on_its_gradients_when_the_model_trains():
    """A provider whose forward is right and whose backward is 1% off: refused for calls that need
    a gradient (the rewrite checks them when parameters require grad), kept for the others."""
    native = get_op("rms_norm").native.impl
    ops.register_provider(
        "rms_norm", "faulty", lambda *a: native(*a), autograd=lambda x, w, eps, *f: _WrongGradient.apply(x, w, eps, *f)
    )
    ops.set_priority(["faulty"], op="rms_norm")
    try:
        model = tiny_model("llama")
        transfuse.rewrite(model, fusions=["rms_norm"])
        verdicts = [v for v in transfuse.report(model).providers if v.provider == "faulty"]
        assert {(v.grad, v.passed) for v in verdicts} == {(False, True), (True, False)}
        assert "gradient" in next(v.reason for v in verdicts if v.grad)
        ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
        with ops.trace() as calls:
            model(ids, labels=ids).loss.backward()
        assert {c.provider for c in calls if c.op == "rms_norm" and c.grad} == {"native"}
    finally:
        ops.set_priority(None, op="rms_norm")
        ops.unregister_provider("rms_norm", "faulty")


def test_a_provider_whose_signature_is_not_the_ops_is_refused_at_registration():
    with pytest.raises(TypeError, match="give it the same parameters"):
        ops.register_provider("rms_norm", "odd", lambda x, weight: x)
    assert "odd" not in get_op("rms_norm").providers


# ---- the rewritten model: the shapes its probe never had -------------------------------------


def _generate(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip


MODEL_CASES = [
    ("rms_norm", "one row", "llama"),  # every decode step
    ("silu_and_mul", "one row", "llama"),
    ("fused_add_rms_norm", "one row", "llama"),
    ("rotary", "one position", "llama"),
    ("moe_experts", "tokens < 4 (a decode path)", "qwen3_moe"),
    ("rms_norm", "batch > 1", "llama"),
    ("silu_and_mul", "rows >= 65", "llama"),
]


@pytest.mark.parametrize("op,condition,model_type", MODEL_CASES, ids=[f"{o}-{c}" for o, c, _ in MODEL_CASES])
def test_a_rewritten_model_never_runs_a_kernel_where_it_is_wrong(op, condition, model_type):
    dtype = torch.bfloat16
    stock = tiny_model(model_type, dtype=dtype)
    model = tiny_model(model_type, dtype=dtype)
    model.load_state_dict(stock.state_dict())
    batch, length = (2, 8) if condition == "batch > 1" else (1, 100 if "65" in condition else 8)
    ids = torch.randint(0, stock.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(4))
    fault = Fault(op, condition, 0.01)
    with installed(fault):
        transfuse.rewrite(model)
        refused = [v for v in transfuse.report(model).providers if v.provider == "faulty" and not v.passed]
        assert refused, transfuse.report(model)
        with ops.trace() as calls:
            got = _generate(model, ids)
    assert not [c for c in calls if c.provider == "faulty"]
    want = _generate(stock, ids)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        assert torch.equal(g, w)  # on the CPU every fusion that runs is bit-identical to stock


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["fused_add_rms_norm", "rotary"])
def test_a_uniformly_wrong_small_op_is_caught_inside_a_big_module(op, dtype):
    """1% off everywhere, inside a decoder layer or an attention block whose own rounding hid it
    from the module's check: judged on its own, at the op."""
    stock = tiny_model("llama", dtype=dtype)
    model = tiny_model("llama", dtype=dtype)
    model.load_state_dict(stock.state_dict())
    with installed(Fault(op, "always", 0.01)):
        transfuse.rewrite(model)
        report = transfuse.report(model)
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
        with ops.trace() as calls, torch.no_grad():
            got = model(ids).logits
    assert [v for v in report.providers if v.provider == "faulty" and not v.passed]
    assert {"add_rms_norm" if op == "fused_add_rms_norm" else "rotary"} <= set(report.counts())  # fused, with native
    assert not [c for c in calls if c.provider == "faulty"]
    with torch.no_grad():
        assert torch.equal(got, stock(ids).logits)


# ---- non-finite values --------------------------------------------------------------------


def test_nan_in_a_weight_refuses_the_fusions_it_reaches():
    stock, model = tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():
        for m in (stock, model):
            m.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    model.load_state_dict(stock.state_dict())
    transfuse.rewrite(model)
    report = transfuse.report(model)
    non_finite = {(s.kind, s.path) for s in report.skipped if s.tag == "verify.non-finite"}
    assert ("gate_up", "model.layers.1.mlp") in non_finite
    assert not [f for f in report.fusions if f.path == "model.layers.1.mlp"]
    assert ("rms_norm", "model.norm") in non_finite  # its every input is NaN: nothing to compare
    assert [f for f in report.fusions if f.path.startswith("model.layers.0")]  # before the NaN: fused


def test_nan_where_the_original_has_none_fails_the_rule():
    from transfuse.ops.accuracy import judge_tensors

    original = torch.randn(4, 8)
    fused = original.clone()
    fused[1, 2] = float("nan")
    verdict = judge_tensors([fused], [original], [original.double()])
    assert not verdict.passed and verdict.tag == "verify.non-finite"
    all_nan = torch.full((4, 8), float("nan"))
    verdict = judge_tensors([all_nan], [all_nan], [all_nan.double()])
    assert not verdict.passed and verdict.tag == "verify.non-finite"  # no finite value: nothing proved


def test_a_provider_that_declines_a_form_is_not_warned_about(caplog):
    """``F.rms_norm`` (the "torch" provider) does not round as Llama's norm does (cast before the
    weight): its own argument check declines every class, which is no fault and no warning."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 48, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(48, generator=g)).to(torch.bfloat16)
    args = (x, weight, 1e-6, *ops.RMSNormSpec().flags())
    # A provider ahead of it that takes the call (an honest one) has every provider judged at once,
    # as the CUDA and Triton kernels have on a GPU.
    ops.register_provider("rms_norm", "honest", Fault("rms_norm", "rows >= 65", 0.0).provider(), differentiable=True)
    ops.set_priority(["honest", "torch"], op="rms_norm")
    try:
        with caplog.at_level("WARNING", logger="transfuse"):
            get_op("rms_norm")(*args)
            found = {v.provider: v for v in get_op("rms_norm").verdicts((False, get_op("rms_norm").sampler.key(args, {})))}
    finally:
        ops.set_priority(None, op="rms_norm")
        ops.unregister_provider("rms_norm", "honest")
    assert found["honest"].passed
    assert not found["torch"].passed and found["torch"].tag == conformance.DECLINED
    assert not [r for r in caplog.records if "torch" in r.getMessage()], caplog.text
