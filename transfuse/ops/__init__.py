"""Fused ops and layers, with one platform dispatch for every kernel.

ops knows nothing about tracing or Hugging Face: each op is a native PyTorch definition
plus providers (torch builtins, Triton, CUDA C++, plugins) picked per platform and call.
"""

from .act_and_mul import ACTIVATIONS, act_and_mul, gelu_and_mul_native, silu_and_mul_native
from .dispatch import (
    Dispatch,
    Op,
    Provider,
    get_op,
    priority,
    refresh,
    register_provider,
    set_compile_mode,
    set_priority,
    trace,
)
from .layers import MoE, RMSNorm, layer, register_layer
from .moe import ExpertsSpec, RoutingSpec, moe_experts, moe_experts_native, moe_route, moe_route_native
from .moe_layer import StackedExperts
from .platform import Platform, current_platform
from .rms_norm import RMSNormSpec, rms_norm, rms_norm_native

__all__ = [
    "ACTIVATIONS",
    "Dispatch",
    "ExpertsSpec",
    "MoE",
    "Op",
    "Platform",
    "Provider",
    "RMSNorm",
    "RMSNormSpec",
    "RoutingSpec",
    "StackedExperts",
    "act_and_mul",
    "current_platform",
    "gelu_and_mul_native",
    "get_op",
    "layer",
    "moe_experts",
    "moe_experts_native",
    "moe_route",
    "moe_route_native",
    "priority",
    "refresh",
    "register_layer",
    "register_provider",
    "rms_norm",
    "rms_norm_native",
    "set_compile_mode",
    "set_priority",
    "silu_and_mul_native",
    "trace",
]
