"""``generate`` without a host wait per token.

transformers' decoding loop reads ``unfinished_sequences.max() == 0`` on the host after every
token, so the host cannot queue step t+1 before step t has finished on the GPU, and every
token costs the GPU time plus the host's. transformers has the way out: ``DeferredStopCheck``
copies the flag asynchronously and reads it one step late, and undoes the one extra step at
the end (the cache is cropped back, the extra token dropped), so the results are the same.
transformers turns it on only on ``mps``. transfuse turns it on for CUDA as well, for the
caches a compiled model has served (``mark``): transformers asks whether to defer right after
the prompt's forward, with the cache that forward returned.

Versions of transformers without ``DeferredStopCheck`` decode as they always do.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["install", "mark", "supported"]


def _check_class() -> Any:
    try:
        from transformers.generation import utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return getattr(utils, "DeferredStopCheck", None)


def supported() -> bool:
    return _check_class() is not None


def mark(cache: Any) -> None:
    """``generate`` with this cache may defer its stop check on CUDA."""
    try:
        cache._transfuse_defer_stop = True
    except AttributeError:  # a cache class with __slots__: no deferral
        pass


def install() -> None:
    """Wrap ``DeferredStopCheck.is_supported`` (once) to say yes on CUDA for marked caches."""
    check = _check_class()
    if check is None or getattr(check.is_supported, "_transfuse", False):
        return
    original = check.is_supported

    @functools.wraps(original)
    def is_supported(device: Any, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
        served = getattr(cache, "_transfuse_defer_stop", False)
        if served and getattr(device, "type", None) == "cuda" and not is_assistant:
            # transformers' own conditions, with cuda where they say mps.
            return cache.is_croppable or not cache_is_returned
        return original(device, cache, cache_is_returned, is_assistant)

    is_supported._transfuse = True  # type: ignore[attr-defined]
    check.is_supported = staticmethod(is_supported)
