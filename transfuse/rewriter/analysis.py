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
    children: dict[str, type] = field(default_factory=dict)
    verdicts: dict[str, Any] = field(default_factory=dict)
    rewrites: dict[tuple[str, ...], Any] = field(default_factory=dict)
    _instance: Any = None  # weakref to the traced instance, to analyse its children

    def child(self, name: str) -> ClassAnalysis | None:
        """The analysis of a child's class (from the cache, else traced without inputs)."""
        instance = self._instance() if self._instance is not None else None
        child = instance._modules.get(name) if instance is not None else None
        if child is None:
            return None
        key = class_key(child)
        with _LOCK:
            cached = _CACHE.get(key[0], {}).get(key[1:])
        if cached is not None:
            return cached
        return _store(child, f"{self.traced_path}.{name}", trace_module(child), had_example=False)

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
    return _store(module, path, trace, had_example=example is not None)


def _store(module: nn.Module, path: str, trace: Trace, had_example: bool) -> ClassAnalysis:
    key = class_key(module)
    analysis = ClassAnalysis(
        cls=type(module),
        trace=trace,
        traced_path=path,
        had_example=had_example,
        children={name: cls for name, cls in key[1]},
        _instance=weakref.ref(module),
    )
    with _LOCK:
        _CACHE.setdefault(key[0], {})[key[1:]] = analysis
    return analysis
