"""transfuse's compile path for inference: ``transfuse.compile(model)``.

    model = transfuse.compile(model)          # in place, as model.compile(); returns the model
    transfuse.compile.warm_up(model, batch_sizes=(1,))   # optional: compile and capture now
    model.generate(input_ids, max_new_tokens=128)        # an ordinary DynamicCache

What it does to the model (knowing no model family):
* attention runs as one opaque op that writes the cache and attends
  (``transfuse/compile/attention.py``); the model is called with no cache and no mask of its
  own, so the graph Dynamo captures has the same shapes at every decode step;
* the graph is split at those ops, each piece compiled by Inductor and, on CUDA, replayed
  as a CUDA graph per shape (``transfuse/compile/backend.py``: the ``"transfuse"`` backend
  of ``torch.compile``);
* on CUDA a decode step's keys and values live in buffers with room (a ``KVStore``, which the
  cache's layers are views of), so the whole step, attention included, is one CUDA graph
  (``transfuse/compile/kv_store.py``); the buffers stay with the model between calls, as a
  static cache's do, until ``transfuse.compile.release(model)``;
* inside ``generate``'s own decoding loop (with no streamer but transformers' own text
  streamers, and no processor or stopping criterion of the caller's), such a step is replayed
  as one CUDA graph of the whole call without entering Dynamo: Dynamo's own guards for the
  entry it would run and the model's modules and weights are checked at a captured step's
  first replay in the loop, and not again, since nothing between two steps of that loop can
  change what they check
  (``transfuse/compile/replay.py``, ``transfuse/compile/generate.py``); with
  ``trust_modules=True`` decode steps are replayed outside ``generate`` too;
* ``generate`` on CUDA reads its stop flag one step late, so the host queues the next token
  while the GPU runs this one, and a greedy or sampling loop that returns only tokens runs in a
  lean loop of transfuse's with the same tokens (``transfuse/compile/generate.py``).

The path's cache holds what the attention op is handed: the keys and values attended with. A
model with latent attention (a ``kv_lora_rank``: DeepSeek-V2/V3, MiniCPM3 ...) caches its
compressed latents instead, so compiled its cache grows by every head's keys and values, 9 to
71 times the memory a token; ``compile`` warns with the factor.

Calls the compiled path does not cover run the model's ordinary forward, unchanged: anything
that records autograd or is in training mode, a cache other than transformers' dynamic one,
a 4D mask, ``output_attentions``, positional arguments past ``input_ids``. The model does not
have to be rewritten first, but it is the rewritten model (merged projections, fused ops)
that this path is for.

A rewritten model that is *not* compiled takes the same attention op, stores, whole-call graphs
and loops inside ``generate``'s closed decoding loops on CUDA, with its eager forward captured in
place of a compiled one and no Dynamo (``transfuse/compile/eager_steps.py``): the decode
machinery lives here whichever way the model runs.

``transfuse.compile`` is this package, and calling it calls ``compile`` (the module's class is
made callable), so ``transfuse.compile(model)``, ``transfuse.compile.warm_up(model)`` and
``import transfuse.compile.backend`` all work.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import itertools
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import attention, backend, generate, kv_store, replay
from .attention import IMPLEMENTATION

__all__ = ["CompileError", "compile", "is_compiled", "release", "warm_up"]


class CompileError(ValueError):
    """The model cannot take the compile path; the message says why."""


class _Unserved(RuntimeError):
    """A call's attention layers were not all served by the path's attention op."""


def _register_backend() -> None:
    from torch._dynamo import list_backends, register_backend

    if "transfuse" not in list_backends(exclude_tags=()):
        register_backend(name="transfuse")(backend.compile_graph)


_register_backend()


def _dynamic_cache() -> type:
    from transformers import DynamicCache

    return DynamicCache


@functools.lru_cache(maxsize=1)
def _cache_layer_types() -> tuple[type, ...]:
    from transformers import cache_utils

    return tuple(
        getattr(cache_utils, name) for name in ("DynamicLayer", "DynamicSlidingWindowLayer") if hasattr(cache_utils, name)
    )


class _CacheState:
    """What a call may change in a dynamic cache, kept to put back if the call fails: the list
    of layers and each layer's attributes. Transformers' dynamic layers (plain and sliding
    window, the only ones the path takes: ``_DecodeCalls._dynamic``) replace their tensors and
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


