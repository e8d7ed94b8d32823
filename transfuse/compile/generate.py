"""``generate`` without a host wait per token.

transformers' decoding loop reads ``unfinished_sequences.max() == 0`` on the host after every
token, so the host cannot queue step t+1 before step t has finished on the GPU, and every
token costs the GPU time plus the host's. transformers has the way out: ``DeferredStopCheck``
copies the flag asynchronously and reads it one step late, and undoes the one extra step at
the end (the cache is cropped back, the extra token dropped), so the results are the same.
transformers turns it on only on ``mps``. A compiled model's ``generate`` turns it on for
CUDA as well, for its own calls only.

Versions of transformers without ``DeferredStopCheck`` decode as they always do.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

__all__ = ["deferred_stop_check", "supported"]

_ACTIVE = 0


def _check_class() -> Any:
    try:
        from transformers.generation import utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return getattr(utils, "DeferredStopCheck", None)


def supported() -> bool:
    return _check_class() is not None


def _install() -> None:
    check = _check_class()
    if check is None or getattr(check.is_supported, "_transfuse", False):
        return
    original = check.is_supported

    @functools.wraps(original)
    def is_supported(device: Any, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
        if _ACTIVE and getattr(device, "type", None) == "cuda" and not is_assistant:
            # transformers' own conditions, with cuda where they say mps.
            return cache is None or cache.is_croppable or not cache_is_returned
        return original(device, cache, cache_is_returned, is_assistant)

    is_supported._transfuse = True  # type: ignore[attr-defined]
    check.is_supported = staticmethod(is_supported)


@contextlib.contextmanager
def deferred_stop_check() -> Iterator[None]:
    """Inside, ``generate`` on CUDA defers its stop check by a step (where transformers can)."""
    global _ACTIVE
    _install()
    _ACTIVE += 1
    try:
        yield
    finally:
        _ACTIVE -= 1
