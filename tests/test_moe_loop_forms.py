"""MoE blocks in the loop forms of older modeling files: a loop over every expert index (``range``,
``enumerate``), which tracing unrolls into one ``index_add_`` per expert, with the mask sliced per
expert or ``torch.where(ids == e)`` and an optional skip of experts no token chose (→ fuses); tokens
repeated ``top_k`` times and written back by mask (→ refused, moe.repeated-tokens); near misses of
the unrolled form (→ refused, each with its tag); rows of every (token, expert) pair sorted by expert,
computed by split [E, out, in] weights and added back by one ``index_add`` (→ fuses); experts handed their rows' routing weights and
multiplying them onto their output as their last operation, rows indexed by ``.tolist()`` lists
(→ fuses), or multiplying them anywhere else (→ refused, moe.combine); one module handed each expert's
slices of parameters holding every expert's block (→ fuses; other slices → refused, moe.expert-arguments,
or too few iterations → moe.unrolled-loop); a 1-D tensor of the block
added to its output after the combine (→ fuses; two of them → refused, moe.output); experts a module
uses through methods other than its forward, which only raises, with attention between their two
projections (→ refused, moe.forward-raises)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from tests import toys
from tests.test_moe import _rewrite_toy
from transfuse.ops import MoE


class WhereEqualsMoE(toys.ModuleListMoE):
    """``rows, slot = torch.where(ids == e)`` for every expert, skipping the empty ones → fuses."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(idx == e)
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return out.view(b, s, h)


class EnumeratedMoE(toys.ModuleListMoE):
    """``for e, expert in enumerate(self.experts)``, no skip → fuses."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, expert(x[rows]) * w[rows, slot, None])
        return out.view(b, s, h)


class WeightedGLUExpert(toys.GLUExpert):
    """An expert handed its rows' routing weights, multiplied onto its output as its last operation."""

    def forward(self, hidden_states, routing_weights):
        current = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        current = self.w2(current)
        return routing_weights * current


