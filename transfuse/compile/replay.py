"""Decode steps replayed as whole CUDA graphs without entering Dynamo.

A decode step through a ``KVStore`` is one CUDA graph (``backend.StepGraph``), but reaching it
still goes through the Dynamo-compiled function: its guards, its bytecode before the graph and
the split graph's Python, about 100-200 us a token, which at a MoE model's decode step is a
quarter of the token. ``CallGraphs`` captures the whole compiled call, the host's way to the graph
included, as one CUDA graph per store and input signature (the second time a signature is seen)
and replays it directly: the inputs copied into the graph's own, one launch, the outputs copied
out.

A replay stands for what Dynamo would have run, so before each one it checks:

* that Dynamo would run the same compiled entry: the entry's own guards (``DynamoEntries``),
  evaluated on the call's arguments as Dynamo evaluates them before running an entry. They are
  what notice a global, the grad mode or autocast and, with the module guards on, a changed
  attribute the forward reads through a module (a config value, an epsilon). With the module
  guards on they cost what the rest of Dynamo's way to the graph costs (150-210 us a call on the
  development CPU against 17-26 with ``trust_modules``, ``benchmarks/dynamo_guards.py``; a
  replay of a Qwen3-MoE step with every guard took 0.81 ms a token on the H200, Dynamo 0.73-0.77
  in two runs), so outside a closed decoding loop ``transfuse.compile`` replays by default
  only a model compiled with ``trust_modules=True``;
* that the model's module tree is made of the same objects (``_Snapshot``, taken at the capture):
  every submodule, parameter, buffer and forward hook entry, none added or removed, each module
  in the same training mode, every weight and buffer where it was (new data, ``p.data = ...`` or
  a ``.to()`` that moves it: the graph reads weights by address, which Dynamo's guards do not
  look at, with the module guards on or off); and the dispatch generation
  (``transfuse.ops.dispatch``) is the same.

Inside a closed decoding loop (``generate.py``: transformers' own loop, with nothing of the
caller's run between its steps) these checks are made at a graph's first replay in the loop and
not again: nothing that could change their answer runs between two steps of the loop.

Anything else means the call goes through Dynamo (which recompiles if its guards say so) and
the next call with that signature is captured again. A capture is made only of an entry whose
frame changes nothing outside its graph (``frame_effects``: Dynamo replays such changes in
Python after the graph, which a replay would skip), and whose frame has no graph break (a
resumed frame has guards of its own).
"""

from __future__ import annotations

import operator
import re
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.graphs import capture, copy_out, graph_pool, input_buffer
from . import kv_store

__all__ = ["CallGraphs", "DynamoEntries", "frame_effects"]


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


