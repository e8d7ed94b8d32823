"""Replay a layer's forward as a CUDA graph at small token counts, where host cost dominates.

A decode step hands an MoE block one token. Its GPU work is tens of microseconds, but
issuing it from Python (the router matmul, the routing and expert kernels, their
allocations and checks) costs several times that, so an eager model waits on its host.
``SmallBatchGraphs`` captures the forward of an input shape the second time it sees that
shape (a decode step repeats its shape; a verification probe or an odd prompt length does
not) and afterwards copies the input into the captured buffer, replays, and returns copies
of the outputs: four host calls instead of dozens.

It is used only where replay cannot differ from running the code (``graphable``): inputs on
the current CUDA device; no autograd to record; not under ``torch.compile`` or inside another
capture; no forward hooks on the layer's children (a hook would run once, at capture; hooks
on the layer itself run around every call as usual). A captured graph reads the weights by
address, so the key holds the data pointer of each of the layer's parameters and buffers
(by the names they had at the first call): weights changed in place are read as they are,
weights replaced (``.to()``, loading new tensors, ``p.data = ...``) mean a new capture. The
key also holds the dispatch generation (``transfuse.ops.dispatch.generation()``): a graph
replays the providers chosen when it was captured, so changing them means a new capture.

Graphs are captured per CUDA stream, and the graphs of one stream on one device share one
memory pool: replays on a stream run one after another, and each output is copied out
before the next. Code that reads device values on the host (``.item()``, a copy to the CPU)
cannot be captured: the warm-up call runs with such reads made errors (in its own thread only),
and a shape whose warm-up or capture fails runs eagerly from then on (with one warning per
layer). Replays run no Python, so ``transfuse.ops.trace()`` records the calls of a capture,
not of its replays.

``TRANSFUSE_DECODE_GRAPHS=0`` turns this off; ``suspended()`` turns it off inside a block. Both
also turn off the graphs of whole decode steps that ``generate`` replays for a rewritten model
(``transfuse/compile/eager_steps.py``), inside which these layer graphs are not used.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_globals
from torch.utils._python_dispatch import TorchDispatchMode

from .. import settings
from . import dispatch
from .platform import current_stream_handle as _raw_stream

__all__ = ["HostRead", "SmallBatchGraphs", "capture", "copy_out", "enabled", "graph_pool", "suspended"]

# One memory pool per (device, stream).
_POOLS: dict[tuple[int, int], Any] = {}
# Keys seen once and not yet captured, per layer, at most this many (older ones are forgotten).
_MAX_SEEN = 64
# Nesting depth of ``suspended()``.
_SUSPENDED = 0


def enabled() -> bool:
    return _SUSPENDED == 0 and settings.value("TRANSFUSE_DECODE_GRAPHS")


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Calls inside run their code: none is counted as a sighting, captured or replayed."""
    global _SUSPENDED
    _SUSPENDED += 1
    try:
        yield
    finally:
        _SUSPENDED -= 1


def graph_pool(device: int, stream: int) -> Any:
    """The pool id that graphs of this device and stream are captured into (these layer graphs
    and the compile path's pieces alike). A ``MemPool`` holds a
    reference to its pool while it lives (kept here for the process), so the pool outlives the
    graphs captured into it: a bare ``graph_pool_handle``'s pool is released with its last graph
    (a layer's graphs go when the layer does), and the next capture into that handle then fails
    the caching allocator's assertion (``use_count > 0``)."""
    key = (device, stream)
    if key not in _POOLS:
        if hasattr(torch.cuda, "MemPool"):
            with torch.cuda.device(device):
                _POOLS[key] = torch.cuda.MemPool()
        else:
            _POOLS[key] = torch.cuda.graph_pool_handle()
    pool = _POOLS[key]
    return pool.id if hasattr(pool, "id") else pool


# One capture at a time in this process (torch's captures share one side stream per device).
_CAPTURING = threading.RLock()


@contextlib.contextmanager
def capture(graph: Any, pool: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)``, one capture in the process at a time, in CUDA's
    thread-local capture mode (as Inductor captures): what other threads issue meanwhile (another
    model's steps, a copy on a side stream) neither fails nor invalidates the capture, and what
    this thread issues that a capture cannot hold (a host synchronisation) fails it as before."""
    with _CAPTURING, torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        yield


class HostRead(RuntimeError):
    """An op that reads a CUDA tensor's values on the host, where a capture cannot hold one."""


# Ops whose result needs the device's values on the host (``.item()``, ``bool(t)``, shapes that
# depend on values).
_HOST_READS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
})


class _NoHostReads(TorchDispatchMode):
    """Inside, an op that reads a CUDA tensor's values on the host raises ``HostRead``: in this
    thread only (``torch.cuda.set_sync_debug_mode`` is the whole process's, and would fail another
    thread's ``.item()`` meanwhile). The ops inside transfuse's own library ops are looked at too.
    ``device_type``: where the values read live (the tests' CPU stands in for the GPU)."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.name().split(".")[0]
        if name in _HOST_READS or _copies_to_host(name, args, kwargs):
            if any(isinstance(a, Tensor) and a.device.type == self.device_type for a in args):
                raise HostRead(f"{func} reads a {self.device_type} tensor's values on the host")
        inside = _library_function(func)
        if inside is not None:
            with self:
                return inside(*args, **kwargs)
        return func(*args, **kwargs)


def _copies_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy to the host, or indexing by a boolean mask (its shape is the mask's count)."""
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name == "aten::_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"
    if name == "aten::copy_":
        return isinstance(args[0], Tensor) and args[0].is_cpu
    return False


