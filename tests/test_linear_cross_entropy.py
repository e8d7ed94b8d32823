"""Fused linear cross-entropy: the op against transformers' own loss, the opt-in fusion on real
model classes (loss and every gradient against the stock model), where it does not apply, and
its peak memory against the stock model's for a large vocabulary."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import transfuse
from transfuse.ops import causal_lm_loss, linear_cross_entropy
from transfuse.tiny import tiny_model

# The op's module (``transfuse.ops.linear_cross_entropy`` is the function, as for every op).
lce_module = importlib.import_module("transfuse.ops.linear_cross_entropy")
ALL_KINDS = transfuse.fusers.kinds()  # the opt-in loss with every default kind


class _Head(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias


def _loss_case(dtype=torch.float32, seed=0, vocab=101, hidden=24, batch=2, seq=29, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(batch, seq, hidden, generator=g)).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :6] = -100
    labels[1, -3:] = -100
    return h, weight, b, labels


def _grads(loss_fn, h, weight, bias, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (h, weight, bias)]
    loss = loss_fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves if t is not None]


def _stock(transform=None, **kwargs):
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss(h, weight, bias, labels):
        logits = torch.nn.functional.linear(h, weight, bias)
        logits = transform(logits) if transform is not None else logits
        return ForCausalLMLoss(logits, labels, weight.shape[0], **kwargs)

    return loss


def _fused(transform=None, **kwargs):
    def loss(h, weight, bias, labels):
        return causal_lm_loss(_Head(weight, bias), h, labels, weight.shape[0], transform=transform, **kwargs)

    return loss


TRANSFORMS = {"none": None, "softcap": lambda z: torch.tanh(z / 3.0) * 3.0, "scale": lambda z: z * 0.25}


@pytest.mark.parametrize("chunk_rows", [None, 7, (5, 3)], ids=["one-block", "blocks-of-7", "blocks-of-5-in-chunks-of-3"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("reduction", ["mean", "num_items_in_batch", "shift_labels"])
def test_loss_and_gradients_equal_transformers_loss_in_float32(monkeypatch, reduction, transform, chunk_rows):
    h, weight, bias, labels = _loss_case()
    kwargs = {}
    if reduction == "num_items_in_batch":
        kwargs["num_items_in_batch"] = torch.tensor(37)
    if reduction == "shift_labels":
        kwargs["shift_labels"] = torch.roll(labels, 3, dims=1)
    if chunk_rows is not None:
        block, chunk = chunk_rows if isinstance(chunk_rows, tuple) else (chunk_rows, chunk_rows)
        monkeypatch.setattr(lce_module, "_block_rows", lambda rows, vocab, size: block)
        monkeypatch.setattr(lce_module, "_chunk_rows", lambda rows, vocab: chunk)
    fn = TRANSFORMS[transform]
    want_loss, want = _grads(lambda *t: _stock(fn, **kwargs)(*t, labels), h, weight, bias, torch.float32)
    got_loss, got = _grads(lambda *t: _fused(fn, **kwargs)(*t, labels), h, weight, bias, torch.float32)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() <= 1e-5


@pytest.fixture
def triton_cross_entropy(triton_for):
    """The loss's kernels (under Triton's interpreter without a GPU) in place of the native definitions."""
    with triton_for("cross_entropy_grad", "scale_") as calls:
        yield calls


@pytest.mark.parametrize("reduction", ["mean", "num_items_in_batch"])
def test_the_triton_kernel_gives_transformers_loss_and_gradients(monkeypatch, triton_cross_entropy, reduction):
    monkeypatch.setattr(lce_module, "_block_rows", lambda rows, vocab, size: 16)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernel on CPU tensors
    h, weight, bias, labels = (t.to(device) for t in _loss_case(vocab=300))
    kwargs = {"num_items_in_batch": torch.tensor(41, device=device)} if reduction == "num_items_in_batch" else {}
    # Scaled, so that the backward's in-place scale of the saved gradients is not by 1.
    want_loss, want = _grads(lambda *t: 0.37 * _stock(**kwargs)(*t, labels), h, weight, bias, torch.float32)
    got_loss, got = _grads(lambda *t: 0.37 * _fused(**kwargs)(*t, labels), h, weight, bias, torch.float32)
    for op in ("cross_entropy_grad", "scale_"):
        assert {call.provider for call in triton_cross_entropy if call.op == op} == {"triton"}, op
    assert abs(got_loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_gradients_are_as_accurate_as_the_unfused_ones(monkeypatch, dtype):
    """Against a float64 run: the fused loss's gradients err no more than the unfused model's own
    (1.5x), in many chunks, and its loss agrees."""
    monkeypatch.setattr(lce_module, "_block_rows", lambda rows, vocab, size: 16)  # 8 blocks: 7 roundings
    monkeypatch.setattr(lce_module, "_chunk_rows", lambda rows, vocab: 8)
    h, weight, bias, labels = _loss_case(vocab=300, hidden=64, seq=61)
    loss = lambda fn: (lambda *t: fn(*t, labels))  # noqa: E731
    _, exact = _grads(loss(_stock()), h, weight, bias, torch.float64)
    want_loss, want = _grads(loss(_stock()), h, weight, bias, dtype)
    got_loss, got = _grads(loss(_fused()), h, weight, bias, dtype)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-3 * abs(want_loss.item())
    error = lambda g, e: ((g.double() - e).norm() / e.norm()).item()  # noqa: E731
    for g, w, e in zip(got, want, exact):
        assert error(g, e) <= 1.5 * error(w, e) + 1e-4, (error(g, e), error(w, e))


def test_every_label_ignored_gives_the_same_nan_as_transformers():
    h, weight, bias, labels = _loss_case()
    labels[:] = -100
    want = _stock()(h, weight, bias, labels)
    got = _fused()(h, weight, bias, labels)
    assert want.isnan() and got.isnan()


def test_bad_shapes_are_an_error():
    h, weight, bias, labels = _loss_case()
    with pytest.raises(ValueError, match="hidden states"):
        linear_cross_entropy(h, weight, labels.reshape(-1))
    with pytest.raises(ValueError, match="vocab_size"):
        causal_lm_loss(_Head(weight, bias), h, labels, weight.shape[0] + 1)


# ---- the fusion on model classes ------------------------------------------------------------------


def _grad_state(model):
    """Every parameter's gradient under its original state_dict name (merged ones split by part)."""
    params = list(model.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _step(model, ids, labels, **kwargs):
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "cohere", "granite", "qwen3_moe"])
def test_fused_loss_trains_like_the_stock_model(monkeypatch, model_type):
    monkeypatch.setattr(lce_module, "_block_rows", lambda rows, vocab, size: 9)  # many blocks
    monkeypatch.setattr(lce_module, "_chunk_rows", lambda rows, vocab: 5)  # in chunks
    stock, fused = tiny_model(model_type).train(), tiny_model(model_type).train()
    transfuse.rewrite(fused, fusions=ALL_KINDS)
    assert transfuse.report(fused).counts().get("linear_cross_entropy") == 1
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :7] = -100
    want = _step(stock, ids, labels, num_items_in_batch=torch.tensor(30))
    got = _step(fused, ids, labels, num_items_in_batch=torch.tensor(30))
    assert got.logits is None and want.logits is not None
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item())
    stock_grads, fused_grads = _grad_state(stock), _grad_state(fused)
    assert stock_grads.keys() == fused_grads.keys()
    for name, w in stock_grads.items():
        g = fused_grads[name]
        if w.is_floating_point() and w.norm() > 0:
            assert ((g - w).norm() / w.norm()).item() <= 1e-5, name


