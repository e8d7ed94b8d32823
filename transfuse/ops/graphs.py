"""Replay a layer's forward as a CUDA graph at small token counts, where host cost dominates.

A decode step hands an MoE block one token. Its GPU work is tens of microseconds, but
issuing it from Python (the router matmul, the routing and expert kernels, their
allocations and checks) costs several times that, so an eager model waits on its host.
``SmallBatchGraphs`` captures the forward once per input shape and afterwards copies the
input into the captured buffer, replays, and returns copies of the outputs: a handful of
host calls instead of dozens.

It is used only where replay cannot differ from running the code (``graphable``): CUDA
inputs; no autograd to record; not under ``torch.compile`` or inside another capture; no
forward hooks anywhere in the layer (a hook would run once, at capture). A captured graph
reads the weights by address, so the key includes every parameter's and buffer's data
pointer: weights changed in place are read as they are, weights replaced (``.to()``,
loading new tensors) mean a new capture. It also includes the dispatch generation
(``transfuse.ops.dispatch.generation()``): a graph replays the providers chosen when it
was captured, so changing them means a new capture. All graphs on a device share one
memory pool: replays are sequential on a stream and each output is copied out before the
next replay. Code that synchronises with the host (the native MoE experts read their group
sizes) cannot be captured: the warm-up call runs with synchronisations made errors, and a
shape whose warm-up or capture fails runs eagerly from then on. Replays run no Python, so
``transfuse.ops.trace()`` records the calls of a capture, not of its replays.

``TRANSFUSE_DECODE_GRAPHS=0`` turns this off.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import dispatch

__all__ = ["SmallBatchGraphs", "enabled"]

_POOLS: dict[int, Any] = {}


def enabled() -> bool:
    return os.environ.get("TRANSFUSE_DECODE_GRAPHS", "1") != "0"


def _pool(device: int) -> Any:
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


def _hooked(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _copy_out(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_copy_out(v) for v in value)
    return value


class SmallBatchGraphs:
    """CUDA graphs of ``forward(x)`` for a layer, one per input shape and dtype and weights."""

    def __init__(self, layer: nn.Module, forward: Callable[[Tensor], Any], max_tokens: int):
        self.layer = layer
        self.forward = forward
        self.max_tokens = max_tokens
        self.failed: str | None = None  # why the last capture that failed did
        self._failed_keys: set[tuple] = set()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor, Any]] = {}

    def graphable(self, x: Tensor) -> bool:
        if not x.is_cuda or not enabled():
            return False
        if x.numel() > self.max_tokens * x.shape[-1] or x.numel() == 0:
            return False
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.layer.parameters())):
            return False
        return not _hooked(self.layer)

    def _key(self, x: Tensor) -> tuple:
        tensors = (*self.layer.parameters(), *self.layer.buffers())
        return (
            x.shape, x.stride(), x.dtype, x.device.index, dispatch.generation(), tuple(t.data_ptr() for t in tensors)
        )  # fmt: skip

    def __call__(self, x: Tensor) -> Any:
        """The forward's outputs for ``x`` (call only when ``graphable(x)``)."""
        key = self._key(x)
        entry = self._graphs.get(key)
        if entry is None:
            entry = None if key in self._failed_keys else self._capture(x, key)
            if entry is None:
                return self.forward(x)
        graph, static_x, static_out = entry
        static_x.copy_(x)
        graph.replay()
        return _copy_out(static_out)

    def _capture(self, x: Tensor, key: tuple) -> tuple | None:
        static_x = x.clone()
        sync_mode = torch.cuda.get_sync_debug_mode()
        try:
            # Warm up off the capturing stream (first calls compile kernels and create handles),
            # with host synchronisations made errors: code that has them cannot be captured.
            stream = torch.cuda.Stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.cuda.stream(stream):
                    self.forward(static_x)
            finally:
                torch.cuda.set_sync_debug_mode(sync_mode)
            torch.cuda.current_stream(x.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=_pool(x.device.index)):
                static_out = self.forward(static_x)
        except Exception as exc:  # noqa: BLE001 - any failure means: run this shape eagerly
            first = self.failed is None
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._failed_keys.add(key)
            if first:
                warnings.warn(
                    f"transfuse: {type(self.layer).__name__} runs eagerly at {tuple(x.shape)}: capturing it as a "
                    f"CUDA graph failed ({self.failed}).",
                    stacklevel=3,
                )
            return None
        # Graphs of replaced weights or of an earlier dispatch generation are never replayed again.
        self._graphs = {k: v for k, v in self._graphs.items() if k[4:] == key[4:]}
        self._graphs[key] = (graph, static_x, static_out)
        return self._graphs[key]