def _latent_cache_growth(config: Any) -> tuple[int, int] | None:
    """(numbers a token and layer in the model's own cache, in the compile path's) for latent
    attention (a ``kv_lora_rank``: the model caches the compressed latent and the shared rotary
    key, and makes every head's key and value from them), or None. The attention op is handed
    the keys and values the model attends with, so that is what the path's cache holds."""
    def number(key: str) -> int | None:
        try:
            found = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute of a heterogeneous config
            return None
        return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None

    keys = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
    rank, rope, nope, value, heads = (number(key) for key in keys)
    if None in (rank, rope, nope, value, heads):
        return None
    own, path = rank + rope, heads * (nope + rope + value)
    return (own, path) if path > own else None


def _check(model: nn.Module, modules: list[nn.Module] | None = None) -> list[Any]:
    """The configs whose attention implementation the compiled calls switch; raises
    ``CompileError`` where the path cannot hold (``modules``: the model's, where the caller has
    them)."""
    from transformers import DynamicCache, PretrainedConfig

    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise CompileError("transfuse.compile takes a transformers model (it has no config)")
    if getattr(config, "is_encoder_decoder", False):
        raise CompileError("transfuse.compile does not take encoder-decoder models (cross-attention has no cache layer of its own)")
    configs: list[Any] = []
    for module in modules if modules is not None else model.modules():
        sub = module.__dict__.get("config")  # (a plain attribute: no ``nn.Module.__getattr__`` miss)
        if isinstance(sub, PretrainedConfig) and all(sub is not c for c in configs):
            configs.append(sub)
    implementations = {c._attn_implementation for c in configs}
    unsupported = implementations - {"sdpa", "eager", None, IMPLEMENTATION}
    if unsupported:
        raise CompileError(
            f"transfuse.compile runs attention itself (SDPA) in place of the model's "
            f"{', '.join(sorted(unsupported))}: load the model with attn_implementation='sdpa'"
        )
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        raise CompileError(f"transfuse.compile: {type(model).__name__} does not decode with transformers' dynamic cache")
    if "position_ids" not in _forward_parameters(model):
        raise CompileError(
            f"transfuse.compile: {type(model).__name__}'s forward takes no position_ids, so it works out its "
            "positions from the cache, which the compiled calls do not hand it"
        )
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # noqa: BLE001 - a config DynamicCache cannot build a cache for
        raise CompileError(f"transfuse.compile: transformers builds no dynamic cache for this config ({exc})") from exc
    kinds = _cache_layer_types()
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in kinds})
    if odd:
        raise CompileError(
            f"transfuse.compile: the model's cache has layers that are not attention key/value "
            f"layers ({', '.join(odd)}); only attention is kept outside the graph"
        )
    return configs


class _DecodeCalls:
    """A model's calls through transfuse's attention op and, for decode steps on CUDA, a
    ``KVStore`` and whole-call CUDA graphs: what ``transfuse.compile`` installs as the model's
    ``_compiled_call_impl`` (``_Compiled``), and what a closed decoding loop of a rewritten model
    that is not compiled runs its steps through (``eager_steps.EagerSteps``)."""

    # The key of ``calls`` that counts the calls this path runs (the other: "eager").
    _PATH = "compiled"
    # Whether calls without a store run the path (compiled) or the model's own forward.
    _STORELESS_CALLS = True

    def __init__(self, model: nn.Module, configs: list[Any], options: dict[str, Any]):
        self.model = model
        self.configs = configs
        self.options = options
        self.cache_name = "cache" if "cache" in _forward_parameters(model) else "past_key_values"
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
        with self._calling:
            return self._call(args, kwargs)

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
            cache = _dynamic_cache()(config=model.config)
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
        before = _CacheState(cache) if cache is not None and store is None else None

        def run(arguments: dict[str, Any], store: Any = store) -> Any:
            with attention.step(cache, padding, store) as current, _implementation(self.configs, IMPLEMENTATION):
                output = self.compiled(use_cache=False, **arguments)
            why = current.unserved()
            if why is not None:
                raise _Unserved(why)
            return output

        def serving(arguments: dict[str, Any]) -> Any:  # the frame's locals as ``run`` calls it
            with attention.step(cache, padding, store), _implementation(self.configs, IMPLEMENTATION):
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
                before = _CacheState(cache)
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

    def _abandon(self, model: nn.Module, args: tuple, given: dict, before: _CacheState | None, exc: Exception) -> Any:
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
            layer_type = _cache_layer_types()[0]
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
        kinds = _cache_layer_types()
        return isinstance(cache, _dynamic_cache()) and all(type(layer) in kinds for layer in cache.layers)


