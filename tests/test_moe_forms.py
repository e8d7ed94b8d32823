"""MoE blocks in the forms of the newer families: a correction bias the block hands its router, a
scaled routed output, a float32 combine, a norm after the sum, shared experts on the reshaped
input or reading the router's outputs, clamped GLU experts. Toys for each form (→ fuses / →
refused), then the real tiny families that write them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transfuse
from tests import toys
from tests.test_moe import _blocks, _logits
from transfuse.ops import MoE
from transfuse.tiny import tiny_model

# ---- toys ------------------------------------------------------------------------------


class BiasArgumentRouter(nn.Module):
    """Sigmoid scores of the tokens cast to the weight's dtype; the block's correction bias is an argument."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)

    def forward(self, hidden_states, e_score_correction_bias):
        logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
        scores = torch.sigmoid(logits.float())
        _, ids = torch.topk(scores + e_score_correction_bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, ids)
        weights /= weights.sum(dim=-1, keepdim=True)
        return logits, weights, ids


class BlockBiasScaledMoE(nn.Module):
    """The block holds the correction bias and hands it to the router (hy_v3, minimax_m2, afmoe); the
    routed output times a scaling attribute, plus a shared expert (laguna) → fuses."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2):
        super().__init__()
        self.gate = BiasArgumentRouter(hidden, experts, top_k)
        self.experts = toys.PackedExperts(hidden, inter, experts)
        self.shared_experts = toys.GLUExpert(hidden, 24)
        self.e_score_correction_bias = nn.Buffer(torch.randn(experts) * 0.1)
        self.routed_scaling_factor = 2.5

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        tokens = hidden_states.view(-1, hidden)
        _, weights, ids = self.gate(tokens, self.e_score_correction_bias)
        routed = self.experts(tokens, weights, ids) * self.routed_scaling_factor
        return (routed + self.shared_experts(tokens)).reshape(batch, seq, hidden)


class Float32CombineMoE(BlockBiasScaledMoE):
    """The routed and shared outputs added in float32, cast back (hy_v3) → fuses."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        tokens = hidden_states.view(-1, shape[-1])
        _, weights, ids = self.gate(tokens, self.e_score_correction_bias)
        routed = self.experts(tokens, weights, ids)
        out = (routed.float() + self.shared_experts(tokens).float()).to(tokens.dtype)
        return out.reshape(shape)


class PostNormMoE(BlockBiasScaledMoE):
    """A norm child applied to the sum, the shared expert called on the input as is (axk1) → fuses."""

    def __init__(self):
        super().__init__()
        self.post_mlp_layernorm = toys.LlamaStyleNorm(32)

    def forward(self, hidden_states):
        residual = hidden_states
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(tokens, self.e_score_correction_bias)
        routed = self.experts(tokens, weights, ids).view(*hidden_states.shape)
        return self.post_mlp_layernorm(routed + self.shared_experts(residual))


class ReshapedInputSharedMoE(BlockBiasScaledMoE):
    """The shared expert called on the flattened tokens viewed back to the input's shape (aria) → fuses."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        tokens = hidden_states.view(-1, shape[-1])
        _, weights, ids = self.gate(tokens, self.e_score_correction_bias)
        return self.experts(tokens, weights, ids).view(shape) + self.shared_experts(tokens.view(shape))


class LogSigmoidRouter(nn.Module):
    """Routing the fuser does not know (log-sigmoid scores normalised with logsumexp, one extra
    column for the shared expert's weight): called as is."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(experts + 1, hidden) / hidden**0.5)

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.weight.shape[1]).float(), self.weight.float())
        ids = torch.topk(logits[..., :-1], self.top_k, dim=-1, sorted=False)[1]
        chosen = torch.cat([logits[..., :-1].gather(-1, ids), logits[..., -1:]], dim=-1)
        log_probs = F.logsigmoid(chosen)
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        return logits, weights[..., : self.top_k].contiguous(), ids, weights[..., -1:].contiguous()


class GammaScaledShared(toys.GLUExpert):
    def forward(self, hidden_states, gammas):
        return super().forward(hidden_states) * gammas.reshape(*hidden_states.shape[:-1], 1)


