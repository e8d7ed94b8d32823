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

A replay still checks what is cheap to check: the model's weights and buffers (listed at the
first capture) are where they were (a weight given new data, ``p.data = ...`` or a ``.to()`` that
moves it, means a new capture, through Dynamo again) and the dispatch generation
(``transfuse.ops.dispatch``) is the same. A parameter object replaced by another is not seen:
that is one of the changes ``trust_modules`` rules out.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.graphs import copy_out, graph_pool
from . import kv_store

__all__ = ["CallGraphs"]


class _Entry:
    def __init__(self, graph: Any, inputs: dict[str, Any], output: Any, weights: tuple[int, ...], generation: int):
        self.graph = graph
        self.inputs = inputs
        self.output = output
        self.weights = weights
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
        self._tensors: list[Tensor] | None = None

    def _weights(self) -> tuple[int, ...]:
        # The tensors are listed once (walking the modules costs 100-300 us, more than the step
        # it guards); their addresses are read at every replay.
        if self._tensors is None:
            model = self.model
            self._tensors = list(itertools.chain(model.parameters(), model.buffers()))
        return tuple(t.data_ptr() for t in self._tensors)

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
        if entry is not None and entry.generation == dispatch.generation() and entry.weights == self._weights():
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
        self._graphs[key] = _Entry(graph, inputs, output, self._weights(), dispatch.generation())
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