def test_without_labels_in_eval_and_in_generate_the_model_is_unchanged():
    stock, fused = tiny_model("llama"), tiny_model("llama")
    transfuse.rewrite(fused, fusions=ALL_KINDS)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids, labels=ids).logits, stock(input_ids=ids, labels=ids).logits)  # eval
        fused.train(), stock.train()
        assert torch.equal(fused(input_ids=ids).logits, stock(input_ids=ids).logits)  # training, no labels
        fused.eval(), stock.eval()
    generated = fused.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, stock.generate(ids, max_new_tokens=6, do_sample=False))


def test_the_default_rewrite_says_where_it_would_apply():
    model = tiny_model("llama")
    transfuse.rewrite(model)
    report = transfuse.report(model)
    assert "linear_cross_entropy" not in report.counts()
    assert any("linear_cross_entropy is available for LlamaForCausalLM" in note for note in report.notes)


def test_a_custom_loss_function_is_refused():
    model = tiny_model("llama")
    model._loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    transfuse.rewrite(model, fusions=ALL_KINDS)
    report = transfuse.report(model)
    assert [s.tag for s in report.skipped if s.kind == "linear_cross_entropy"] == ["linear_cross_entropy.loss-function"]


def test_emitted_files_carry_the_fused_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("gemma2")
    transfuse.rewrite(model, fusions=ALL_KINDS)
    out = tmp_path / "emitted"
    from transfuse.rewriter.emit import emit

    emit(model, str(out))
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).train()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    result = loaded(input_ids=ids, labels=ids)
    assert result.logits is None
    model.train()
    assert abs(result.loss.item() - model(input_ids=ids, labels=ids).loss.item()) <= 1e-6


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch, transfuse
    from transfuse.tiny import tiny_model

    def kib(field):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    torch.manual_seed(0)
    model = tiny_model("llama", vocab_size=131072, hidden_size=64, num_hidden_layers=1).train()
    if sys.argv[1] == "fused":
        transfuse.rewrite(model, fusions=["linear_cross_entropy"])
    ids = torch.randint(0, 131072, (1, 2048))
    # The peak from here on: the process's peak so far (building the model, the rewrite's checks)
    # is reset where Linux lets it be, else it would hide part of the step's own peak.
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before, peak = kib("VmRSS"), lambda: kib("VmHWM")
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model(input_ids=ids, labels=ids).loss.backward()
    print(json.dumps({"peak_growth_mib": (peak() - before) / 1024}))
    """
)


@pytest.mark.slow
def test_peak_memory_is_far_below_the_stock_models_for_a_large_vocabulary():
    """[2048, 131072] logits, 1 GiB in float32: the stock model's loss holds the logits, their
    float32 copy, the log-softmax and the gradients; the fused loss only the logits' gradient (in
    the logits' dtype, here float32) and one chunk's worth of the rest."""
    growth = {}
    for variant in ("stock", "fused"):
        result = subprocess.run(
            [sys.executable, "-c", _MEMORY_SCRIPT, variant], capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-2000:]
        growth[variant] = json.loads(result.stdout.strip().splitlines()[-1])["peak_growth_mib"]
    assert growth["stock"] > 2048 and growth["fused"] < growth["stock"] / 2, growth


def test_a_wrong_fused_loss_is_caught_by_the_training_check(monkeypatch):
    """The fusion changes training mode only: the rewrite compares the loss in training mode with and
    without it (every other fusion in place), and undoes it when they differ."""
    right = lce_module.linear_cross_entropy
    monkeypatch.setattr(lce_module, "linear_cross_entropy", lambda *a, **k: right(*a, **k) * 1.01)
    model = tiny_model("llama")
    transfuse.rewrite(model, fusions=ALL_KINDS)
    report = transfuse.report(model)
    assert "linear_cross_entropy" not in report.counts() and report.counts().get("qkv") == 2
    refused = [s for s in report.skipped if s.kind == "linear_cross_entropy"]
    assert [s.tag for s in refused] == ["verify.mismatch"] and "training mode" in refused[0].reason


def test_under_torch_compile_the_loss_is_one_op_with_the_same_numbers():
    import torch._dynamo

    h, weight, bias, labels = _loss_case()
    want_loss, want = _grads(lambda *t: _stock()(*t, labels), h, weight, bias, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: _fused()(*t, labels), fullgraph=True)  # fullgraph: a break is an error
    got_loss, got = _grads(compiled, h, weight, bias, torch.float32)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() <= 1e-5


def test_under_autocast_the_loss_and_gradients_are_the_unfused_models():
    """A float32 model trained under bf16 autocast (Trainer's bf16=True): the head's matmul in bf16
    as autocast runs it, every gradient back in its parameter's dtype."""
    h, weight, bias, labels = _loss_case(vocab=300)
    results = []
    for fn in (_stock(), _fused()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_grads(lambda *t: fn(*t, labels), h, weight, bias, torch.float32))
    (want_loss, want), (got_loss, got) = results
    assert abs(got_loss.item() - want_loss.item()) <= 1e-3 * abs(want_loss.item())
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        assert ((g - w).norm() / w.norm()).item() <= 1e-2


def test_a_second_backward_through_the_fused_loss_is_an_error_not_a_doubled_gradient():
    h, weight, bias, labels = _loss_case()
    h, weight = h.requires_grad_(), weight.requires_grad_()
    loss = _fused()(h, weight, None, labels) * 0.5  # a scale, as gradient accumulation gives
    loss.backward(retain_graph=True)
    once = weight.grad.clone()
    want = torch.autograd.grad(_stock()(h, weight, None, labels) * 0.5, weight)[0]
    assert ((once - want).norm() / want.norm()).item() <= 1e-5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