class SharedReadsRouterMoE(nn.Module):
    """The shared expert is called with a weight the router computes for it (inkling) → fuses, the
    router called as is."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2):
        super().__init__()
        self.gate = LogSigmoidRouter(hidden, experts, top_k)
        self.experts = toys.PackedExperts(hidden, inter, experts)
        self.shared_experts = GammaScaledShared(hidden, 24)

    def forward(self, hidden_states):
        _, weights, ids, gammas = self.gate(hidden_states)
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        routed = self.experts(tokens, weights, ids).view(*hidden_states.shape)
        return routed + self.shared_experts(hidden_states, gammas=gammas)


class ClampedSiluExperts(toys.PackedExperts):
    """``silu(clamp(gate, max=L)) * clamp(up, -L, L)`` (hy_v4, deepseek_v4)."""

    def __init__(self, hidden, inter, experts, limit=0.5):
        super().__init__(hidden, inter, experts)
        self.swiglu_limit = limit

    def forward(self, x, routing_weights, selected):
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            expert = expert[0]
            if expert == self.num_experts:
                continue
            slot, token = torch.where(mask[expert])
            gate, up = (x[token] @ self.gate_up[expert]).chunk(2, dim=-1)
            gate = gate.clamp(min=None, max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            h = F.silu(gate) * up
            out.index_add_(0, token, (h @ self.down[expert]) * routing_weights[token, slot, None])
        return out


class ClampedSiluMoE(BlockBiasScaledMoE):
    """Clamped SiLU GLU experts → fuses (activation clamped_silu, the limit read per instance)."""

    def __init__(self):
        super().__init__()
        self.experts = ClampedSiluExperts(32, 16, 8)


class Softcap(nn.Module):
    def __init__(self, cap):
        super().__init__()
        self.softcap = cap

    def forward(self, hidden_states):
        return torch.tanh(hidden_states / self.softcap) * self.softcap


class SoftcappedSwiGLU(nn.Module):
    """An activation child of the gate and up: the linear gate factor and up softcapped, in float32."""

    def __init__(self, gate_cap=1.5, up_cap=4.0):
        super().__init__()
        self.gate_softcap, self.up_softcap = Softcap(gate_cap), Softcap(up_cap)

    def forward(self, gate, up):
        dtype = gate.dtype
        gate, up = gate.float(), up.float()
        return (self.gate_softcap(gate) * torch.sigmoid(gate) * self.up_softcap(up)).to(dtype)


class Float32SumExperts(nn.Module):
    """Packed ``[E, 2I, H]`` experts whose activation is a child of (gate, up), their outputs added into
    float32 zeros and the sum cast back (inkling2)."""

    def __init__(self, hidden, inter, experts):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) / inter**0.5)
        self.act_fn = SoftcappedSwiGLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states, dtype=torch.float32)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert_idx in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = F.linear(self.act_fn(gate, up), self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final.to(hidden_states.dtype)


class Float32Router(nn.Module):
    """Routing in float32 (the tokens cast, then flattened), ids read as ``topk(...).indices``."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k, self.hidden_dim = top_k, hidden
        self.weight = nn.Parameter(torch.randn(experts, hidden, dtype=torch.float32) / hidden**0.5)
        self.e_score_correction_bias = nn.Buffer(torch.randn(experts) * 0.1)
        self.routed_scaling_factor = 1.5

    def forward(self, hidden_states):
        flat = hidden_states.float().reshape(-1, self.hidden_dim)
        scores = torch.sigmoid(F.linear(flat, self.weight))
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.routed_scaling_factor, ids


