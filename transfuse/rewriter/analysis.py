"""Per-class analysis: trace a class once, ask each fuser once, cache both.

The cache key is the class and its children's names and classes, so a decoder layer
with a dense MLP and one with a mixture of experts are analysed separately, and a trace
is reused only for calls with the shapes and dtypes it was made with (a model of another
size is traced again); a trace made from a call that never returned (a probe that stopped
inside the module, as on the meta device, leaves the rest of its trace unknown) is not used
for a call that did. A trace is
specialised on the ``self`` attributes its control flow read (``if self.norm_topk_prob``);
an instance whose attributes differ there gets its own trace, so a cached graph is only
ever used for instances it describes. Nothing per-instance is kept in an analysis:
instance values (eps, shapes) are read by the fusers' ``validate`` and ``fuse``.

A fuser whose pattern spans children (a mixture-of-experts block and its router) reads
their analyses with ``ClassAnalysis.child``; a verdict is reused only while the children
it consulted have the same analyses.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from .capture import Probe, class_key
from .fusion import Fuser, Refusal
from .graph import location
from .tracer import Trace, trace_module, unwrapped_forward

__all__ = ["ClassAnalysis", "analyse", "class_key", "clear_cache"]

logger = logging.getLogger("transfuse")


@dataclass
class ClassAnalysis:
    """What is known about one module class: its traced graph and each fuser's verdict."""

    cls: type
    trace: Trace
    traced_path: str
    had_example: bool
    # The module whose recorded call the trace was made with, where the probe never reached the
    # traced one: another of its class (``analyse``).
    borrowed_from: str | None = None
    # The class key's children: name -> class.
    children: dict[str, type] = field(default_factory=dict)
    # Shapes and dtypes of the recorded call the trace was made with (None without one).
    signature: tuple | None = None
    # Whether that call returned: a probe that stopped inside the module (on the meta device,
    # say) recorded none of what followed, and the rest of the trace carries unknown values.
    returned: bool = False
    # Source rewrites of the class's forward, by the (kind, found) pairs they compose.
    rewrites: dict[tuple, Any] = field(default_factory=dict)
    # fuser kind -> [(analyses of the children the match consulted, verdict)]
    verdicts: dict[str, list[tuple[dict[str, ClassAnalysis | None], Any]]] = field(default_factory=dict)
    # The analyses of the children of the instance being planned (set by ``analyse``).
    _children: Callable[[str], ClassAnalysis | None] | None = field(default=None, repr=False)
    _consulted: dict[str, ClassAnalysis | None] | None = field(default=None, repr=False)

    def verdict(self, fuser: Fuser) -> Any | Refusal | None:
        entries = self.verdicts.setdefault(fuser.kind, [])
        for consulted, found in entries:
            if all(self._child_analysis(name) is analysis for name, analysis in consulted.items()):
                return found
        self._consulted = {}
        try:
            found = fuser.match(self)
        except Exception as exc:  # a matcher's own failure refuses the class, loudly, instead of the rewrite
            logger.warning("transfuse: the %s matcher failed on %s", fuser.kind, self.cls.__name__, exc_info=True)
            found = Refusal(
                f"{fuser.kind}.internal-error",
                f"transfuse's {fuser.kind} matcher failed on this class ({type(exc).__name__}: {exc}); "
                "this is a bug in transfuse, please report it.",
                self.where(),
            )
        entries.append((self._consulted, found))
        self._consulted = None
        return found

    def child(self, name: str) -> ClassAnalysis | None:
        """The analysis of the child module ``name`` (a dotted path below this module) of the
        instance being planned, traced with that child's recorded call; None if there is none."""
        analysis = self._child_analysis(name)
        if self._consulted is not None:
            self._consulted[name] = analysis
        return analysis

    def _child_analysis(self, name: str) -> ClassAnalysis | None:
        return self._children(name) if self._children is not None else None

    def where(self, node: fx.Node | None = None) -> str | None:
        """``file.py:line`` of ``node``, else of the class's forward; None without a source file."""
        loc = location(node) if node is not None else None
        if loc is None:
            code = getattr(unwrapped_forward(self.cls), "__code__", None)
            if code is not None:
                loc = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
        return loc


# class -> rest of the class key -> one analysis per specialisation
_CACHE: "weakref.WeakKeyDictionary[type, dict[tuple, list[ClassAnalysis]]]" = weakref.WeakKeyDictionary()
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


_MISSING = object()


def _describes(analysis: ClassAnalysis, module: nn.Module) -> bool:
    """Whether ``module``'s attributes have the values ``analysis``'s trace was specialised on."""
    for name, seen in analysis.trace.specialisation.items():
        now = getattr(module, name, _MISSING)
        if type(now) is not type(seen) or now != seen:
            return False
    return True


def _child_lookup(module: nn.Module, path: str, probe: Probe) -> Callable[[str], ClassAnalysis | None]:
    """Analyses of ``module``'s descendants by dotted name; weak references, so that a cached
    analysis keeps neither the model nor the probe alive."""
    module_ref, probe_ref = weakref.ref(module), weakref.ref(probe)
    prefix = f"{path}." if path else ""

    def lookup(name: str) -> ClassAnalysis | None:
        owner, current_probe = module_ref(), probe_ref()
        if owner is None or current_probe is None:
            return None
        try:
            child = owner.get_submodule(name)
        except AttributeError:
            return None
        return analyse(child, prefix + name, current_probe)

    return lookup


def _call_signature(call) -> tuple | None:
    """Shapes and dtypes of a recorded call's tensors: Python reads them concretely while tracing
    (``b, s, h = x.shape``), so a trace describes only calls with the same ones."""
    if call is None:
        return None
    leaves, _ = tree_flatten((call.args, call.kwargs))
    return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def analyse(module: nn.Module, path: str, probe: Probe) -> ClassAnalysis:
    """The cached analysis of ``module``'s class, tracing it (with this instance's recorded call) if new.

    An instance the probe never reached (a decoder's cross-attention in a model run without an
    encoder) whose attributes no cached trace was specialised on is traced with the recorded call of
    a reached module of its class key, as verification borrows such a call to check it
    (``checking.prepare``); with none, without values (its trace stops where a value is needed)."""
    key = class_key(module)
    call = probe.calls.get(path)
    signature = _call_signature(call)
    returned = call is not None and call.output is not None
    with _LOCK:
        variants = _CACHE.get(key[0], {}).get(key[1:], [])
        cached = next(
            (
                a
                for a in variants
                if _describes(a, module)
                and (call is None or (a.had_example and a.signature == signature and a.returned >= returned))
            ),
            None,
        )
    if cached is None:
        called_at, borrowed = path, None
        if call is None and (found := probe.call_of_class(key)) is not None:
            borrowed, call = found
            called_at, signature, returned = borrowed, _call_signature(call), True
        example = (call.args, call.kwargs) if call is not None else None
        trace = trace_module(module, example, _children_outputs(called_at, module, probe))
        cached = ClassAnalysis(
            cls=type(module),
            trace=trace,
            traced_path=path,
            had_example=example is not None,
            borrowed_from=borrowed,
            children=dict(key[1]),
            signature=signature,
            returned=returned,
        )
        with _LOCK:
            variants = _CACHE.setdefault(key[0], {}).setdefault(key[1:], [])
            variants[:] = [
                a
                for a in variants
                if a.trace.specialisation != trace.specialisation or a.signature != signature
            ]
            variants.append(cached)
    cached._children = _child_lookup(module, path, probe)
    return cached
