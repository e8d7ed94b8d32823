"""Fusion patterns, one per file. Each recognises structure by dataflow, never by name."""

from __future__ import annotations

from ..rewriter.fusion import Fuser
from .add_rms_norm import AddRMSNormFuser
from .glu import GLUFuser
from .linear_cross_entropy import LinearCrossEntropyFuser
from .moe import MoEFuser
from .qkv import QKVFuser
from .rms_norm import RMSNormFuser
from .rotary import RotaryFuser

__all__ = [
    "FUSERS",
    "AddRMSNormFuser",
    "GLUFuser",
    "LinearCrossEntropyFuser",
    "MoEFuser",
    "QKVFuser",
    "RMSNormFuser",
    "RotaryFuser",
    "default_kinds",
    "fusers_for",
    "kinds",
]

# Applied in this order.
FUSERS: tuple[Fuser, ...] = (
    RMSNormFuser(), AddRMSNormFuser(), QKVFuser(), RotaryFuser(), GLUFuser(), MoEFuser(), LinearCrossEntropyFuser(),
)  # fmt: skip


def kinds() -> list[str]:
    """Every fusion kind, the opt-in ones included."""
    return [f.kind for f in FUSERS]


def default_kinds() -> list[str]:
    """The kinds a rewrite applies when none are named (all but the opt-in ones)."""
    return [f.kind for f in FUSERS if not f.opt_in]


def fusers_for(names: list[str] | tuple[str, ...] | None) -> list[Fuser]:
    """The fusers of the given kinds (the default kinds when ``names`` is None); unknown kinds are an error."""
    if names is None:
        return [f for f in FUSERS if not f.opt_in]
    if isinstance(names, str):
        raise TypeError(f"fusions must be a list of kind names, such as [{names!r}], not a string.")
    unknown = sorted(set(names) - set(kinds()))
    if unknown:
        raise ValueError(f"Unknown fusion kind(s) {', '.join(map(repr, unknown))}; the kinds are: {', '.join(kinds())}.")
    chosen = [f for f in FUSERS if f.kind in names]
    for fuser in chosen:
        missing = [kind for kind in fuser.requires if kind not in names]
        if missing:
            raise ValueError(
                f"The {fuser.kind} fusion builds on {', '.join(missing)}: ask for {' and '.join(missing)} too, "
                f"or leave {fuser.kind} out."
            )
    return chosen
