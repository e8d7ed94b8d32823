"""The fused layers that rewritten models call: ``nn.Module``s over dispatched ops.

Fusers build these from a model's own tensors (no copies, no re-initialisation) and
keep the original parameter names, so ``state_dict`` keys do not change. A plugin can
replace a layer class with ``register_layer``; fusers look classes up with ``layer``.
"""

from __future__ import annotations

import torch
from torch import nn

from .moe_layer import MoE
from .rms_norm import RMSNormSpec, rms_norm

__all__ = ["MergedLinear", "MoE", "RMSNorm", "layer", "register_layer"]


class MergedLinear(nn.Linear):
    """Several linear projections of one input as one: weights concatenated along the output.

    ``split_sizes`` are the output widths of the original projections, in order, so
    ``out.split(self.split_sizes, dim=-1)`` gives back their outputs. ``parts`` names
    them; ``activation`` is set when the parts are a GLU's gate and up halves.
    """

    __transfuse_layer__ = True

    def __init__(
        self,
        in_features: int,
        split_sizes: tuple[int, ...],
        bias: bool,
        parts: tuple[str, ...],
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, sum(split_sizes), bias=bias, device=device, dtype=dtype)
        self.split_sizes = tuple(int(s) for s in split_sizes)
        self.parts = tuple(parts)
        self.activation = activation

    def extra_repr(self) -> str:
        merged = " + ".join(f"{name}:{size}" for name, size in zip(self.parts, self.split_sizes))
        act = f", activation={self.activation}" if self.activation else ""
        return f"{super().extra_repr()}, parts=[{merged}]{act}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with the rounding of ``spec``; the weight is optional."""

    __transfuse_layer__ = True

    def __init__(
        self,
        weight: nn.Parameter | None,
        eps: float,
        spec: RMSNormSpec = RMSNormSpec(),
        weight_name: str = "weight",
    ):
        super().__init__()
        self.eps = float(eps)
        self.spec = spec
        self.weight_name = weight_name
        self.register_parameter(weight_name, weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, getattr(self, self.weight_name), self.eps, self.spec)

    def extra_repr(self) -> str:
        weight = getattr(self, self.weight_name)
        shape = tuple(weight.shape) if weight is not None else None
        return f"{shape}, eps={self.eps}, {self.spec.describe()}"


_LAYERS: dict[str, type[nn.Module]] = {"RMSNorm": RMSNorm, "MergedLinear": MergedLinear, "MoE": MoE}


def register_layer(name: str, cls: type[nn.Module]) -> None:
    """Replace the layer class fusers build under ``name`` (for out-of-tree platforms)."""
    if name not in _LAYERS:
        raise KeyError(f"No layer named {name!r}; the layers are: {', '.join(sorted(_LAYERS))}.")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"A replacement for layer {name!r} must be an nn.Module subclass, not {cls!r}.")
    _LAYERS[name] = cls


def layer(name: str) -> type[nn.Module]:
    """The class fusers instantiate for ``name`` (a plugin's replacement, if registered)."""
    from .dispatch import _load_plugins

    _load_plugins()
    return _LAYERS[name]