class Float32SumMoE(nn.Module):
    """Softcapped SwiGLU experts summed in float32 behind float32 routing (inkling2) → fuses."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2):
        super().__init__()
        self.gate = Float32Router(hidden, experts, top_k)
        self.experts = Float32SumExperts(hidden, inter, experts)

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(tokens)
        return self.experts(tokens, ids, weights).view_as(hidden_states)


class Float32SumUnprovedWeightsMoE(nn.Module):
    """Experts summed in float32 behind a softmax in the model's dtype (weights not proved float32)
    → refused (moe.combine): in bf16 the products and so the sums would differ."""

    def __init__(self, hidden=32, experts=8):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = Float32SumExperts(hidden, 16, experts)

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        weights, ids = torch.topk(F.softmax(self.gate(tokens), dim=-1), 2, dim=-1)
        return self.experts(tokens, ids, weights).view_as(hidden_states)


class ComputedRouterArgumentMoE(BlockBiasScaledMoE):
    """The router is handed a tensor the block computes, not one it holds → refused (moe.router)."""

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(tokens, self.e_score_correction_bias * 2)
        return self.experts(tokens, weights, ids).view_as(hidden_states)


class PartlyFloat32CombineMoE(BlockBiasScaledMoE):
    """Only the routed output is cast to float32 before the sum → refused (moe.output)."""

    def forward(self, hidden_states):
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(tokens, self.e_score_correction_bias)
        out = (self.experts(tokens, weights, ids).float() + self.shared_experts(tokens)).to(tokens.dtype)
        return out.view_as(hidden_states)


class GammaRouter(toys.SigmoidRouter):
    def forward(self, x):
        chosen, weights = super().forward(x)
        return chosen, weights, torch.sigmoid(x[:, :1])


class SharedReadsRecognisedRouterMoE(nn.Module):
    """A shared expert reads an output of a router whose routing the layer computes itself (and would
    not call) → refused (moe.shared)."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2):
        super().__init__()
        self.router = GammaRouter(hidden, experts, top_k)
        self.experts = toys.PackedExperts(hidden, inter, experts)
        self.shared = GammaScaledShared(hidden, 24)

    def forward(self, hidden_states):
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        chosen, weights, gammas = self.router(tokens)
        return (self.experts(tokens, weights, chosen) + self.shared(tokens, gammas)).view_as(hidden_states)


