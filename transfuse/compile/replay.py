"""Decode steps replayed without entering Dynamo, for models compiled with ``trust_modules=True``.

A decode step through a ``KVStore`` is one CUDA graph (``backend.StepGraph``), but reaching it
still goes through the Dynamo-compiled function: its guards, its bytecode before the graph and
the split graph's Python, about 100-200 us a token, which at a MoE model's decode step is a
quarter of the token. Dynamo's guards are what notice a model changed after compiling; a model
compiled with ``trust_modules=True`` has promised nothing will (its module guards are off
already). For those, ``CallGraphs`` captures the whole compiled call, the host's way to the graph
included, as one CUDA graph per store and input signature (the second time a signature is seen)
and replays it directly: the inputs copied into the graph's own, one launch, the outputs copied
out.

A replay still checks what is cheap to check (``_Snapshot``, taken at the capture): the model's
module tree is made of the same objects (every submodule, parameter, buffer and forward hook
entry, none added or removed, a parameter replaced by another is seen), each module is in the
same training mode, every weight and buffer is where it was (new data, ``p.data = ...`` or a
``.to()`` that moves it) and the dispatch generation (``transfuse.ops.dispatch``) is the same.
Anything else means the call goes through Dynamo again, and a new capture. What is not checked are the plain attributes the
forward reads (a config value, a scaling factor set on a module): those are the changes
``trust_modules`` rules out.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.graphs import copy_out, graph_pool
from . import kv_store

__all__ = ["CallGraphs"]


class _Snapshot:
    """The objects a model is made of, and where its tensors are, as ``holds`` checks at a replay.

    Walking the modules costs 100-300 us a call, more than the step it guards, so the walk is done
    once and a check reads flat lists with C-level loops (``map``): every ``_modules``,
    ``_parameters``, ``_buffers`` and forward (pre-)hook entry still the same object, each of those
    dicts its size, each module's ``training`` flag, each tensor's data pointer (about 25 us for an
    8-layer Llama's 127 modules on the development CPU, against 5 for the pointers alone)."""

    def __init__(self, model: nn.Module):
        modules = list(model.modules())
        self.dicts = [
            d for m in modules for d in (m._modules, m._parameters, m._buffers, m._forward_hooks, m._forward_pre_hooks)
        ]
        self.sizes = list(map(len, self.dicts))
        entries = [(d, name, value) for d in self.dicts for name, value in d.items()]
        self.holders = [d for d, _, _ in entries]
        self.names = [name for _, name, _ in entries]
        self.values = [value for _, _, value in entries]
        self.modules = modules
        self.training = [m.training for m in modules]
        self.tensors = [v for v in self.values if isinstance(v, Tensor)]
        self.pointers = list(map(Tensor.data_ptr, self.tensors))

    def holds(self) -> bool:
        return (
            list(map(len, self.dicts)) == self.sizes
            and all(map(operator.is_, map(dict.get, self.holders, self.names), self.values))
            and list(map(_TRAINING, self.modules)) == self.training
            and list(map(Tensor.data_ptr, self.tensors)) == self.pointers
        )


_TRAINING = operator.attrgetter("training")


class _Entry:
    def __init__(self, graph: Any, inputs: dict[str, Any], output: Any, snapshot: _Snapshot, generation: int):
        self.graph = graph
        self.inputs = inputs
        self.output = output
        self.snapshot = snapshot
        self.generation = generation


class CallGraphs:
    """Whole compiled calls of one model as CUDA graphs, keyed by store and input signature."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.failed: str | None = None
        self.replays = 0
        self._seen: set[tuple] = set()
        self._failed: set[tuple] = set()
        self._graphs: dict[tuple, _Entry] = {}

    def __call__(self, run: Callable[[dict[str, Any]], Any], store: Any, kwargs: dict[str, Any]) -> Any:
        """``run(kwargs)``, or the replay of its graph."""
        if torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing() or store.device.type != "cuda":
            return run(kwargs)
        try:
            key = (store.key(), *sorted(
                (name, (tuple(value.shape), value.dtype, value.device) if isinstance(value, Tensor) else value)
                for name, value in kwargs.items()
            ))
            entry = self._graphs.get(key)
        except TypeError:  # an argument that cannot be a key: no graph
            return run(kwargs)
        if entry is not None and entry.generation == dispatch.generation() and entry.snapshot.holds():
            for name, buffer in entry.inputs.items():
                buffer.copy_(kwargs[name])
            entry.graph.replay()
            self.replays += 1
            return _copied(entry.output)
        if key in self._failed:
            return run(kwargs)
        if key not in self._seen:
            self._seen.add(key)
            return run(kwargs)
        return self._capture(run, key, kwargs, store)

    def _capture(self, run: Callable[[dict[str, Any]], Any], key: tuple, kwargs: dict[str, Any], store: Any) -> Any:
        inputs = {name: value.clone() for name, value in kwargs.items() if isinstance(value, Tensor)}
        static = {**kwargs, **inputs}
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(store.device)
        try:
            with torch.cuda.graph(graph, pool=graph_pool(store.device.index, stream.cuda_stream)):
                output = run(static)
        except kv_store.StoreUnusable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means: this signature goes through Dynamo
            self._failed.add(key)
            if self.failed is None:
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                warnings.warn(
                    f"transfuse.compile: decode steps go through Dynamo: capturing a whole call failed ({self.failed})",
                    stacklevel=3,
                )
            return run(kwargs)
        for dead in [k for k in self._graphs if not kv_store.live(k[0])]:
            del self._graphs[dead]
        self._graphs[key] = _Entry(graph, inputs, output, _Snapshot(self.model), dispatch.generation())
        for name, buffer in inputs.items():  # the capture ran nothing: this call is the replay
            buffer.copy_(kwargs[name])
        graph.replay()
        return _copied(output)


def _copied(output: Any) -> Any:
    """The call's output with its tensors copied out of the graph's memory (the next replay
    writes there); a transformers ``ModelOutput`` stays one."""
    if hasattr(output, "keys") and hasattr(output, "items"):
        return type(output)(**{name: copy_out(value) for name, value in output.items()})
    return copy_out(output)
