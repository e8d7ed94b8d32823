"""Per-class analysis: trace a class once, ask each fuser once, cache both.

The cache key is the class and its children's names and classes, so a decoder layer
with a dense MLP and one with a mixture of experts are analysed separately. Nothing
per-instance is kept in an analysis: instance values (eps, shapes) are read by the
fusers' ``validate`` and ``fuse``.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn

from .capture import Probe
from .fusion import Fuser, Refusal
from .graph import location
from .tracer import Trace, trace_module, unwrapped_forward

__all__ = ["ClassAnalysis", "analyse", "class_key", "clear_cache"]


def class_key(module: nn.Module) -> tuple:
    return (type(module), tuple((name, type(child)) for name, child in module.named_children()))


@dataclass
class ClassAnalysis:
    """What is known about one module class: its traced graph and each fuser's verdict."""

    cls: type
    trace: Trace
    traced_path: str
    had_example: bool
    verdicts: dict[str, Any] = field(default_factory=dict)

    def verdict(self, fuser: Fuser) -> Any | Refusal | None:
        if fuser.kind not in self.verdicts:
            self.verdicts[fuser.kind] = fuser.match(self)
        return self.verdicts[fuser.kind]

    def where(self, node: fx.Node | None = None) -> str | None:
        """``file.py:line`` of ``node``, else of the class's forward; None without a source file."""
        loc = location(node) if node is not None else None
        if loc is None:
            code = getattr(unwrapped_forward(self.cls), "__code__", None)
            if code is not None:
                loc = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
        return loc


_CACHE: "weakref.WeakKeyDictionary[type, dict[tuple, ClassAnalysis]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()


def _children_outputs(path: str, module: nn.Module, probe: Probe) -> dict[str, Any]:
    prefix = f"{path}." if path else ""
    outputs = {}
    for name, _ in module.named_modules():
        call = probe.calls.get(prefix + name) if name else None
        if call is not None and call.output is not None:
            outputs[name] = call.output
    return outputs


def analyse(module: nn.Module, path: str, probe: Probe) -> ClassAnalysis:
    """The cached analysis of ``module``'s class, tracing it (with this instance's recorded call) if new."""
    key = class_key(module)
    with _LOCK:
        cached = _CACHE.get(key[0], {}).get(key[1:])
    call = probe.calls.get(path)
    if cached is not None and (cached.had_example or call is None):
        return cached
    example = (call.args, call.kwargs) if call is not None else None
    trace = trace_module(module, example, _children_outputs(path, module, probe))
    analysis = ClassAnalysis(cls=type(module), trace=trace, traced_path=path, had_example=example is not None)
    with _LOCK:
        _CACHE.setdefault(key[0], {})[key[1:]] = analysis
    return analysis
