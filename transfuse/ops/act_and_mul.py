"""act_and_mul: ``act(x[..., :d]) * x[..., d:]``, the gated activation of a GLU MLP.

A merged gate/up projection produces ``[gate | up]`` along the last dimension; these ops
apply the activation to the gate half and multiply by the up half, in the input dtype,
exactly as ``act_fn(gate_proj(x)) * up_proj(x)`` does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import Op, under_compile_use_library_op

__all__ = [
    "ACTIVATIONS",
    "GELU_AND_MUL",
    "SILU_AND_MUL",
    "act_and_mul",
    "gelu_and_mul_native",
    "identify_activation",
    "silu_and_mul_native",
]

# The attribute that marks an input nothing but act_and_mul reads (``MergedProjection`` sets it on a
# gate/up output when no hook can see it): a backward kernel may then overwrite it with its gradient.
CONSUMABLE = "_transfuse_consumable"

# Activation names act_and_mul accepts, as F.gelu's ``approximate`` names them for gelu.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    # ``chunk``, not two slices: its backward writes both halves' gradients into one tensor (a
    # concatenation), where two slices' backward zero-fill a full-size tensor each and add them.
    gate, up = x.chunk(2, dim=-1)
    return gate, up


def silu_and_mul_native(x: Tensor) -> Tensor:
    gate, up = _halves(x)
    return F.silu(gate) * up


def gelu_and_mul_native(x: Tensor, approximate: str = "none") -> Tensor:
    gate, up = _halves(x)
    return F.gelu(gate, approximate=approximate) * up


SILU_AND_MUL = Op("silu_and_mul", silu_and_mul_native)
GELU_AND_MUL = Op("gelu_and_mul", gelu_and_mul_native)


@torch.library.custom_op("transfuse::silu_and_mul", mutates_args=())
def _silu_and_mul_library_op(x: Tensor) -> Tensor:
    return SILU_AND_MUL(x)


@_silu_and_mul_library_op.register_fake
def _(x):
    return silu_and_mul_native(x)


@torch.library.custom_op("transfuse::gelu_and_mul", mutates_args=())
def _gelu_and_mul_library_op(x: Tensor, approximate: str) -> Tensor:
    return GELU_AND_MUL(x, approximate)


@_gelu_and_mul_library_op.register_fake
def _(x, approximate):
    return gelu_and_mul_native(x, approximate)


def act_and_mul(x: Tensor, activation: str) -> Tensor:
    """``act(gate) * up`` for ``x = [gate | up]``; ``activation`` is one of ``ACTIVATIONS``."""
    if x.shape[-1] % 2:
        raise ValueError(f"act_and_mul needs an even last dimension ([gate | up]), got {x.shape[-1]}.")
    if activation == "silu":
        if torch.compiler.is_compiling():
            if under_compile_use_library_op("silu_and_mul", (x,)):
                return torch.ops.transfuse.silu_and_mul(x)
            return silu_and_mul_native(x)
        return SILU_AND_MUL(x)
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        if torch.compiler.is_compiling():
            if under_compile_use_library_op("gelu_and_mul", (x,)):
                return torch.ops.transfuse.gelu_and_mul(x, approximate)
            return gelu_and_mul_native(x, approximate)
        return GELU_AND_MUL(x, approximate)
    raise ValueError(f"act_and_mul has no activation {activation!r}; it has: {', '.join(ACTIVATIONS)}.")


@functools.cache
def _probe(dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A gate probe in ``dtype`` (a sweep plus random values) and each fused activation's output on it.
    On the CPU whatever the default device is (a ``with torch.device("meta")`` block has no data,
    and the cache outlives the block)."""
    sweep = torch.linspace(-8.0, 8.0, 257, device="cpu")
    noise = torch.randn(256, generator=torch.Generator().manual_seed(0), device="cpu") * 3
    gate = torch.cat([sweep, noise]).to(dtype)
    gate_up = torch.cat([gate, torch.ones_like(gate, device="cpu")])
    native = {
        "silu": silu_and_mul_native(gate_up),
        "gelu": gelu_and_mul_native(gate_up, "none"),
        "gelu_tanh": gelu_and_mul_native(gate_up, "tanh"),
    }
    return gate, native


def identify_activation(module: nn.Module) -> str | None:
    """Which fused activation a stateless activation module computes, checked bit for bit in fp32 and bf16."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    candidates = set(ACTIVATIONS)
    for dtype in (torch.float32, torch.bfloat16):
        gate, expected = _probe(dtype)
        with torch.no_grad():
            got = module(gate)
        candidates &= {a for a, want in expected.items() if torch.equal(want, got)}
    return candidates.pop() if len(candidates) == 1 else None
