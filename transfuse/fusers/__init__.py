"""Fusion patterns, one per file. Each recognises structure by dataflow, never by name."""

from __future__ import annotations

from ..rewriter.fusion import Fuser
from .glu import GLUFuser
from .moe import MoEFuser
from .qkv import QKVFuser
from .rms_norm import RMSNormFuser

__all__ = ["FUSERS", "GLUFuser", "MoEFuser", "QKVFuser", "RMSNormFuser", "fusers_for", "kinds"]

# Applied in this order.
FUSERS: tuple[Fuser, ...] = (RMSNormFuser(), QKVFuser(), GLUFuser(), MoEFuser())


def kinds() -> list[str]:
    return [f.kind for f in FUSERS]


def fusers_for(names: list[str] | tuple[str, ...] | None) -> list[Fuser]:
    """The fusers of the given kinds (all when ``names`` is None); unknown kinds are an error."""
    if names is None:
        return list(FUSERS)
    if isinstance(names, str):
        raise TypeError(f"fusions must be a list of kind names, such as [{names!r}], not a string.")
    unknown = sorted(set(names) - set(kinds()))
    if unknown:
        raise ValueError(f"Unknown fusion kind(s) {', '.join(map(repr, unknown))}; the kinds are: {', '.join(kinds())}.")
    return [f for f in FUSERS if f.kind in names]
