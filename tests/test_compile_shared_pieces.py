"""Pieces of a compiled graph that compute the same function share one Inductor output
(``transfuse/compile/backend.py``: ``piece_signature``)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import transfuse
from transfuse.compile import backend
from transfuse.tiny import tiny_model


def _generate(model, ids, mask, new=4):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def _batch():
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _compiled_counts(model) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    ids, mask = _batch()
    want = _generate(model, ids, mask)
    before = backend.stats()
    transfuse.compile(model, cache_dir=False)
    got = _generate(model, ids, mask)
    after = backend.stats()
    return want, got, {k: after[k] - before[k] for k in ("graphs", "inductor_pieces", "shared_pieces")}


@pytest.mark.slow
def test_the_layers_between_two_attentions_share_one_compiled_piece():
    """Five layers: per graph, the piece before the first attention, one piece for the four alike
    between two attentions, and the piece after the last: 3 compiled, 3 shared."""
    torch.manual_seed(0)
    model = transfuse.rewrite(tiny_model("llama", num_hidden_layers=5).eval())
    want, got, counts = _compiled_counts(model)
    assert torch.equal(got, want)
    assert counts == {"graphs": 2, "inductor_pieces": 6, "shared_pieces": 6}


@pytest.mark.slow
def test_layers_of_another_kind_get_their_own_piece():
    """Qwen3-MoE with layer 1 a dense MLP among sparse ones: the pieces after layers 0 and 2 (the
    experts, then a norm and projections) are alike; the one after layer 1 (a dense MLP) is not."""
    torch.manual_seed(0)
    model = transfuse.rewrite(tiny_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1]).eval())
    assert [type(layer.mlp).__name__ for layer in model.model.layers].count("Qwen3MoeMLP") == 1
    want, got, counts = _compiled_counts(model)
    assert torch.equal(got, want)
    assert counts == {"graphs": 2, "inductor_pieces": 8, "shared_pieces": 2}


def _piece(width: int, offset: bool = False) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    class Piece(nn.Module):
        def forward(self, x, weight):
            return torch.nn.functional.linear(x, weight).relu() + (1 if offset else 0)

    return fx.symbolic_trace(Piece()), [torch.randn(3, width), torch.randn(5, width)]


def test_a_signature_tells_graphs_inputs_and_storage_apart():
    a, inputs = _piece(4)
    b, _ = _piece(4)
    assert backend.piece_signature(a, inputs) == backend.piece_signature(b, [torch.randn(3, 4), torch.randn(5, 4)])
    assert backend.piece_signature(a, inputs) != backend.piece_signature(a, [torch.randn(3, 8), torch.randn(5, 8)])
    assert backend.piece_signature(a, inputs) != backend.piece_signature(_piece(4, offset=True)[0], inputs)
    assert backend.piece_signature(a, inputs) != backend.piece_signature(a, [inputs[0].t().contiguous().t(), inputs[1]])
    assert backend.piece_signature(a, inputs) != backend.piece_signature(a, [inputs[0], inputs[1].double()])
    shared = torch.randn(8, 4)
    assert backend.piece_signature(a, [shared[:3], shared[3:]]) != backend.piece_signature(a, [torch.randn(3, 4), torch.randn(5, 4)])


def test_a_piece_holding_its_own_objects_has_no_signature():
    class Held(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 4))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    assert backend.piece_signature(fx.symbolic_trace(Held()), [torch.randn(3, 4)]) is None

    class Odd(nn.Module):
        def forward(self, x):
            return torch.ops.aten.mul.Tensor(x, 2) + torch.tensor(1.0)  # a constant tensor: an attribute

    assert backend.piece_signature(fx.symbolic_trace(Odd()), [torch.randn(3, 4)]) is None
