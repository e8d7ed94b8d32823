"""``generate`` without a host wait per token, and with its decode steps replayed unchecked.

transformers' decoding loop reads ``unfinished_sequences.max() == 0`` on the host after every
token, so the host cannot queue step t+1 before step t has finished on the GPU, and every
token costs the GPU time plus the host's. transformers has the way out: ``DeferredStopCheck``
copies the flag asynchronously and reads it one step late, and undoes the one extra step at
the end (the cache is cropped back, the extra token dropped), so the results are the same.
transformers turns it on only on ``mps``. transfuse turns it on for CUDA as well, for the
caches a compiled model has served (``mark``): transformers asks whether to defer right after
the prompt's forward, with the cache that forward returned.

A decoding loop of transformers' own (``_sample``: greedy and sampling; ``_beam_search``) run
on a compiled model with nothing of the caller's inside it (no streamer, and every logits
processor and stopping criterion a transformers class that holds no function or module of
the caller's: ``closed``) is a *closed loop*: between two of its decode steps only
transformers' generation code runs, which changes no module, weight, global or grad mode.
What Dynamo's guards check before a step therefore holds for every step of the loop once it
has held for one, and the compiled model may replay a captured step without checking them
again (``replay.CallGraphs``): the first replay of each captured step in a loop checks
everything, the later ones nothing. ``install_loops`` wraps the two loops to tell the compiled model
when it is inside one (``_Compiled.closed_loop``).

Versions of transformers without ``DeferredStopCheck`` decode as they always do; without a
loop of these names, every step is checked.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

from torch import nn

__all__ = ["closed", "install", "install_loops", "mark", "supported"]

# transformers' decoding loops that run only transformers' code between two decode steps when
# given nothing of the caller's (assisted decoding runs another model between them).
_LOOPS = ("_sample", "_beam_search")


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


def closed(arguments: dict[str, Any]) -> bool:
    """Whether a decoding loop called with these arguments (by name) runs nothing of the
    caller's between its steps: no streamer, and only transformers' own processors and
    criteria, none holding a function or a module (a prefix function, classifier-free
    guidance's model)."""
    if arguments.get("streamer") is not None:
        return False
    for name in ("logits_processor", "stopping_criteria"):
        for item in arguments.get(name) or ():
            if not _own(item):
                return False
    return True


def _own(item: Any) -> bool:
    if not type(item).__module__.startswith("transformers."):
        return False
    state = getattr(item, "__dict__", {})
    return not any(isinstance(value, _CODE) for value in state.values())


_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial, nn.Module)


def install_loops() -> None:
    """Wrap transformers' decoding loops (once) to run closed loops of compiled models as such."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    for name in _LOOPS:
        original = GenerationMixin.__dict__.get(name)
        if original is None or getattr(original, "_transfuse", False):
            continue
        setattr(GenerationMixin, name, _closing(original))


def _closing(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = getattr(self, "_transfuse_compiled", None)
        if compiled is None or self.__dict__.get("_compiled_call_impl") is not compiled:
            return original(self, *args, **kwargs)
        try:
            arguments = signature.bind_partial(self, *args, **kwargs).arguments
        except TypeError:  # another version's loop: its steps are checked
            return original(self, *args, **kwargs)
        if not closed(arguments):
            return original(self, *args, **kwargs)
        with compiled.closed_loop():
            return original(self, *args, **kwargs)

    loop._transfuse = True  # type: ignore[attr-defined]
    return loop
