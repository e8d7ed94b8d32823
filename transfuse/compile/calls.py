"""A model's calls through the decode path: transfuse's attention op, and for decode steps a
``KVStore`` and whole-call CUDA graphs.

``DecodeCalls`` is what stands in for a model's call: ``transfuse.compile`` installs one (its
``_Compiled``) as the model's ``_compiled_call_impl``, and a closed decoding loop of a model whose
decode steps are on runs its steps through one (``eager_steps.EagerSteps``). A call the path
does not cover, or one through it that fails, runs the model's own forward; what a failed call
wrote to the cache is put back first.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..ops.dispatch import batch_invariant_mode
from . import attention, generate, kv_store, replay
from .admission import cache_layer_types, dynamic_cache, forward_parameters
from .attention import IMPLEMENTATION

__all__ = ["CacheState", "DecodeCalls", "attention_implementation"]


class _Unserved(RuntimeError):
    """A call's attention layers were not all served by the path's attention op."""



class CacheState:
    """What a call may change in a dynamic cache, kept to put back if the call fails: the list
    of layers and each layer's attributes. Transformers' dynamic layers (plain and sliding
    window, the only ones the path takes: ``DecodeCalls._dynamic``) replace their tensors and
    counts on update and never write into them, so a shallow copy of each layer's attributes
    is the whole state, and the copy costs no tensor memory."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.layers = list(cache.layers)
        self.attributes = [dict(vars(layer)) for layer in self.layers]

    def restore(self) -> None:
        self.cache.layers[:] = self.layers
        for layer, attributes in zip(self.layers, self.attributes):
            vars(layer).clear()
            vars(layer).update(attributes)



