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
import contextlib
import functools
import itertools
import os
import sys
import time
import types
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ..ops import batch_invariant as invariance
from . import attention, backend, cache, generate, layer_graphs, precompiled, replay
from .admission import CompileError, check, latent_cache_growth
from .calls import DecodeCalls
from . import eager_steps
from .eager_steps import decode_steps
from ..progress import step

__all__ = ["CompileError", "compile", "decode_steps", "eager_steps", "is_compiled", "release", "warm_up"]


def _register_backend() -> None:
    from torch._dynamo import list_backends, register_backend

    if "transfuse" not in list_backends(exclude_tags=()):
        register_backend(name="transfuse")(backend.compile_graph)


_register_backend()


class _Compiled(DecodeCalls):
    """What ``transfuse.compile`` installs as the model's ``_compiled_call_impl``."""

    _TRACED = True

    def __init__(self, model: nn.Module, configs: list[Any], options: dict[str, Any]):
        super().__init__(model, configs, options)
        entry = _entry()
        # Dynamo's compiled entries of ``entry``: which one a call would run, what each changes
        # outside its graph (``replay.py``).
        self.dynamo = replay.DynamoEntries(entry, model)
        # Dynamo's entries of ``entry`` (their guards and compiled graphs) live as long as its code.
        weakref.finalize(self, _forget, entry.__code__).atexit = False
        # Dynamo keeps every backend it is given for the life of the process (to reset it), and
        # with it whatever the backend holds: the backend reaches this object weakly.
        graph_backend = functools.partial(
            backend.compile_graph,
            inductor=options["inductor"],
            cuda_graphs=options["cuda_graphs"],
            static_pointers=_Weakly(self.static_pointers),
            on_frame=_Weakly(self.dynamo.record),
        )
        extra: dict[str, Any] = {}
        if options["trust_modules"] and hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
            extra["options"] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # ``forward``, not ``_call_impl``: some torch versions do not trace into nn.Module's own
        # call and start at the model's forward wrapper instead, which every transformers model
        # shares (see ``_entry``). The model's own hooks are honoured by running those calls
        # eagerly (``_covers``); its submodules' hooks are traced as usual.
        self.torch_compiled = torch.compile(entry, backend=graph_backend, dynamic=options["dynamic"], **extra)
        self.compiled = self._compiled_call
        self.cache_entry: cache.CompileCache | None = None
        self.compilers = "Dynamo, Inductor" if options["inductor"] else "Dynamo; the pieces run as traced"
        # The model's calls as functions kept across processes (``precompiled.py``), where set.
        self.precompiled: precompiled.Precompiled | None = None
        self.announced = False
        # Decode steps replayed without entering Dynamo (``replay.py``): inside a closed decoding
        # loop (``generate.py``: Dynamo's guards checked at a captured step's first replay in the
        # loop only), and by default anywhere else only where checking them is cheap
        # (``trust_modules``).
        self.replay_anywhere = options["trust_modules"] if options["replay"] is None else options["replay"]
        replays = options["replay"] is not False
        self.call_graphs = replay.CallGraphs(model, self.dynamo) if replays and options["cuda_graphs"] else None

    def _compiled_call(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled entry, saying what it compiles: a line before the first call (which
        compiles, and may take long), and the graphs and seconds of each call that compiled."""
        if not self.announced:
            self.announced = True
            self._announce()
        before, start = backend._STATS["graphs"], time.perf_counter()
        with self.cache_entry.recording() if self.cache_entry is not None else contextlib.nullcontext():
            if self.precompiled is not None:
                output = self.precompiled(*args, **kwargs)
            else:
                output = self.torch_compiled(self.model, *args, **kwargs)
        made = backend._STATS["graphs"] - before
        if made:
            step(f"transfuse.compile: compiled {made} graph{'s' * (made > 1)} in {time.perf_counter() - start:.1f} s")
        return output

    def _announce(self) -> None:
        entry, kept = self.cache_entry, self.precompiled
        if kept is not None:
            start = time.perf_counter()
            count = kept.read()
            if count:
                later = f" ({count - kept.loaded} more kept, each loaded at the first call it serves)" if count > kept.loaded else ""
                step(f"transfuse.compile: loaded {kept.loaded} compiled call{'s' * (kept.loaded > 1)} of "
                     f"{type(self.model).__name__} from {kept.path} in {time.perf_counter() - start:.1f} s{later}")
                return
        where = "no compile cache" if entry is None else (
            f"compiled code loaded from {entry.path}" if entry.loaded else f"to be kept in {entry.directory}"
        )
        step(f"transfuse.compile: compiling {type(self.model).__name__} at its first calls ({self.compilers}; {where})")

    def static_pointers(self) -> set[int]:
        model = self.model
        return {t.data_ptr() for t in (*model.parameters(), *model.buffers())}


class _Weakly:
    """A bound method called through a weak reference to its object, for what a compiled model
    hands to torch that torch keeps past the model's life. Only the model's own compiled calls
    call it, so it is not called once the object is gone; if it were, it raises."""

    def __init__(self, method: Any):
        self.method = weakref.WeakMethod(method)
        self.name = method.__qualname__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = self.method()
        if method is None:
            raise CompileError(f"{self.name} called after the model transfuse.compile compiled was freed")
        return method(*args, **kwargs)


def _entry() -> Any:
    """A function of its own, ``transfuse_compiled_call(model, *args, **kwargs)``, that calls
    ``model.forward``. Dynamo keeps compiled graphs (and counts them against its recompile limit,
    8) per code object; every transformers model's forward goes through the same few wrapper
    functions, so without this every compiled model in a process would share one budget, and the
    ninth graph of any of them would run uncompiled. A batch-invariant model's class forward is
    called directly (``batch_invariant.CLASS_FORWARD_IN_THE_MODE``): the call enters the mode around
    it (``DecodeCalls._functions``), where Dynamo does not trace it.

    The model is the function's argument, not a global or a closure's: Dynamo keeps its compiled
    entries on the function's code, and with them their guards and the globals those read, which a
    garbage collection does not see into; a model reached from there would never be freed."""
    import linecache

    namespace: dict[str, Any] = {"InvariantForward": invariance.InvariantForward}
    source = (
        "def transfuse_compiled_call(model, /, *args, **kwargs):\n"
        + invariance.CLASS_FORWARD_IN_THE_MODE
        + "    return model.forward(*args, **kwargs)\n"
    )
    filename = f"<transfuse.compile {next(_ENTRIES)}>"
    # With its source known, Dynamo traces the function itself; a function whose source file it
    # cannot find, some torch versions (2.11) wrap in a shared helper, whose budget is shared again.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(builtins.compile(source, filename, "exec"), namespace)  # noqa: S102
    return namespace["transfuse_compiled_call"]


_ENTRIES = itertools.count()


def _forget(code: types.CodeType) -> None:
    """Drop Dynamo's entries of ``code`` (their guards, transformed code and compiled graphs) once
    the compiled model whose entry function it is is gone. They live on the code, which they keep
    alive in cycles a garbage collection does not see into (Dynamo's map from transformed code to
    the code it came from, the globals its compiled graphs are written into); where a torch
    version lacks the call, they stay, as a stock compiled function's do."""
    try:
        from torch._C._dynamo.eval_frame import reset_code
    except ImportError:
        return
    reset_code(code)


def compile(  # noqa: A001 - the name users call, as torch.compile
    model: nn.Module,
    *,
    inductor: bool | None = None,
    cuda_graphs: bool = True,
    dynamic: bool | None = None,
    deferred_stop: bool = True,
    trust_modules: bool = False,
    kv_store: bool | None = None,
    replay: bool | None = None,
    lean_loop: bool = True,
    batch_invariant: bool | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
) -> nn.Module:
    """Compile ``model`` in place for inference and return it (see the module docstring).

    ``inductor=False`` runs the pieces as traced (the default for a batch-invariant model, see
    below; for other models, for tests of the split alone),
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
    measured no faster than Dynamo).

    ``batch_invariant``: True puts the model in batch-invariant mode (as ``transfuse.rewrite(model,
    batch_invariant=True)`` does), False takes it out, None keeps the model's own; in the mode the
    compiled code calls the dispatched ops as library ops, and, unless ``inductor=True`` is asked
    for, the pieces between them run as traced: every reduction is then the mode's, and every
    elementwise op is the eager kernel, whereas code Inductor generated for an elementwise piece
    was measured giving a row other bits in a batch (``docs/batch-invariance.md``).

    ``cache_dir``: where what Inductor compiles for this model is kept for the next process
    (``transfuse/compile/cache.py``): None for ``TRANSFUSE_CACHE_DIR`` or the user's cache
    directory, False for no cache. The entry is read here and written after ``warm_up`` and when
    the process exits."""
    configs = check(model)
    if batch_invariant:
        invariance.enable(model)
    elif batch_invariant is not None:
        invariance.disable(model)
    if inductor is None:
        inductor = not invariance.is_enabled(model)
    growth = latent_cache_growth(model.config)
    if growth is not None:
        warnings.warn(
            f"transfuse.compile: {type(model).__name__}'s attention caches its latents ({growth[0]} numbers a token "
            f"and layer); the compiled calls cache every head's keys and values instead ({growth[1]}, "
            f"{growth[1] / growth[0]:.1f}x the cache's memory)",
            stacklevel=2,
        )
    attention.register()
    options = {
        "inductor": inductor,
        "cuda_graphs": cuda_graphs,
        "dynamic": dynamic,
        "trust_modules": trust_modules,
        "deferred_stop": deferred_stop,
        "kv_store": kv_store,
        "replay": replay,
        "lean_loop": lean_loop,
    }
    entry = cache.open_for(model, options, cache_dir) if inductor else None
    compiled = _Compiled(model, configs, options)
    compiled.cache_entry = entry
    if entry is not None and not _replays_whole_calls(compiled, model) and precompiled.supported():
        compiled.precompiled = precompiled.Precompiled(
            model, options, compiled.torch_compiled, entry.precompiled_path, _Weakly(compiled.static_pointers)
        )
        entry.precompiled = compiled.precompiled.store
    model._compiled_call_impl = compiled
    model._transfuse_compiled = compiled
    layer_graphs.enable(model)  # (for the calls the compiled path leaves to the model's own forward)
    generate.install_loops()
    if deferred_stop:
        generate.install()
    return model


def _replays_whole_calls(compiled: _Compiled, model: nn.Module) -> bool:
    """Whether decode steps may be replayed as whole-call graphs (``replay.py``: on CUDA, through a
    store), which read Dynamo's own entries of the model's calls."""
    if compiled.call_graphs is None or compiled.options["kv_store"] is False:
        return False
    if compiled.options["kv_store"]:
        return True
    return any(p.device.type == "cuda" for p in itertools.chain(model.parameters(), model.buffers()))


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
    tokens, each announced and timed on the ``transfuse`` logger. Returns the seconds each batch
    size took (compile and capture included). The compile cache's entry is written afterwards."""
    if not is_compiled(model):
        raise CompileError("warm_up takes a model transfuse.compile compiled")
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    seconds: dict[int, float] = {}
    for batch in batch_sizes:
        ids = torch.randint(0, vocab, (batch, prompt_length), device=device)
        step(f"transfuse.compile.warm_up: batch size {batch}: compiling and capturing a prompt of {prompt_length} "
             f"tokens and {new_tokens} decode steps")
        graphs, start = backend._STATS["graphs"], time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[batch] = time.perf_counter() - start
        step(f"transfuse.compile.warm_up: batch size {batch}: {backend._STATS['graphs'] - graphs} graphs compiled, "
             f"{seconds[batch]:.1f} s")
    entry = model._transfuse_compiled.cache_entry
    if entry is not None and entry.save():
        step(f"transfuse.compile.warm_up: compiled code kept in {entry.path}")
    return seconds


class _CallableModule(types.ModuleType):
    """``transfuse.compile(model, ...)`` is ``transfuse.compile.compile(model, ...)``."""

    def __call__(self, model: nn.Module, **options: Any) -> nn.Module:
        return compile(model, **options)


sys.modules[__name__].__class__ = _CallableModule