def _library_function(func: Any) -> Callable[..., Any] | None:
    """The Python function behind a ``transfuse::`` library op, or None."""
    if getattr(func, "namespace", None) != "transfuse":
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:  # another torch's internals: the op is looked at as one
        return None
    definition = _maybe_get_opdef(func)
    return None if definition is None else getattr(definition, "_init_fn", None)


def input_buffer(value: Tensor) -> Tensor:
    """A graph's own copy of an input, with the input's strides: a compiled function's code may
    assume them (a column of a wider tensor, ``ids[:, -1:]``, is not made contiguous). An input
    whose elements share memory (an expanded tensor) cannot be written as such: a dense copy."""
    buffer = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    try:
        return buffer.copy_(value)
    except RuntimeError:  # overlapping elements (stride 0): no copy can be written into them
        return value.clone()


def copy_out(value: Any) -> Any:
    """``value`` with its tensors cloned (out of a graph's buffers, which the next replay
    overwrites), through tuples and lists."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(copy_out(v) for v in value)
    return value


class SmallBatchGraphs:
    """CUDA graphs of ``forward(x)`` for a layer: one per input shape, dtype, stream and set of weights."""

    def __init__(self, layer: nn.Module, forward: Callable[[Tensor], Any], max_tokens: int):
        self.name = type(layer).__name__  # not the layer: the graphs are kept in a weak table keyed by it
        self.forward = forward
        self.max_tokens = max_tokens
        self.failed: str | None = None  # why the last capture that failed did
        self._failed_keys: set[tuple] = set()
        self._seen: dict[tuple, None] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor, Any]] = {}
        self._lock = threading.Lock()
        # The layer's children and its tensors' (dict, name) slots, read once: walking the module
        # tree costs more per call than everything else here.
        self._children = tuple(layer.modules())[1:]
        self._slots = tuple(
            (tensors, name)
            for module in layer.modules()
            for tensors in (module._parameters, module._buffers)
            for name in tensors
        )

    def _tensors(self) -> list[Tensor]:
        return [t for t in (tensors.get(name) for tensors, name in self._slots) if t is not None]

    def graphable(self, x: Tensor) -> bool:
        if not x.is_cuda or not enabled():
            return False
        if x.get_device() != torch.cuda.current_device():  # a graph replays on the current device's stream
            return False
        if x.numel() > self.max_tokens * x.shape[-1] or x.numel() == 0:
            return False
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in self._tensors())):
            return False
        if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self._children)

    def _key(self, x: Tensor) -> tuple:
        device = x.get_device()
        pointers = tuple(t.data_ptr() for t in self._tensors())
        return (x.shape, x.dtype, device, _raw_stream(device), dispatch.generation(), pointers)

    def __call__(self, x: Tensor) -> Any:
        """The forward's outputs for ``x`` (call only when ``graphable(x)``)."""
        key = self._key(x)
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._failed_keys:
                return self.forward(x)
            if key not in self._seen:
                self._remember(key)
                return self.forward(x)
            with self._lock:  # (another thread may have captured it meanwhile)
                entry = self._graphs.get(key)
                if entry is None and key not in self._failed_keys:
                    entry = self._capture(x, key)
            if entry is None:
                return self.forward(x)
        graph, static_x, static_out = entry
        with self._lock:  # another thread's replay of this graph would overwrite its buffers
            static_x.copy_(x)
            graph.replay()
            return copy_out(static_out)

    def _remember(self, key: tuple) -> None:
        self._seen[key] = None
        if len(self._seen) > _MAX_SEEN:
            del self._seen[next(iter(self._seen))]

    def _capture(self, x: Tensor, key: tuple) -> tuple | None:
        self._seen.pop(key, None)
        try:
            entry = self._record(x, key)
        except Exception as exc:  # noqa: BLE001 - any failure means: run this shape eagerly
            first = self.failed is None
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._failed_keys.add(key)
            if first:
                warnings.warn(
                    f"transfuse: {self.name} runs eagerly at {tuple(x.shape)}: capturing it as a "
                    f"CUDA graph failed ({self.failed}).",
                    stacklevel=4,
                )
            return None
        # Graphs of replaced weights or of an earlier dispatch generation are never replayed again.
        self._graphs = {k: v for k, v in self._graphs.items() if k[4:] == key[4:]}
        self._graphs[key] = entry
        return entry

    def _record(self, x: Tensor, key: tuple) -> tuple[torch.cuda.CUDAGraph, Tensor, Any]:
        """(graph, its input buffer, its outputs) of the forward on a copy of ``x``."""
        static_x = x.clone()
        # Warm up off the capturing stream (first calls compile kernels and create handles),
        # with reads of device values on the host made errors: code that has them cannot be
        # captured (and the capture, should one slip through, fails on it too).
        current = torch.cuda.current_stream(x.device)
        stream = torch.cuda.Stream(x.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), _NoHostReads():
            self.forward(static_x)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, graph_pool(key[2], key[3])):
            static_out = self.forward(static_x)
        return graph, static_x, static_out