class DecodeCalls:
    """A model's calls through transfuse's attention op and, for decode steps on CUDA, a
    ``KVStore`` and whole-call CUDA graphs: what ``transfuse.compile`` installs as the model's
    ``_compiled_call_impl`` (``_Compiled``), and what a closed decoding loop of a rewritten model
    that is not compiled runs its steps through (``eager_steps.EagerSteps``)."""

    # The key of ``calls`` that counts the calls this path runs (the other: "eager").
    _PATH = "compiled"
    # Whether calls without a store run the path (compiled) or the model's own forward.
    _STORELESS_CALLS = True
    # Whether Dynamo traces the path's forward (``_functions``).
    _TRACED = False

    def __init__(self, model: nn.Module, configs: list[Any], options: dict[str, Any]):
        self.model = model
        self.configs = configs
        self.options = options
        self.cache_name = "cache" if "cache" in forward_parameters(model) else "past_key_values"
        self.calls = {self._PATH: 0, "eager": 0}
        # Key/value stores of decode steps by cache layout, the most recently used last.
        self.stores: collections.OrderedDict[tuple, kv_store.KVStore] = collections.OrderedDict()
        # Why decode steps do not use a store (a layer's attention needs more than it gives).
        self.store_refused: str | None = None
        # Why calls run the model's own forward after a call through the path failed (``_abandon``).
        self.abandoned: str | None = None
        # The closed decoding loop running now in each thread (a token of its own; ``loop``).
        self._loops = threading.local()
        self._calling = threading.RLock()
        # Closed decoding loops run by transfuse's lean loop and by transformers' own (``generate.py``).
        self.loops = {"transfuse": 0, "transformers": 0}
        # Set by subclasses: the forward a call of the path runs (with ``use_cache=False``),
        # Dynamo's entries of it (None: no Dynamo), whole calls replayed as CUDA graphs.
        self.compiled: Any = None
        self.dynamo: replay.DynamoEntries | None = None
        self.call_graphs: replay.CallGraphs | None = None
        self.replay_anywhere = False

    def __reduce__(self) -> tuple:
        # A copy or a pickle of a compiled model is the model uncompiled (as nn.Module drops
        # ``_compiled_call_impl`` from its state): compile the copy again to compile it.
        return (_uncompiled, ())

    @property
    def loop(self) -> object | None:
        """The closed decoding loop this thread runs now (a token of its own), or None: a call
        from another thread, while a loop runs, is not one of its steps."""
        return getattr(self._loops, "token", None)

    @contextlib.contextmanager
    def closed_loop(self) -> Iterator[None]:
        """Inside: this thread's calls are the decode steps of one closed decoding loop (``generate.py``)."""
        outer = self.loop
        self._loops.token = object()
        try:
            yield
        finally:
            self._loops.token = outer

    def _eager(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        self.calls["eager"] += 1
        return model._call_impl(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # One call at a time: a call writes the store's position and padding and copies into a
        # graph's buffers, which another thread's call would overwrite before this one's replay.
        with self._calling, self._mode():
            return self._call(args, kwargs)

    def _mode(self) -> contextlib.AbstractContextManager:
        """A batch-invariant model's mode, entered around the whole call: the model's own forward
        enters it too, but inside a compiled call Dynamo traces that ``with`` rather than run it,
        while the library ops and kernels of the compiled code choose their providers and launches
        when they run (a captured graph holds the launches made at its capture)."""
        from ..ops import batch_invariant

        return batch_invariant_mode() if batch_invariant.is_enabled(self.model) else contextlib.nullcontext()

    def _functions(self) -> contextlib.AbstractContextManager:
        """Where the path's forward is traced (``_TRACED``), a batch-invariant model's torch-function
        mode, entered around each call Dynamo sees (the forward, and the check of its guards): Dynamo
        traces the model's class forward with the mode's handlers in place
        (``batch_invariant.CLASS_FORWARD_IN_THE_MODE``). Entered inside the traced code, as the
        model's own forward enters it, the mode's context variable would break the graph (Dynamo
        cannot trace it), and the model's forward would be compiled as a frame of its own: one that
        every transformers model shares, with its recompile limit. The rest of the call (a replay's
        copies) runs without the handlers."""
        from ..ops import batch_invariant

        if self._TRACED and batch_invariant.is_enabled(self.model):
            return batch_invariant.functions_of(self.model)
        return contextlib.nullcontext()

    def _call(self, args: tuple, kwargs: dict) -> Any:
        model = self.model
        if self.abandoned is not None or not self._covers(model, args, kwargs):
            return self._eager(model, args, kwargs)
        given = kwargs
        kwargs = dict(kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        cache = kwargs.pop("cache", None)
        legacy = kwargs.pop("past_key_values", None)
        cache = cache if cache is not None else legacy
        use_cache = kwargs.pop("use_cache", None)
        if use_cache is None:
            use_cache = getattr(model.config, "use_cache", True)
        if cache is None and use_cache:
            cache = dynamic_cache()(config=model.config)
        if cache is not None and not self._dynamic(cache):  # (input_ids is in kwargs now)
            return self._eager(model, (), {**kwargs, self.cache_name: cache, "use_cache": use_cache})
        padding = kwargs.pop("attention_mask", None)
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        seen = cache.get_seq_length() if cache is not None else 0
        if kwargs.get("position_ids") is None:
            positions = torch.arange(seen, seen + inputs.shape[1], device=inputs.device)
            # One row for the batch, as transformers' models make them when given none (an
            # expanded batch would share memory, which a graph's copy of it cannot keep:
            # ``ops.graphs.input_buffer``).
            kwargs["position_ids"] = positions.unsqueeze(0)
        store = self._store(cache, inputs, padding, seen)
        if store is None and not self._STORELESS_CALLS:
            return self._eager(model, args, given)
        self.calls[self._PATH] += 1
        # A step through the store writes nothing to the cache's layers until it ends; any
        # other call writes them as it goes, so their state is kept to undo a failure.
        before = CacheState(cache) if cache is not None and store is None else None

        def run(arguments: dict[str, Any], store: Any = store) -> Any:
            with attention.step(cache, padding, store) as current, attention_implementation(self.configs, IMPLEMENTATION):
                with self._functions():
                    output = self.compiled(use_cache=False, **arguments)
            why = current.unserved()
            if why is not None:
                raise _Unserved(why)
            return output

        def serving(arguments: dict[str, Any]) -> Any:  # the frame's locals as ``run`` calls it
            with attention.step(cache, padding, store), attention_implementation(self.configs, IMPLEMENTATION):
                with self._functions():
                    return self.dynamo.serving({"args": (), "kwargs": {"use_cache": False, **arguments}})

        try:
            try:
                if store is not None and self.call_graphs is not None and (self.replay_anywhere or self.loop is not None):
                    output = self.call_graphs(run, store, kwargs, serving if self.dynamo is not None else None, self.loop)
                else:
                    output = run(kwargs)
            except kv_store.StoreUnusable as exc:
                # Nothing was written to the cache's layers: run the call again the usual way.
                self.store_refused = str(exc)
                self._drop_stores()
                store = None
                if not self._STORELESS_CALLS:
                    self.calls[self._PATH] -= 1  # (the model's own forward runs it)
                    return self._eager(model, args, given)
                before = CacheState(cache)
                output = run(kwargs, None)
        except Exception as exc:  # noqa: BLE001 - the path failed where the model's own way may not
            return self._abandon(model, args, given, before, exc)
        if store is not None:
            store.end(cache, seen + 1)
        if use_cache and hasattr(output, "keys"):
            output[self.cache_name] = cache
        if cache is not None and self.options["deferred_stop"]:
            generate.mark(cache)
        return output

    def _drop_stores(self) -> None:
        for unused in self.stores.values():
            unused.retire()
        self.stores.clear()

    def _abandon(self, model: nn.Module, args: tuple, given: dict, before: CacheState | None, exc: Exception) -> Any:
        """A call through the path raised, or left layers unserved (``attention.Step.unserved``):
        what it wrote to the cache is undone (a store's writes are not the cache's until the
        step ends) and the call runs the model's own way. If that raises too, its error is the
        caller's and the path stays; if not, every later call runs the model's own way
        (``abandoned`` says why, with one warning)."""
        self._drop_stores()
        if before is not None:
            before.restore()
        output = self._eager(model, args, given)
        self.abandoned = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        warnings.warn(
            f"transfuse: {type(model).__name__} runs its own forward from now on, not the decode path: a call "
            f"through the path {'left attention unserved' if isinstance(exc, _Unserved) else 'failed'} "
            f"({self.abandoned}), and the model's own way answered it",
            stacklevel=4,
        )
        return output

    def _store(self, cache: Any, inputs: torch.Tensor, padding: Any, seen: int) -> Any:
        """The ``KVStore`` this call's attention reads and writes (``kv_store.py``), its
        position and padding written; None where the call takes the cache's own path: not a
        decode step of one token after a prompt, a layer that is not a plain dynamic layer (a
        sliding window), a padding mask of another length, or the option off."""
        use = self.options["kv_store"]
        if use is None:
            use = self.options["cuda_graphs"] and inputs.device.type == "cuda"
        if not use or self.store_refused or cache is None or seen == 0 or inputs.shape[1] != 1:
            return None
        if padding is not None and tuple(padding.shape) != (inputs.shape[0], seen + 1):
            return None
        # The store this cache holds views of, if any (nothing is set on the cache: it stays
        # an object that copies and pickles as transformers' own).
        store = next((kept for kept in self.stores.values() if kept.owner() is cache), None)
        if store is None:
            layer_type = cache_layer_types()[0]
            if any(type(layer) is not layer_type for layer in cache.layers):
                return None
            layout = kv_store.signature(cache, seen)
            if layout is None or layout[0][0] != inputs.shape[0]:
                return None
            store = self.stores.pop(layout, None) or kv_store.KVStore(layout)
            self.stores[layout] = store  # the most recent last
            while len(self.stores) > _STORES_KEPT:
                self.stores.pop(next(iter(self.stores))).retire()
        store.begin(cache, padding, seen)
        return store

    def _covers(self, model: nn.Module, args: tuple, kwargs: dict) -> bool:
        if model.training or len(args) > 1:
            return False
        if model._forward_hooks or model._forward_pre_hooks or _global_hooks():
            return False
        if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
            return False
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return False
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            return False
        inputs = args[0] if args else kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        return isinstance(inputs, torch.Tensor)

    @staticmethod
    def _dynamic(cache: Any) -> bool:
        kinds = cache_layer_types()
        return isinstance(cache, dynamic_cache()) and all(type(layer) in kinds for layer in cache.layers)



# Key/value stores a compiled model keeps (one per batch layout; each holds a cache's worth of
# buffers, as a static cache does).
_STORES_KEPT = 2



def _global_hooks() -> bool:
    from torch.nn.modules import module as module_globals

    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks)


def _uncompiled() -> None:
    return None



class attention_implementation:
    """Switch the attention implementation of the given configs for the duration of a call."""

    def __init__(self, configs: list[Any], name: str):
        self.configs = configs
        self.name = name
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        self.saved = [c._attn_implementation_internal for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = self.name

    def __exit__(self, *exc: Any) -> None:
        for c, saved in zip(self.configs, self.saved):
            c._attn_implementation_internal = saved