class InnerWeightedGLUExpert(toys.GLUExpert):
    """Multiplies the routing weights onto the gated product, before the down projection."""

    def forward(self, hidden_states, routing_weights):
        return self.w2(routing_weights * self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class TwiceWeightedGLUExpert(toys.GLUExpert):
    """Reads the routing weights twice: on its input and on its output."""

    def forward(self, hidden_states, routing_weights):
        hidden_states = hidden_states * routing_weights
        return routing_weights * self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class ExpertWeightsInsideMoE(toys.ModuleListMoE):
    """The older Mixtral form: a loop over every expert index, rows and weights indexed by ``.tolist()``
    lists, each expert handed its rows' routing weights (``expert(rows, w[t, s, None])``) → fuses."""

    expert_cls = WeightedGLUExpert

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([self.expert_cls(32, 16) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            top_x_list, idx_list = top_x.tolist(), idx.tolist()
            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            current = expert_layer(current_state, routing_weights[top_x_list, idx_list, None])
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class HitExpertsWeightsInsideMoE(ExpertWeightsInsideMoE):
    """The loop over the experts that received tokens, each expert handed its rows' weights → fuses."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = self.gate(x)
        w, ids = torch.topk(F.softmax(logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token], w[token, slot, None]))
        return out.view(b, s, h), logits


class InnerWeightedMoE(ExpertWeightsInsideMoE):
    expert_cls = InnerWeightedGLUExpert


class TwiceWeightedMoE(ExpertWeightsInsideMoE):
    expert_cls = TwiceWeightedGLUExpert


class RepeatedTokensMoE(toys.ModuleListMoE):
    """Tokens repeated ``top_k`` times, each expert's rows written by mask, weighted copies summed
    (the older DeepSeek/Mixtral training form) → refused (moe.repeated-tokens)."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        topk_weight, topk_idx = torch.topk(self.gate(x).softmax(dim=-1), k=self.top_k, dim=-1, sorted=False)
        x = x.repeat_interleave(self.top_k, dim=0)
        flat_topk_idx = topk_idx.view(-1)
        y = torch.empty_like(x)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(x[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        return y.view(b, s, h)


class SkipsBusyExpertsMoE(WhereEqualsMoE):
    """Skips experts that received more than one row: not an empty expert → refused (moe.loop-form)."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(idx == e)
            if rows.numel() > 1:
                continue
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return out.view(b, s, h)


class MissesLastExpertMoE(WhereEqualsMoE):
    """The loop stops one expert short → refused (moe.unrolled-loop): the block has one more expert."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts - 1):
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return out.view(b, s, h)


class ShiftedExpertMoE(WhereEqualsMoE):
    """Iteration ``e`` applies expert ``e`` to the rows routed to ``(e + 1) % E`` → refused (moe.unrolled-loop)."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(idx == (e + 1) % len(self.experts))
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return out.view(b, s, h)


class SlicedGLU(nn.Module):
    """One GLU module holding every expert's weights as 2-D parameters ``[E * I, H]``; the weights of
    the expert to apply are passed to its forward."""

    def __init__(self, hidden, inter, experts):
        super().__init__()
        self.hidden, self.inter, self.num_experts = hidden, inter, experts
        self.w1 = nn.Parameter(torch.randn(experts * inter, hidden) / hidden**0.5)
        self.v1 = nn.Parameter(torch.randn(experts * inter, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts * inter, hidden) / inter**0.5)

    def forward(self, x, w1, v1, w2):
        return (F.silu(x.matmul(w1.t())) * x.matmul(v1.t())).matmul(w2)


class SlicedExperts(nn.Module):
    """Loops over every expert index, slicing the per-expert weights out of 2-D parameters and passing
    them to one shared GLU module."""

    def __init__(self, hidden, inter, experts):
        super().__init__()
        self.num_experts = experts
        self.mlp = SlicedGLU(hidden, inter, experts)

    def forward(self, x, top_weights, top_experts):
        b, s, h = x.shape
        x = x.view(-1, h)
        out = torch.zeros_like(x)
        mask = F.one_hot(top_experts, num_classes=self.num_experts).permute(2, 1, 0)
        shape = (self.num_experts, self.mlp.inter, self.mlp.hidden)
        w1 = [w.squeeze(dim=0) for w in self.mlp.w1.view(shape).chunk(self.num_experts, dim=0)]
        v1 = [w.squeeze(dim=0) for w in self.mlp.v1.view(shape).chunk(self.num_experts, dim=0)]
        w2 = [w.squeeze(dim=0) for w in self.mlp.w2.view(shape).chunk(self.num_experts, dim=0)]
        for e in range(self.num_experts):
            slot, token = torch.where(mask[e])
            if token.shape[0] == 0:
                continue
            rows = x[None, token].reshape(-1, h)
            out.index_add_(0, token, self.mlp(rows, w1[e], v1[e], w2[e]) * top_weights[token, slot, None])
        return out.reshape(b, s, h)


class SlicedRouter(nn.Module):
    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.layer = nn.Linear(hidden, experts, bias=False)

    def forward(self, x):
        weights = self.layer(x.view(-1, x.shape[-1])).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(weights, self.top_k, dim=-1)
        top_weights = top_weights / torch.norm(top_weights, p=1, dim=-1, keepdim=True)
        return weights.to(x.dtype), top_weights.to(x.dtype), top_experts


class SlicedWeightsMoE(nn.Module):
    """A router child and an experts child that passes each expert's slices of 2-D parameters to one GLU
    module (the experts are neither a module list nor 3-D tensors) → fuses (the slices stacked)."""

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2):
        super().__init__()
        self.router = SlicedRouter(hidden, experts, top_k)
        self.experts = SlicedExperts(hidden, inter, experts)

    def forward(self, x):
        weights, top_weights, top_experts = self.router(x)
        return self.experts(x, top_weights, top_experts), weights


class ChildViewSlicedExperts(SlicedExperts):
    """The weights viewed ``[E, I, H]`` with the GLU module's own sizes (Python computes the views outside
    the traced graph), chunked by the experts' count and squeezed."""

    def forward(self, x, top_weights, top_experts):
        b, s, h = x.shape
        x = x.view(-1, h)
        out = torch.zeros_like(x)
        mask = F.one_hot(top_experts, num_classes=self.num_experts).permute(2, 1, 0)
        mlp = self.mlp
        w1, v1, w2 = (
            [p.squeeze(dim=0) for p in w.view(mlp.num_experts, mlp.inter, mlp.hidden).chunk(self.num_experts, dim=0)]
            for w in (mlp.w1, mlp.v1, mlp.w2)
        )
        for e in range(self.num_experts):
            slot, token = torch.where(mask[e])
            if token.shape[0] == 0:
                continue
            rows = x[None, token].reshape(-1, h)
            out.index_add_(0, token, mlp(rows, w1[e], v1[e], w2[e]) * top_weights[token, slot, None])
        return out.reshape(b, s, h)


class ChildViewSlicedWeightsMoE(SlicedWeightsMoE):
    """→ fuses, as ``SlicedWeightsMoE``."""

    def __init__(self):
        super().__init__()
        self.experts = ChildViewSlicedExperts(32, 16, 4)


class ShortSlicesExperts(SlicedExperts):
    """The loop over the slices stops one expert short of the blocks the parameters hold."""

    def forward(self, x, top_weights, top_experts):
        b, s, h = x.shape
        x = x.view(-1, h)
        out = torch.zeros_like(x)
        mask = F.one_hot(top_experts, num_classes=self.num_experts).permute(2, 1, 0)
        shape = (self.num_experts, self.mlp.inter, self.mlp.hidden)
        w1, v1, w2 = (w.view(shape).unbind(0) for w in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
        for e in range(self.num_experts - 1):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.mlp(x[token], w1[e], v1[e], w2[e]) * top_weights[token, slot, None])
        return out.reshape(b, s, h)


class ShortSlicesMoE(SlicedWeightsMoE):
    """→ refused (moe.unrolled-loop)."""

    def __init__(self):
        super().__init__()
        self.experts = ShortSlicesExperts(32, 16, 4)


class ShiftedSlicesExperts(SlicedExperts):
    """Iteration e hands the GLU module expert e + 1's slices: not the routed mixture."""

    def forward(self, x, top_weights, top_experts):
        b, s, h = x.shape
        x = x.view(-1, h)
        out = torch.zeros_like(x)
        mask = F.one_hot(top_experts, num_classes=self.num_experts).permute(2, 1, 0)
        shape = (self.num_experts, self.mlp.inter, self.mlp.hidden)
        w1, v1, w2 = (w.view(shape).unbind(0) for w in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
        for e in range(self.num_experts):
            slot, token = torch.where(mask[e])
            n = (e + 1) % self.num_experts
            out.index_add_(0, token, self.mlp(x[token], w1[n], v1[n], w2[n]) * top_weights[token, slot, None])
        return out.reshape(b, s, h)


class ShiftedSlicesMoE(SlicedWeightsMoE):
    """→ refused (moe.expert-arguments), the reason naming the sliced parameters; counted by the census."""

    def __init__(self):
        super().__init__()
        self.experts = ShiftedSlicesExperts(32, 16, 4)


class SplitExperts(nn.Module):
    """``[E, out, in]`` weights applied to the rows of each expert, the rows sorted by expert and split by sizes."""

    def __init__(self, experts, inp, out):
        super().__init__()
        self.num_experts = experts
        self.weight = nn.Parameter(torch.randn(experts, out, inp) / inp**0.5)

    def forward(self, rows, sizes):
        parts = rows.split(sizes, dim=0)
        return torch.cat([F.linear(parts[e], self.weight[e]) for e in range(self.num_experts)], dim=0)


class SortedRowsMoE(nn.Module):
    """(token, expert) rows sorted by expert, computed in one pass by split experts, weighted by a flat gate
    per row and added back with one ``index_add`` → fuses (the routed mixture as a grouped product)."""

    descending = False

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.input_linear = SplitExperts(experts, hidden, 2 * inter)
        self.output_linear = SplitExperts(experts, inter, hidden)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        logits, ids = self.gate(x).topk(self.top_k, dim=1)
        gates = torch.softmax(logits, dim=1).flatten()
        sizes = torch.zeros(x.shape[0], self.num_experts).scatter(1, ids, 1).long().sum(0).tolist()
        _, order = ids.flatten().sort(0, descending=self.descending)
        token = order.div(self.top_k, rounding_mode="trunc")
        gate, up = self.input_linear(x[token], sizes).chunk(2, dim=-1)
        out = self.output_linear(F.silu(gate) * up, sizes) * gates[order][:, None]
        return torch.zeros_like(x).index_add(0, token, out).view(b, s, h)


class DescendingRowsMoE(SortedRowsMoE):
    """Rows sorted by expert in descending order but split by the sizes in ascending order (not the
    mixture) → refused (moe.sorted-rows)."""

    descending = True


class TopKGating(nn.Module):
    """A router child returning the sorted positions, tokens, gates and per-expert sizes."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.layer = nn.Linear(hidden, experts, bias=False)

    def forward(self, hidden_states):
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype)
        expert_size = zeros.scatter(1, top_k_indices, 1).long().sum(0).tolist()
        _, index_sorted_experts = top_k_indices.flatten().sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits


class RoutedSortedRowsMoE(nn.Module):
    """The sorted-rows block with its routing and sorting in a router child and an activation child → fuses."""

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2):
        super().__init__()
        self.input_size = hidden
        self.activation = nn.SiLU()
        self.input_linear = SplitExperts(experts, hidden, 2 * inter)
        self.output_linear = SplitExperts(experts, inter, hidden)
        self.router = TopKGating(hidden, experts, top_k)

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)
        hidden_states = self.input_linear(layer_input[batch_index], expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        expert_outputs = self.output_linear(self.activation(chunked[0]) * chunked[1], expert_size)
        expert_outputs = expert_outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, self.input_size), dtype=expert_outputs.dtype)
        layer_output = zeros.index_add(0, batch_index, expert_outputs)
        return layer_output.view(bsz, length, self.input_size), router_logits


class BiasedSortedRowsMoE(RoutedSortedRowsMoE):
    """The routed sorted-rows block plus a bias of its own, added after the combine → fuses (the bias
    added by the fused layer)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(self.input_size))

    def forward(self, layer_input):
        layer_output, router_logits = super().forward(layer_input)
        return layer_output + self.bias, router_logits


class BiasedWhereEqualsMoE(WhereEqualsMoE):
    """The module-list loop plus a bias of the block added to its output → fuses."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(32))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return self.bias + out.view(b, s, h)


class TwoBiasesMoE(BiasedWhereEqualsMoE):
    """Two vectors of the block added to the output → refused (moe.output)."""

    def __init__(self):
        super().__init__()
        self.bias_2 = nn.Parameter(torch.randn(32))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        return self.bias + out.view(b, s, h) + self.bias_2


class RoutedHeads(nn.Module):
    """A mixture of attention heads: each token's chosen experts project it to a query (``map``) and
    project the attention outputs of those queries back, weighted and summed (``reduce``); its forward
    only raises."""

    def __init__(self, hidden=32, head=16, experts=4, top_k=2):
        super().__init__()
        self.top_k, self.head = top_k, head
        self.bias = nn.Parameter(torch.randn(hidden))
        self.input_linear = SplitExperts(experts, hidden, head)
        self.output_linear = SplitExperts(experts, head, hidden)
        self.router = TopKGating(hidden, experts, top_k)

    def map(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        order, token, gates, sizes, _ = self.router(x)
        queries = self.input_linear(x[token], sizes)
        queries = torch.zeros(b * s * self.top_k, self.head).index_add(0, order, queries)
        return queries.view(b, s, self.top_k, self.head), (order, token, gates, sizes)

    def reduce(self, attended, topology):
        b, s, _, d = attended.shape
        order, token, gates, sizes = topology
        out = self.output_linear(attended.reshape(-1, d)[order], sizes) * gates[:, None]
        return torch.zeros(b * s, self.bias.shape[0]).index_add(0, token, out).view(b, s, -1) + self.bias

    def forward(self, x):
        raise NotImplementedError("map() and reduce() are this module's entry points.")


class MixtureOfAttention(nn.Module):
    """Attention whose query and output projections are routed experts (``RoutedHeads``), called
    through their ``map`` and ``reduce`` → refused (moe.forward-raises): attention over the sequence
    runs between the experts' two projections."""

    def __init__(self, hidden=32, head=16):
        super().__init__()
        self.experts = RoutedHeads(hidden, head)
        self.kv = nn.Linear(hidden, 2 * head)

    def forward(self, x):
        queries, topology = self.experts.map(x)
        k, v = self.kv(x).chunk(2, dim=-1)
        attended = F.scaled_dot_product_attention(queries.transpose(1, 2), k[:, None], v[:, None], is_causal=True)
        return self.experts.reduce(attended.transpose(1, 2), topology)


def test_experts_used_through_methods_around_attention_are_refused_and_counted():
    from transfuse import census

    block = MixtureOfAttention()
    model, x, (before, _) = _rewrite_toy(block)
    assert model.block is block and model.block.experts.__class__ is RoutedHeads
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "moe"]
    assert skip.tag == "moe.forward-raises" and "through map(), reduce()" in skip.reason, skip
    found = [o for o in census.count(model) if o.kind == "moe"]
    assert {o.parent_cls for o in found} == {"RoutedHeads"}, found
    assert census.unaccounted(found, transfuse.report(model)) == []
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_rows_sorted_in_another_order_than_their_sizes_are_refused():
    block = DescendingRowsMoE()
    model, x, (before, _) = _rewrite_toy(block)
    assert model.block is block
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "moe"]
    assert skip.tag == "moe.sorted-rows" and "ascending" in skip.reason, skip
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_experts_given_other_experts_slices_are_refused_and_counted():
    from transfuse import census

    block = ShiftedSlicesMoE()
    model, x, (before, _) = _rewrite_toy(block)
    assert model.block is block
    found = [o for o in census.count(model) if o.kind == "moe"]
    assert [(o.path, o.parent_cls) for o in found] == [("block.experts", "ShiftedSlicesMoE")]
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "moe"]
    assert skip.tag == "moe.expert-arguments" and "3 more tensors" in skip.reason, skip
    # The reason names the parameters each expert's weights are sliced from, as the loop views them.
    assert "slices of mlp.w1 (64, 32) as (4, 16, 32), mlp.v1 (64, 32) as (4, 16, 32), mlp.w2" in skip.reason, skip
    assert "expert-arguments" not in str(census.unaccounted(found, transfuse.report(model)))
    assert census.unaccounted(found, transfuse.report(model)) == []
    with torch.no_grad():
        assert torch.equal(model(x), before)


@pytest.mark.parametrize(
    "cls",
    [
        toys.RangeLoopMoE, WhereEqualsMoE, EnumeratedMoE, ExpertWeightsInsideMoE, HitExpertsWeightsInsideMoE,
        SortedRowsMoE, RoutedSortedRowsMoE, BiasedSortedRowsMoE, BiasedWhereEqualsMoE, SlicedWeightsMoE,
        ChildViewSlicedWeightsMoE,
    ],
    ids=lambda c: c.__name__,
)
def test_loops_over_every_expert_index_fuse_with_the_originals_numbers(cls):
    block = cls()
    original = copy.deepcopy(block)
    model, x, (before, _) = _rewrite_toy(block)
    assert isinstance(model.block, MoE), transfuse.report(model)
    assert transfuse.report(model).counts() == {"moe": 1}
    # The fused layer sums each token's experts in its own order: judged by a tolerance, not bits.
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)
    torch.manual_seed(0)  # the seed _rewrite_toy built the projections around the block with
    plain = toys.TinyMoEModel(original)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(x1).square().sum().backward()
    plain(x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    # The router's gradient: the routing weights' path.
    router = "router.layer.weight" if hasattr(original, "router") else "gate.weight"
    fused, unfused = model.block.get_parameter(router).grad, plain.block.get_parameter(router).grad
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
    assert unfused.abs().sum() > 0


@pytest.mark.parametrize(
    "cls, tag",
    [
        (RepeatedTokensMoE, "moe.repeated-tokens"),
        (SkipsBusyExpertsMoE, "moe.loop-form"),
        (MissesLastExpertMoE, "moe.unrolled-loop"),
        (ShiftedExpertMoE, "moe.unrolled-loop"),
        (InnerWeightedMoE, "moe.combine"),
        (TwiceWeightedMoE, "moe.combine"),
        (TwoBiasesMoE, "moe.output"),
        (ShortSlicesMoE, "moe.unrolled-loop"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_loop_forms_not_followed_are_refused_with_a_reason(cls, tag):
    block = cls()
    model, x, (before, _) = _rewrite_toy(block)
    assert model.block is block
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "moe"]
    assert skip.tag == tag and skip.reason.endswith("."), skip
    with torch.no_grad():
        assert torch.equal(model(x), before)


@pytest.mark.parametrize("cls", [BiasedSortedRowsMoE, BiasedWhereEqualsMoE], ids=lambda c: c.__name__)
def test_a_bias_added_after_the_combine_is_the_layers_and_trains(cls):
    block = cls()
    original = copy.deepcopy(block)
    model, x, _ = _rewrite_toy(block)
    assert model.block.plan.bias == "bias" and model.block.bias is block.bias
    assert "bias" in model.block.state_dict()
    torch.manual_seed(0)
    plain = toys.TinyMoEModel(original)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(model.block.bias.grad, plain.block.bias.grad, rtol=1e-5, atol=1e-6)
    assert plain.block.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("cls", [SlicedWeightsMoE, ChildViewSlicedWeightsMoE], ids=lambda c: c.__name__)
def test_stacked_slices_keep_the_parameters_keys_and_layout(cls):
    """The stacked gate/up and down tensors save and load under the sliced parameters' own keys and
    shapes: a state dict of the unfused block loads into the fused one, and the two compute alike."""
    block = cls()
    original = copy.deepcopy(block)
    model, x, _ = _rewrite_toy(block)
    assert isinstance(model.block, MoE) and model.block.plan.experts.w13 == "experts.w13"
    saved = model.block.state_dict()
    expected = original.state_dict()
    assert sorted(saved) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(saved[key], tensor), key
    # Another block's weights, loaded through the fused layer's keys, give that block's numbers.
    torch.manual_seed(1)
    other = cls()
    model.block.load_state_dict(other.state_dict())
    with torch.no_grad():
        h = model.inp(x)
        torch.testing.assert_close(model.block(h)[0], other(h)[0], rtol=0, atol=1e-6)