class ZeroFilledGroupRouter(BiasArgumentRouter):
    """Group-limited routing whose group mask the router allocates and fills in place (``scatter_``),
    the other groups' scores set to 0 rather than -inf (axk2): a routing the fused layer does not
    compute itself, so it calls the router as is."""

    def forward(self, hidden_states, e_score_correction_bias):
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + e_score_correction_bias
        groups = choice.view(-1, 2, choice.shape[-1] // 2).topk(2, dim=-1)[0].sum(dim=-1)
        group_mask = torch.zeros_like(groups)
        group_mask.scatter_(1, torch.topk(groups, k=1, dim=-1, sorted=False)[1], 1)
        keep = group_mask.unsqueeze(-1).expand(-1, 2, choice.shape[-1] // 2).reshape(-1, choice.shape[-1])
        ids = torch.topk(choice.masked_fill(~keep.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        return logits, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids


class ZeroFilledGroupMoE(BlockBiasScaledMoE):
    def __init__(self):
        super().__init__()
        self.gate = ZeroFilledGroupRouter(32, 8, 2)


class InputClampingRouter(ZeroFilledGroupRouter):
    """The same router, but it clamps the tokens it is given in place: the block's own input."""

    def forward(self, hidden_states, e_score_correction_bias):
        hidden_states.clamp_(-1e4, 1e4)
        return super().forward(hidden_states, e_score_correction_bias)


class InputClampingRouterMoE(BlockBiasScaledMoE):
    def __init__(self):
        super().__init__()
        self.gate = InputClampingRouter(32, 8, 2)


def _grouped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert times each expert's [in, out] matrix, ``counts`` rows each."""
    out, start = [], 0
    for expert, n in enumerate(counts.tolist()):
        out.append(rows[start : start + n] @ weight[expert])
        start += n
    return torch.cat(out)


class GroupedGemm(nn.Module):
    def __init__(self, experts: int, a: int, b: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, a, b) * 0.1)

    def forward(self, rows, counts):
        return _grouped_gemm(rows, self.weight, counts)


class SortedRowsExperts(nn.Module):
    """aria's experts as older transformers wrote them: the routing inside, the chosen rows sorted
    by expert, counted (``histc``) and sent through two grouped GEMMs, put back with ``index_copy_``."""

    def __init__(self, experts: int = 8, k: int = 2, hidden: int = 32, inner: int = 16):
        super().__init__()
        self.experts, self.k = experts, k
        self.fc1 = GroupedGemm(experts, hidden, 2 * inner)
        self.fc2 = GroupedGemm(experts, inner, hidden)

    def forward(self, hidden_states, router_logits):
        weights, ids = torch.topk(router_logits.softmax(-1), self.k, dim=-1)
        counts = torch.histc(ids.flatten().float(), bins=self.experts, min=0, max=self.experts - 1).long()
        order = torch.argsort(ids.flatten())
        rows = hidden_states.index_select(0, order // self.k)
        projection, gate = self.fc1(rows, counts).chunk(2, dim=-1)
        out = self.fc2(F.silu(projection) * gate, counts)
        placed = torch.zeros(ids.numel(), out.shape[-1], dtype=out.dtype)
        placed.index_copy_(0, order, out)
        return (placed.view(-1, self.k, out.shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)


class SortedRowsGroupedGemmMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(32, 8, bias=False)
        self.experts = SortedRowsExperts()

    def forward(self, hidden_states):
        shape = hidden_states.shape
        flat = hidden_states.view(-1, shape[-1])
        return self.experts(flat, self.router(flat)).view(shape)


def _rewrite_toy(block: nn.Module, seed: int = 0):
    torch.manual_seed(seed)
    model = toys.TinyMoEModel(block)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        before = model(x)
    transfuse.rewrite(model, example_inputs=(x,), fusions=["moe"])
    return model, x, before


FUSED = [
    BlockBiasScaledMoE, Float32CombineMoE, PostNormMoE, ReshapedInputSharedMoE, SharedReadsRouterMoE, ClampedSiluMoE,
    Float32SumMoE, ZeroFilledGroupMoE,
]  # fmt: skip


@pytest.mark.parametrize("cls", FUSED, ids=lambda c: c.__name__)
def test_toy_blocks_of_the_newer_forms_fuse_and_match(cls):
    block = cls()
    keys = list(toys.TinyMoEModel(block).state_dict())
    model, x, before = _rewrite_toy(block)
    assert isinstance(model.block, MoE), transfuse.report(model)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_the_block_tensor_handed_to_the_router_stays_the_layers_own():
    block = BlockBiasScaledMoE()
    untouched = copy.deepcopy(block)
    bias = block.e_score_correction_bias
    model, x, before = _rewrite_toy(block)
    layer = model.block
    assert layer.e_score_correction_bias is bias and "block.e_score_correction_bias" in model.state_dict()
    assert layer.plan.router.correction_bias == "e_score_correction_bias" and layer.plan.routed_scaled
    assert layer.plan.router.logits.input_like_weight
    # The layer routes with the bias it holds: a new bias changes the choice as it does in the block.
    with torch.no_grad():
        new_bias = torch.randn(8)
        bias.copy_(new_bias)
        untouched.e_score_correction_bias.copy_(new_bias)
        h = model.inp(x)
        torch.testing.assert_close(layer(h), untouched(h), rtol=0, atol=1e-6)


def test_the_scale_and_clamp_limit_are_read_per_instance():
    block = ClampedSiluMoE()
    block.routed_scaling_factor, block.experts.swiglu_limit = 0.75, 0.3
    model, x, before = _rewrite_toy(block)
    assert model.block.plan.experts.spec.activation == "clamped_silu"
    assert (model.block.expert_numbers.routed_scale, model.block.expert_numbers.limit) == (0.75, 0.3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


def test_the_softcaps_are_read_per_instance_and_bf16_matches_within_its_rounding():
    block = Float32SumMoE()
    block.experts.act_fn.gate_softcap.softcap, block.experts.act_fn.up_softcap.softcap = 0.7, 2.0
    model, x, before = _rewrite_toy(block)
    assert model.block.plan.experts.spec.activation == "softcapped_swiglu"
    assert (model.block.expert_numbers.alpha, model.block.expert_numbers.limit) == (0.7, 2.0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)
    # In bf16 the float32 routing weights make each output times its weight float32, summed in float32:
    # the fused layer rounds as the block does but for the order of a token's k terms.
    torch.manual_seed(1)
    original = Float32SumMoE().to(torch.bfloat16)
    original.gate.float()  # the router's weight stays float32, as the model keeps it
    fused = toys.TinyMoEModel(copy.deepcopy(original)).to(torch.bfloat16)
    fused.block.gate.float()
    h = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    transfuse.rewrite(fused, example_inputs=(h,), fusions=["moe"])
    assert isinstance(fused.block, MoE)
    with torch.no_grad():
        want, got = original(h).float(), fused.block(h).float()
    assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


def test_the_float32_combine_and_post_norm_are_in_the_plan():
    assert _rewrite_toy(Float32CombineMoE())[0].block.plan.combine_fp32
    plan = _rewrite_toy(PostNormMoE())[0].block.plan
    assert plan.post == "post_mlp_layernorm" and not plan.post_flat and plan.shared[0].input


@pytest.mark.parametrize(
    "cls", [BlockBiasScaledMoE, PostNormMoE, SharedReadsRouterMoE, Float32SumMoE, ZeroFilledGroupMoE],
    ids=lambda c: c.__name__,
)
def test_gradients_of_the_newer_forms_match_the_original(cls):
    torch.manual_seed(0)
    original = toys.TinyMoEModel(cls())
    fused = toys.TinyMoEModel(cls())
    fused.load_state_dict(original.state_dict())
    x = torch.randn(2, 7, 32)
    transfuse.rewrite(fused, example_inputs=(x,), fusions=["moe"])
    assert isinstance(fused.block, MoE)
    for model in (original, fused):
        model.train()
        model(x).square().sum().backward()
    for (name, a), (_, b) in zip(original.named_parameters(), fused.named_parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


REFUSED = [
    (ComputedRouterArgumentMoE, "moe.router"),
    (PartlyFloat32CombineMoE, "moe.output"),
    (SharedReadsRecognisedRouterMoE, "moe.shared"),
    (Float32SumUnprovedWeightsMoE, "moe.combine"),
    (InputClampingRouterMoE, "moe.in-place"),
    (SortedRowsGroupedGemmMoE, "moe.unfollowed"),  # (never passed over in silence)
]


@pytest.mark.parametrize("cls, tag", REFUSED, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_near_misses_of_the_newer_forms_are_refused_with_a_reason(cls, tag):
    block = cls()
    model, x, before = _rewrite_toy(block)
    assert model.block is block
    (skip,) = [s for s in transfuse.report(model).skipped if s.kind == "moe"]
    assert skip.tag == tag and skip.reason.endswith("."), skip
    with torch.no_grad():
        assert torch.equal(model(x), before)


# ---- real families -----------------------------------------------------------------------

FAMILIES = [
    "afmoe", "hy_v3", "minimax_m2",  # the block's correction bias handed to the router
    "axk1", "laguna", "minimax_m3_vl_text",  # a norm after the sum; a scaled routed output
    "aria_text", "inkling_text",  # shared experts on the reshaped input; reading the router's outputs
    "hy_v4",  # clamped SiLU experts
    "axk2",  # a router that fills a group mask of its own in place (called as is)
    "inkling2_text", "inkling2_loop_text",  # softcapped SwiGLU experts summed in float32
]  # fmt: skip


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_moe_block_of_the_newer_families_is_fused_with_equal_logits_and_generation(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    prompt = ids[:1, :5]
    before, generated = _logits(model, ids), model.generate(prompt, max_new_tokens=6, do_sample=False)
    blocks = _blocks(model)
    assert blocks
    classes = {type(model.get_submodule(p)).__name__ for p in blocks}
    transfuse.rewrite(model, fusions=["moe"])
    report = transfuse.report(model)
    assert sorted(f.path for f in report.fusions if f.kind == "moe") == sorted(blocks), report
    # inkling2_loop's text model (a list of small modules, not experts) is refused apart: not a block.
    assert not [s for s in report.skipped if s.cls in classes], report
    assert (_logits(model, ids) - before).abs().max().item() <= 1e-5
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), generated)
