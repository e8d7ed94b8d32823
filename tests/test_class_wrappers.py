"""What a class does to its forward (a wrapper added when the class is made, a decorator, the subclass
FSDP2's ``fully_shard`` makes) wraps the rewritten forward as it wrapped the original. Counted, not
inferred from gradients (which match whether or not a layer is checkpointed): the checkpoint function
called once per layer as in stock, and the bytes kept for the backward as stock's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

import transfuse
from transfuse.tiny import tiny_model

from . import toys


def _counting_checkpoints(model) -> dict[str, int]:
    """Calls of each layer's checkpoint function, by layer path (filled as the model runs)."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
        if checkpoint is None:
            continue

        def counted(*args, _checkpoint=checkpoint, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _checkpoint(*args, **kwargs)

        module._gradient_checkpointing_func = counted
    return counts


def _step_saving(model, checkpointing: bool | None) -> tuple[dict[str, int], int]:
    """One training step; the checkpoint calls per layer and the bytes saved for the backward.
    ``checkpointing``: use_reentrant, or None for no checkpointing."""
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    counts = _counting_checkpoints(model)
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return counts, saved[0]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def stock_and_rewritten(request):
    """A tiny model of the family and a rewritten copy of it (same weights)."""
    stock = tiny_model(request.param)
    fused = copy.deepcopy(stock)
    transfuse.rewrite(fused)
    assert transfuse.report(fused).counts()
    return stock, fused


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_checkpoints_each_rewritten_layer_once_and_saves_as_stock(
    stock_and_rewritten, use_reentrant
):
    stock, fused = (copy.deepcopy(m) for m in stock_and_rewritten)
    _, unchecked = _step_saving(copy.deepcopy(stock), None)
    want, stock_bytes = _step_saving(stock, use_reentrant)
    got, fused_bytes = _step_saving(fused, use_reentrant)
    layers = [name for name, m in stock.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 2 and want == {name: 1 for name in layers}, want
    assert got == want  # each layer once: not skipped, not checkpointed twice
    assert stock_bytes <= unchecked / 2, (stock_bytes, unchecked)  # a model where checkpointing shows
    assert abs(fused_bytes - stock_bytes) <= 0.05 * stock_bytes, (fused_bytes, stock_bytes)


def test_a_copy_of_a_rewritten_model_checkpoints_its_layers(stock_and_rewritten):
    clone = copy.deepcopy(stock_and_rewritten[1])
    got, _ = _step_saving(clone, False)
    assert got == {"model.layers.0": 1, "model.layers.1": 1}


def test_fsdp2_subclass_made_after_the_rewrite_checkpoints_once(stock_and_rewritten):
    """FSDP2's ``fully_shard`` gives each layer a subclass, which transformers' checkpointing layer wraps
    again (only the outermost wrapper checkpoints): the rewritten layer follows its new class."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counts = {}
        for name, model in zip(("stock", "fused"), stock_and_rewritten):
            model = copy.deepcopy(model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            mesh = init_device_mesh("cpu", (1,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            assert type(model.model.layers[0]).__name__.startswith("FSDP")
            counts[name] = _step_saving(model, None)[0]
    finally:
        dist.destroy_process_group()
    assert counts["fused"] == counts["stock"] == {"model.layers.0": 1, "model.layers.1": 1}


# ---- the same rule on toys: a wrapper added when the class is made ---------------------------------


class RecordsCallsAtClassCreation(nn.Module):
    """Wraps each subclass's forward when the class is made (as transformers' checkpointing layer
    does), and records each call by the class it was made for."""

    calls: list = []

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        @functools.wraps(forward)
        def recorded(self, *args, **kwargs):
            RecordsCallsAtClassCreation.calls.append(cls.__name__)
            return forward(self, *args, **kwargs)

        cls.forward = recorded


class _QKV(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)


class ClassWrappedAttention(RecordsCallsAtClassCreation, _QKV):
    """q, k, v under a decorator and a wrapper added at class creation → fuses, both wrappers kept."""

    @toys._renamed_kwarg("scale_by", "scale")
    def forward(self, x, scale=1.0):
        return toys._attend(self.q(x), self.k(x), self.v(x), 4) * scale


class HoldsForwardInADefault(nn.Module):
    """Wraps each subclass's forward with the original held in a default argument, not a closure."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)

        def wrapped(self, *args, _inner=cls.forward, **kwargs):
            return _inner(self, *args, **kwargs)

        cls.forward = functools.update_wrapper(wrapped, cls.forward)


class DefaultWrappedAttention(HoldsForwardInADefault, _QKV):
    """A class wrapper that cannot be put around another function → refused (source.class-wrapper)."""

    def forward(self, x, scale=1.0):
        return toys._attend(self.q(x), self.k(x), self.v(x), 4) * scale


def test_a_wrapper_added_at_class_creation_wraps_the_rewritten_forward_once_per_call():
    model = toys.Wrapper(ClassWrappedAttention())
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        expected = model.inner(x, scale=3.0)
    transfuse.rewrite(model, example_inputs=(x,))
    assert transfuse.report(model).counts() == {"qkv": 1}
    RecordsCallsAtClassCreation.calls.clear()
    with torch.no_grad():
        got = model.inner(x, scale_by=3.0)
    assert RecordsCallsAtClassCreation.calls == ["ClassWrappedAttention"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_class_wrapper_that_cannot_wrap_the_rewrite_refuses_the_fusion():
    model = toys.Wrapper(DefaultWrappedAttention())
    x = torch.randn(2, 6, 32)
    transfuse.rewrite(model, example_inputs=(x,))
    report = transfuse.report(model)
    assert report.counts() == {}
    assert [(s.kind, s.tag) for s in report.skipped] == [("qkv", "source.class-wrapper")]
    assert "DefaultWrappedAttention" in report.skipped[0].reason and "wrapped" in report.skipped[0].reason
