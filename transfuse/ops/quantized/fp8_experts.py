"""Block-FP8 experts: transformers' ``FP8Experts``, the experts of a fine-grained FP8 checkpoint
(``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` in e4m3, each with one float32
``*_scale_inv`` per ``block_size`` block), computed per expert by its ``linear`` method.

The experts are stacked already: a fused block runs them through ``moe_experts_fp8`` on their own
tensors and scales, routing unchanged. While a block is traced, the ``linear`` method is one leaf
(``ExpertProjection``): the trace shows which indexed weight and scale each projection reads, as it
shows ``F.linear`` of a plain expert, and never enters transformers' FP8 kernels (CUDA only).
Refused: per-tensor scales (no ``block_size``), static activation scales (one per expert and
projection, which ``moe_experts_fp8`` does not apply), FP4 experts, and scales that are not one per
block.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["BLOCK_ATTRIBUTE", "ExpertProjection", "check_fp8_experts", "fp8_experts", "projection_leaves"]

BLOCK_ATTRIBUTE = "block_size"  # the experts' attribute holding (block rows, block columns)


def fp8_experts(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' block-FP8 experts class (or one made from it)."""
    return any(c.__name__ == "FP8Experts" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


class ExpertProjection:
    """The leaf a traced ``FP8Experts.linear(input, weight[e], weight_scale_inv[e], activation_scale=...)``
    becomes: ``F.linear`` of the input by the expert's FP8 weight times its block scales. Called on meta
    tensors, it gives the output's shape and dtype."""

    scheme = "block FP8"
    __name__ = "fp8_expert_linear"

    def __call__(self, input: Tensor, weight: Tensor, weight_scale_inv: Tensor, activation_scale=None) -> Tensor:
        return input.new_empty((*input.shape[:-1], weight.shape[-2]))

    def __repr__(self) -> str:
        return "fp8_expert_linear"


PROJECTION = ExpertProjection()


def projection_leaves(module: nn.Module) -> dict[str, ExpertProjection]:
    """Methods of ``module`` that a trace of its forward shows as one quantized projection each."""
    return {"linear": PROJECTION} if fp8_experts(module) else {}


def check_fp8_experts(module: nn.Module, w13: Tensor, w2: Tensor, s13: Tensor, s2: Tensor) -> str | None:
    """Why ``moe_experts_fp8`` cannot compute these FP8 experts (None: it can)."""
    block = getattr(module, BLOCK_ATTRIBUTE, None)
    if block is None:
        return "its FP8 experts have one scale per expert for the whole matrix (no block_size), not block scales."
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return "its FP8 experts quantize their inputs with static per-expert activation scales."
    if w13.element_size() != 1 or w13.dtype != w2.dtype or w13.is_floating_point() is False:
        return f"its experts' weights are {w13.dtype} (FP4-packed or not FP8), not e4m3 with block scales."
    for name, w, s in (("gate_up", w13, s13), ("down", w2, s2)):
        want = (w.shape[0], -(-w.shape[1] // block[0]), -(-w.shape[2] // block[1]))
        if tuple(s.shape) != want:
            return f"its {name} scales {tuple(s.shape)} are not one per {block[0]}x{block[1]} block ({want})."
    return None