def frame_effects() -> str | None:
    """Called by a backend while Dynamo compiles a frame: what the frame changes outside its graph,
    which Dynamo's compiled code does in Python after the graph and a replay of the graph would not
    (as a phrase), or None for nothing. Objects the frame creates (its output) do not count, nor
    attributes it sets back to the values they hold (transformers' output collector sets two and
    resets them in every forward). Reads Dynamo's private side-effect records; where they cannot
    be read the answer is that the effects are unknown."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationNew

        effects = InstructionTranslator.current_tx().output.side_effects
        modified = effects._get_modified_vars()
        stores = effects.store_attr_mutations
        if effects.tensor_hooks or effects.save_for_backward:
            return "registers tensor hooks"
        for var in modified:
            if isinstance(var.mutation_type, AttributeMutationNew):
                continue
            owner, changed = getattr(var, "value", None), stores.get(var)
            base_changed = getattr(var, "is_base_vt_modified", None)
            if owner is None or not changed or (base_changed is not None and base_changed(effects)):
                return f"changes {_described(var)}"
            for name, value in changed.items():
                if not (value.is_python_constant() and _same(getattr(owner, name, _MISSING), value.as_python_constant())):
                    return f"sets {_described(var)}.{name}"
    except Exception as exc:  # noqa: BLE001 - another torch version's internals
        return f"unknown (Dynamo's side-effect records unreadable: {type(exc).__name__})"
    return None


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # noqa: BLE001 - a comparison that does not give a bool
        return False


def _described(var: Any) -> str:
    """A variable's source as a reader names it: ``model.model.norm`` for Dynamo's
    ``L['model']._modules['model']._modules['norm']``."""
    try:
        name = var.source.name
    except Exception:  # noqa: BLE001 - a source without a name
        return type(var).__name__
    name = name.replace("L['model']", "model")
    return re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)


class DynamoEntries:
    """Dynamo's compiled entries of one function: which one Dynamo would run for a call (its
    guards evaluated on the call's locals, as Dynamo evaluates them, without running anything),
    and what each entry's frame changes outside its graph (``record``, called by the backend
    while Dynamo compiles). Uses Dynamo's private cache-entry list; where a torch version lacks
    it, ``available`` is False and no entry is ever found."""

    def __init__(self, function: Callable[..., Any], model: nn.Module | None = None):
        self.code = function.__code__
        # The model every call passes as the function's first argument (its local ``model``),
        # which ``serving`` adds to the locals it is given; held weakly, so that whatever keeps
        # this object (the compile backend reaches it) never keeps the model.
        self.model = None if model is None else weakref.ref(model)
        # compile id -> ``frame_effects()`` of that compile (None: nothing outside the graph).
        self.effects: dict[str, str | None] = {}
        self.available = _entry_list() is not None

    def record(self) -> None:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        if compile_id is not None and self.effects.get(str(compile_id)) is None:
            self.effects[str(compile_id)] = frame_effects()

    def serving(self, f_locals: dict[str, Any]) -> Any:
        """The entry Dynamo would run for these locals (the model's, where given, added), as
        (transformed code, compile id), or None."""
        entries = _entry_list()
        if entries is None:
            return None
        if self.model is not None:
            model = self.model()
            if model is None:
                return None
            f_locals = {"model": model, **f_locals}
        try:
            for entry in entries(self.code):
                if entry.guard_manager.check(f_locals):
                    return entry.code, str(entry.compile_id)
        except Exception:  # noqa: BLE001 - a guard that raises fails, as in Dynamo
            return None
        return None

    def refusal(self, served: Any) -> str | None:
        """Why the entry ``serving`` found may not be replayed, or None."""
        if served is None:
            return "no compiled entry of Dynamo's would run this call"
        code, compile_id = served
        if any(name.startswith("__resume_at") for name in code.co_names):
            return "the compiled call has graph breaks (a resumed frame has guards of its own)"
        effects = self.effects.get(compile_id, _UNKNOWN)
        if effects is None:
            return None
        return f"the compiled call {effects} outside its graph"


_UNKNOWN = "unknown (compiled before this model's backend recorded it)"


def _entry_list() -> Callable[[Any], list[Any]] | None:
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return _debug_get_cache_entry_list


class _Entry:
    def __init__(
        self,
        graph: Any,
        inputs: dict[str, Any],
        output: Any,
        snapshot: _Snapshot,
        generation: int,
        code: Any,
        checked_in: object | None,
    ):
        self.graph = graph
        self.inputs = inputs
        self.output = output
        self.snapshot = snapshot
        self.generation = generation
        # The transformed code of Dynamo's entry the capture ran.
        self.code = code
        # The closed decoding loop in which this graph was last checked (None: none).
        self.checked_in = checked_in


Serving = Callable[[dict[str, Any]], Any]


class CallGraphs:
    """Whole compiled calls of one model as CUDA graphs, keyed by store and input signature.

    With ``dynamo`` None the calls are the model's eager forward (``eager_steps.py``): there are
    no Dynamo guards to stand for what the forward reads on the host, so a graph is replayed only
    inside the closed decoding loop it was captured in, and never checked or replayed outside it."""

    def __init__(self, model: nn.Module, dynamo: DynamoEntries | None):
        self.model = model
        self.dynamo = dynamo
        self.failed: str | None = None
        # Why the latest signature seen was not captured (a frame with effects, a graph break).
        self.refused: str | None = None
        self.replays = 0
        # Host time spent capturing (the capture's own synchronisation included), in seconds.
        self.capture_seconds = 0.0
        self._seen: set[tuple] = set()
        self._failed: set[tuple] = set()
        self._graphs: dict[tuple, _Entry] = {}

    def __call__(
        self,
        run: Callable[[dict[str, Any]], Any],
        store: Any,
        kwargs: dict[str, Any],
        serving: Serving | None,
        loop: object | None = None,
    ) -> Any:
        """``run(kwargs)``, or the replay of its graph; ``serving(kwargs)`` is
        ``DynamoEntries.serving`` of the locals ``run`` gives Dynamo, in ``run``'s context (None
        without Dynamo).
        ``loop``: the closed decoding loop this call is a step of (``generate.py``), in which a
        graph checked once is replayed without checking it again."""
        if store.device.type != "cuda" or torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing():
            return run(kwargs)
        dynamo = self.dynamo
        if dynamo is None and loop is None:
            return run(kwargs)
        if dynamo is not None and not dynamo.available:
            return run(kwargs)
        try:
            key = (store.key(), *sorted(
                (name, (tuple(value.shape), value.dtype, value.device) if isinstance(value, Tensor) else value)
                for name, value in kwargs.items()
            ))
            entry = self._graphs.get(key)
        except TypeError:  # an argument that cannot be a key: no graph
            return run(kwargs)
        if entry is not None:
            if entry.generation == dispatch.generation() and (
                (loop is not None and entry.checked_in is loop)
                or (dynamo is not None and entry.snapshot.holds() and _code(serving(kwargs)) is entry.code)
            ):
                entry.checked_in = loop
                for name, buffer in entry.inputs.items():
                    buffer.copy_(kwargs[name])
                entry.graph.replay()
                self.replays += 1
                return _copied(entry.output)
            # Something changed: Dynamo runs this call (and recompiles if it must, outside any
            # capture); the next call of this signature is captured again.
            del self._graphs[key]
            return run(kwargs)
        if key in self._failed:
            return run(kwargs)
        if key not in self._seen:
            self._seen.add(key)
            return run(kwargs)
        served = serving(kwargs) if dynamo is not None else None
        refusal = dynamo.refusal(served) if dynamo is not None else None
        if refusal is not None:
            self._failed.add(key)
            self.refused = refusal
            return run(kwargs)
        return self._capture(run, key, kwargs, store, _code(served), loop)

    def _capture(
        self,
        run: Callable[[dict[str, Any]], Any],
        key: tuple,
        kwargs: dict[str, Any],
        store: Any,
        code: Any,
        loop: object | None,
    ) -> Any:
        inputs = {name: input_buffer(value) for name, value in kwargs.items() if isinstance(value, Tensor)}
        static = {**kwargs, **inputs}
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(store.device)
        started = time.perf_counter()
        try:
            with capture(graph, graph_pool(store.device.index, stream.cuda_stream)):
                output = run(static)
        except kv_store.StoreUnusable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means: this signature goes through Dynamo
            self.capture_seconds += time.perf_counter() - started
            self._failed.add(key)
            if self.failed is None:
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                where = "through Dynamo" if self.dynamo is not None else "eagerly for the rest of this generate call"
                warnings.warn(
                    f"transfuse: decode steps run {where}: capturing a whole call failed ({self.failed})",
                    stacklevel=3,
                )
            return run(kwargs)
        self.capture_seconds += time.perf_counter() - started
        for dead in [k for k in self._graphs if not kv_store.live(k[0])]:
            del self._graphs[dead]
        self._graphs[key] = _Entry(graph, inputs, output, _Snapshot(self.model), dispatch.generation(), code, loop)
        for name, buffer in inputs.items():  # the capture ran nothing: this call is the replay
            buffer.copy_(kwargs[name])
        graph.replay()
        return _copied(output)


def _code(served: Any) -> Any:
    return None if served is None else served[0]


def _copied(output: Any) -> Any:
    """The call's output with its tensors copied out of the graph's memory (the next replay
    writes there); a transformers ``ModelOutput`` stays one."""
    if hasattr(output, "keys") and hasattr(output, "items"):
        return type(output)(**{name: copy_out(value) for name, value in output.items()})
    return copy_out(output)