class _Compiled(_DecodeCalls):
    """What ``transfuse.compile`` installs as the model's ``_compiled_call_impl``."""

    def __init__(self, model: nn.Module, configs: list[Any], options: dict[str, Any]):
        super().__init__(model, configs, options)
        entry = _entry(model.forward)
        # Dynamo's compiled entries of ``entry``: which one a call would run, what each changes
        # outside its graph (``replay.py``).
        self.dynamo = replay.DynamoEntries(entry)
        graph_backend = functools.partial(
            backend.compile_graph,
            inductor=options["inductor"],
            cuda_graphs=options["cuda_graphs"],
            static_pointers=self.static_pointers,
            on_frame=self.dynamo.record,
        )
        extra: dict[str, Any] = {}
        if options["trust_modules"] and hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
            extra["options"] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # ``forward``, not ``_call_impl``: some torch versions do not trace into nn.Module's own
        # call and start at the model's forward wrapper instead, which every transformers model
        # shares (see ``_entry``). The model's own hooks are honoured by running those calls
        # eagerly (``_covers``); its submodules' hooks are traced as usual.
        self.compiled = torch.compile(entry, backend=graph_backend, dynamic=options["dynamic"], **extra)
        # Decode steps replayed without entering Dynamo (``replay.py``): inside a closed decoding
        # loop (``generate.py``: Dynamo's guards checked at a captured step's first replay in the
        # loop only), and by default anywhere else only where checking them is cheap
        # (``trust_modules``).
        self.replay_anywhere = options["trust_modules"] if options["replay"] is None else options["replay"]
        replays = options["replay"] is not False
        self.call_graphs = replay.CallGraphs(model, self.dynamo) if replays and options["cuda_graphs"] else None

    def static_pointers(self) -> set[int]:
        model = self.model
        return {t.data_ptr() for t in (*model.parameters(), *model.buffers())}


def _entry(call: Any) -> Any:
    """A function of its own that calls ``call``. Dynamo keeps compiled graphs (and counts them
    against its recompile limit, 8) per code object; every transformers model's forward goes
    through the same few wrapper functions, so without this every compiled model in a process
    would share one budget, and the ninth graph of any of them would run uncompiled."""
    import linecache

    namespace = {"call": call}
    source = "def transfuse_compiled_call(*args, **kwargs):\n    return call(*args, **kwargs)\n"
    filename = f"<transfuse.compile {next(_ENTRIES)}>"
    # With its source known, Dynamo traces the function itself; a function whose source file it
    # cannot find, some torch versions (2.11) wrap in a shared helper, whose budget is shared again.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(builtins.compile(source, filename, "exec"), namespace)  # noqa: S102
    return namespace["transfuse_compiled_call"]


_ENTRIES = itertools.count()
# Key/value stores a compiled model keeps (one per batch layout; each holds a cache's worth of
# buffers, as a static cache does).
_STORES_KEPT = 2


def _global_hooks() -> bool:
    from torch.nn.modules import module as module_globals

    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks)


def _uncompiled() -> None:
    return None


