"""Fused ops and layers, with one platform dispatch for every kernel.

ops knows nothing about tracing or Hugging Face: each op is a native PyTorch definition
plus providers (torch builtins, Triton, CUDA C++, plugins) picked per platform and call.
"""

# Importing these registers their providers: CUDA C++ (built on first use), Triton (imported on first use).
from . import batch_invariant, conformance, cuda, triton  # noqa: F401
from .act_and_mul import ACTIVATIONS, act_and_mul, act_and_mul_backward_native, act_and_mul_linear, gelu_and_mul_native, identify_activation, silu_and_mul_native
from .dispatch import (
    Dispatch,
    Op,
    Provider,
    get_op,
    priority,
    refresh,
    register_provider,
    set_compile_mode,
    unregister_provider,
    set_priority,
    trace,
)
from .decode_attention import decode_attention, decode_attention_native
from .fused_add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_native
from .layers import GatedRMSNorm, LinearPart, MergedProjection, MoE, RMSNorm, add_rms_norm, layer, register_layer
from .linear_cross_entropy import causal_lm_loss, linear_cross_entropy
from .moe import ExpertsSpec, RoutingSpec, moe_experts, moe_experts_native, moe_route, moe_route_native
from .moe_layer import StackedExperts, moe_block, moe_block_applies
from .platform import Platform, current_platform
from .rms_norm import GATE_ACTIVATIONS, RMSNormSpec, gated_rms_norm, gated_rms_norm_native, rms_norm, rms_norm_native
from .rotary import (
    RotaryLayout,
    rotary,
    rotary_backward_native,
    rotary_native,
    rotary_one,
    rotary_one_backward_native,
    rotary_one_native,
)

__all__ = [
    "ACTIVATIONS",
    "Dispatch",
    "ExpertsSpec",
    "LinearPart",
    "MergedProjection",
    "MoE",
    "Op",
    "Platform",
    "Provider",
    "GATE_ACTIVATIONS",
    "GatedRMSNorm",
    "RMSNorm",
    "RMSNormSpec",
    "RotaryLayout",
    "RoutingSpec",
    "StackedExperts",
    "act_and_mul",
    "add_rms_norm",
    "act_and_mul_backward_native",
    "act_and_mul_linear",
    "causal_lm_loss",
    "current_platform",
    "decode_attention",
    "decode_attention_native",
    "fused_add_rms_norm",
    "fused_add_rms_norm_native",
    "gated_rms_norm",
    "gated_rms_norm_native",
    "gelu_and_mul_native",
    "identify_activation",
    "get_op",
    "layer",
    "linear_cross_entropy",
    "moe_block",
    "moe_block_applies",
    "moe_experts",
    "moe_experts_native",
    "moe_route",
    "moe_route_native",
    "priority",
    "refresh",
    "register_layer",
    "register_provider",
    "unregister_provider",
    "rms_norm",
    "rms_norm_native",
    "rotary",
    "rotary_backward_native",
    "rotary_native",
    "rotary_one",
    "rotary_one_backward_native",
    "rotary_one_native",
    "set_compile_mode",
    "set_priority",
    "silu_and_mul_native",
    "trace",
]