def _forward_parameters(model: nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class _implementation:
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


def compile(  # noqa: A001 - the name users call, as torch.compile
    model: nn.Module,
    *,
    inductor: bool = True,
    cuda_graphs: bool = True,
    dynamic: bool | None = None,
    deferred_stop: bool = True,
    trust_modules: bool = False,
    kv_store: bool | None = None,
    replay: bool | None = None,
    lean_loop: bool = True,
) -> nn.Module:
    """Compile ``model`` in place for inference and return it (see the module docstring).

    ``inductor=False`` runs the pieces as traced (for tests of the split alone),
    ``cuda_graphs=False`` runs them without CUDA graphs, ``dynamic`` is ``torch.compile``'s,
    ``deferred_stop=False`` keeps ``generate``'s stop check on every token, ``kv_store``
    keeps decode steps' keys and values in buffers with room so a whole step is one CUDA graph
    (``transfuse/compile/kv_store.py``; None: on CUDA with ``cuda_graphs``, True: on any device,
    for tests of the store without graphs).

    On CUDA, decode steps through a store inside ``generate``'s own decoding loop are replayed as
    one CUDA graph of the whole call without entering Dynamo (``replay.py``), their checks made at
    the first replay in each ``generate`` call (``generate.py``). ``lean_loop=False`` leaves
    greedy and sampling loops to transformers' ``_sample`` (by default transfuse runs the ones
    that return only tokens and stop at a length or end tokens itself, with less host work a
    token and the same tokens: ``generate.py``).

    ``trust_modules=True`` drops Dynamo's guards on the model's modules (their attributes are
    then not checked before each call; checking them costs about 150 us a call at 8 layers):
    only for a model nothing changes after this call (no new weights by replacement, no dtype
    or device change, no adapters, no attribute set on a module). Its decode steps are then
    replayed outside ``generate`` as well, once Dynamo's remaining guards for the entry it
    compiled pass on the call's arguments (its inputs, globals, the grad mode and autocast) and
    the model's modules and weights are the objects and addresses they were at the capture.
    ``replay`` overrides where steps are replayed: False never (Dynamo at every step), True
    everywhere, with every guard checked outside ``generate`` (which, with the module guards on,
    measured no faster than Dynamo)."""
    configs = _check(model)
    growth = _latent_cache_growth(model.config)
    if growth is not None:
        warnings.warn(
            f"transfuse.compile: {type(model).__name__}'s attention caches its latents ({growth[0]} numbers a token "
            f"and layer); the compiled calls cache every head's keys and values instead ({growth[1]}, "
            f"{growth[1] / growth[0]:.1f}x the cache's memory)",
            stacklevel=2,
        )
    attention.register()
    compiled = _Compiled(
        model,
        configs,
        {
            "inductor": inductor,
            "cuda_graphs": cuda_graphs,
            "dynamic": dynamic,
            "trust_modules": trust_modules,
            "deferred_stop": deferred_stop,
            "kv_store": kv_store,
            "replay": replay,
            "lean_loop": lean_loop,
        },
    )
    model._compiled_call_impl = compiled
    model._transfuse_compiled = compiled
    generate.install_loops()
    if deferred_stop:
        generate.install()
    return model


def is_compiled(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_transfuse_compiled", None), _Compiled)


def release(model: nn.Module) -> None:
    """Drop the key/value stores a compiled model keeps between calls (a cache still holding
    views of one keeps that one's memory as long as the cache lives); the next decode step makes
    a store again and captures its graph again."""
    if not is_compiled(model):
        raise CompileError("release takes a model transfuse.compile compiled")
    compiled = model._transfuse_compiled
    for store in compiled.stores.values():
        store.retire()
    compiled.stores.clear()


def warm_up(
    model: nn.Module,
    batch_sizes: tuple[int, ...] = (1,),
    prompt_length: int = 16,
    new_tokens: int = 4,
) -> dict[int, float]:
    """Compile and capture ahead of time: a short greedy ``generate`` per batch size, on random
    tokens. Returns the seconds each batch size took (compile and capture included)."""
    if not is_compiled(model):
        raise CompileError("warm_up takes a model transfuse.compile compiled")
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    seconds: dict[int, float] = {}
    for batch in batch_sizes:
        ids = torch.randint(0, vocab, (batch, prompt_length), device=device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[batch] = time.perf_counter() - start
    return seconds


class _CallableModule(types.ModuleType):
    """``transfuse.compile(model, ...)`` is ``transfuse.compile.compile(model, ...)``."""

    def __call__(self, model: nn.Module, **options: Any) -> nn.Module:
        return compile(model, **options)


sys.modules[__name__].__class__ = _CallableModule

from . import eager_steps  # noqa: E402 - it builds on ``_DecodeCalls`` above
