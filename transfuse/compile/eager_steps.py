"""``generate`` on a rewritten model that is not compiled: its decode steps as CUDA graphs of the eager forward.

``decode_steps(model)`` (``transfuse.decode_steps``) turns this on for one rewritten model; the
drop-in loader calls it. ``transfuse.rewrite`` does not: a rewrite changes the model and nothing
else. The first call in a process wraps transformers' decoding loops and its deferred stop check
(``generate.serve``); the loops of every model not given decode steps run as transformers wrote them.

An eager decode step of a small model is the host's work: at Qwen3-MoE's shapes the GPU is busy
about 0.24 ms a token and the host issues some 600 torch ops for it, so the token takes 3.5-5.6 ms
on an H200 whatever the kernels do. The pieces that take the host off the GPU's way exist for the compile path: the attention op that
writes a token's key and value into a ``KVStore`` and attends there (every shape and address of
a step fixed), whole calls captured as one CUDA graph (``replay.CallGraphs``), and closed
decoding loops (``generate.py``), in which only transformers' generation code runs between two
steps. Here they run without Dynamo or Inductor: the graph is a capture of the model's own eager
forward, the same kernels an eager step launches, attention aside.

Inside a closed decoding loop of a rewritten model on CUDA (``refusal`` says when not):

* the prompt's forward runs as usual (the model's forward, its cache, its attention);
* each decode step of one token runs the eager forward with attention through
  ``transfuse::cached_attention`` over a ``KVStore`` (which the cache's layers are views of,
  so the cache stays an ordinary ``DynamicCache``); the second such step is captured as one CUDA
  graph and the rest of the loop replays it: the inputs copied in, one launch, the outputs
  copied out;
* ``generate`` reads its stop flag one step late (``DeferredStopCheck``, as for compiled models)
  and greedy or sampling loops that return only tokens run in transfuse's lean loop.

Graphs are replayed only in the loop that captured them, and the loop's stores and graphs are
dropped when it ends: an eager forward reads things on the host that no check here sees (an
adapter switched, an attribute set on a module, a config value), and none of them can change
between two steps of a closed loop. The cost is a capture per ``generate`` call (one eager
forward under capture). A step whose capture fails (code that synchronises with the host, such
as ``.item()``) runs eagerly through the store for the rest of the loop, with one warning.

One loop of a model at a time takes the path: another thread's ``generate`` of the model
meanwhile runs as usual (refused, saying why), and its calls of the model, which reach the
running loop's object, go to the model's own forward.

Not taken (``refusal``): a model whose decode steps were not turned on (``decode_steps``), one
compiled (``torch.compile``, ``model.compile()`` or ``transfuse.compile``, which has its own
path), in training mode, with weights not all on the current CUDA device (offloaded, sharded,
another device), forward hooks other than transformers' own output recorders, accelerate's
hooks, a loop whose cache is not transformers' dynamic one (a static cache is served by
transformers' own compiled call), a loop of fewer than ``MIN_NEW_TOKENS`` new tokens (the capture
would cost more than its replays save), attention the op cannot run (``transfuse.compile``'s
own refusals: flash attention, cache layers that are not key/value layers), or a model whose
earlier loop found a layer the store cannot serve (a window, soft-capping, sinks, or a cache
that holds something else than the keys and values attended to: latent attention's latents; that
loop's steps ran the model's own forward).
``TRANSFUSE_STEP_GRAPHS=0`` turns this off alone,
``TRANSFUSE_DECODE_GRAPHS=0`` (or ``ops.graphs.suspended()``) with the eager layer graphs, for
every model given decode steps.
``stats(model)`` counts the loops this ran and the steps replayed, and says why the latest loop
was refused or its capture failed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from .. import settings
from ..api import is_rewritten
from ..ops import graphs
from . import attention, generate, layer_graphs, replay
from .admission import CompileError, check
from .calls import DecodeCalls

__all__ = ["ENV", "EagerSteps", "decode_steps", "refusal", "stats"]

M = TypeVar("M", bound=nn.Module)

ENV = "TRANSFUSE_STEP_GRAPHS"
# On unless ``TRANSFUSE_STEP_GRAPHS=0``. On an H200 ``tests/test_eager_steps.py -m gpu`` passes, the
# other decode, MoE and model GPU tests pass with it on, and ``benchmarks/bench_decode.py``
# measured a Qwen3-MoE-shaped token at 0.457 ms with it against 3.821 without, a Llama-3-8B-shaped
# one (8 layers) at 1.336 against 6.587 (``benchmarks/results/h200_decode_*_step_graphs_2026-12-05.md``).
ON_BY_DEFAULT = settings.SWITCHES[ENV].default
# Loops that make fewer new tokens run as usual: a capture (an eager step's time and a device
# synchronisation) is paid back only over several replays. A guess, to be set from a measurement
# (``stats(model)["capture_s"]`` against the step's time).
MIN_NEW_TOKENS = 8
# Whether decode steps go through a store: None on CUDA (where graphs replay them), True on any
# device (the tests' way to run the path's steps without graphs on a CPU).
STORE: bool | None = None

# Held while a loop makes a model's calls its own (``EagerSteps.installed``).
_CLAIMING = threading.Lock()
# Per model: why a loop's call through the path failed where the model's own forward did not
# (``DecodeCalls._abandon``); its later loops run as usual.
_ABANDONED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
# Per model: why an earlier loop's decode steps could not go through a store (a layer's attention
# needs more than it gives: ``kv_store.StoreUnusable``); its later loops run as usual.
_STORE_REFUSED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
# Per model: what the loops did (``stats``).
_STATS: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def decode_steps(model: M) -> M:
    """Turn on the decode steps of ``model``, which ``transfuse.rewrite`` rewrote, and return it: on a
    GPU, ``generate``'s closed decoding loops of this model run their decode steps as CUDA graphs of
    its eager forward (see the module docstring for when they do not; ``stats`` says why), and its
    fused MoE layers replay small batches as CUDA graphs elsewhere (``layer_graphs``). Other models
    are not touched. ``transfuse.AutoModelForCausalLM`` calls this for the models it loads."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"decode_steps() takes a torch.nn.Module, not {type(model).__name__}.")
    if not is_rewritten(model):
        raise ValueError(
            f"decode_steps() takes a model that transfuse.rewrite rewrote, and this {type(model).__name__} "
            "was not: call transfuse.rewrite(model) first."
        )
    generate.serve(model, for_loop)
    layer_graphs.enable(model)
    return model


def stats(model: nn.Module) -> dict[str, Any]:
    """``loops``: closed loops whose steps went through this path; ``steps``: decode steps through
    a store; ``replays``: those replayed as graphs; ``capture_s``: the host's seconds capturing
    them (a capture per loop, and another where the store grows); ``refused``: why the latest loop
    did not (None: it did); ``failed``: why the latest failed capture failed."""
    return dict(_STATS.get(model) or _fresh())


def _fresh() -> dict[str, Any]:
    return {"loops": 0, "steps": 0, "replays": 0, "capture_s": 0.0, "refused": None, "failed": None}


def _record(model: nn.Module) -> dict[str, Any]:
    found = _STATS.get(model)
    if found is None:
        found = _STATS[model] = _fresh()
    return found


def refusal(model: nn.Module) -> str | None:
    """Why a closed decoding loop of ``model`` cannot run its steps as graphs now, or None."""
    return _admission(model)[0]


def _admission(model: nn.Module) -> tuple[str | None, list[Any]]:
    """(``refusal``, the configs whose attention the path switches: empty when refused)."""
    named = list(model.named_modules())  # (walked once: a walk costs more than all the rest)
    why = _refused(model, named)
    if why is not None:
        return why, []
    modules = [module for _, module in named]
    try:
        configs = check(model, modules)
    except CompileError as exc:
        return str(exc).replace("transfuse.compile", "the decode path", 1), []
    devices = {
        t.device
        for module in modules
        for tensors in (module._parameters, module._buffers)
        for t in tensors.values()
        if t is not None
    }
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "the model's weights are not all on one CUDA device", []
    if next(iter(devices)).index != torch.cuda.current_device():
        return "the model's weights are not on the current CUDA device", []
    return None, configs


def _refused(model: nn.Module, named: list[tuple[str, nn.Module]] | None = None) -> str | None:
    """The refusals that need neither the configs nor the weights (``named``: the model's
    ``named_modules()``, where the caller has them)."""
    if not settings.value(ENV):
        chosen = os.environ.get(ENV, "").strip()
        return f"turned off ({ENV}={chosen})" if chosen else f"off ({ENV}=1 turns it on)"
    if not graphs.enabled():
        return "turned off (TRANSFUSE_DECODE_GRAPHS=0 or ops.graphs.suspended())"
    if generate.served_by(model) is not for_loop:
        return "its decode steps are not turned on (transfuse.decode_steps(model) turns them on)"
    abandoned = _ABANDONED.get(model)
    if abandoned is not None:
        return f"a call of an earlier loop through the path failed where the model's own forward did not ({abandoned})"
    store_refused = _STORE_REFUSED.get(model)
    if store_refused is not None:
        return f"an earlier loop's decode steps could not go through a key/value store ({store_refused})"
    running = model.__dict__.get("_compiled_call_impl")
    if isinstance(running, EagerSteps):
        return "another generate call of this model runs its steps through the path now (in another thread)"
    if running is not None:
        return "the model is compiled"
    if model.training:
        return "the model is in training mode"
    if torch.is_grad_enabled():
        return "autograd is recording"
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return "global forward hooks are registered (a hook would run once, at the capture)"
    for name, module in named if named is not None else model.named_modules():
        if "_hf_hook" in module.__dict__:
            return f"{name or 'the model'} has accelerate's hooks (they move weights or inputs in Python)"
        hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
        if any(not _records_outputs(hook) for hook in hooks):
            return f"{name or 'the model'} has a forward hook (it would run once, at the capture)"
    return None


def _records_outputs(hook: Any) -> bool:
    """transformers' output recorder: it records only when the forward is asked for attentions or
    hidden states (a closed loop's steps are asked the same at every step, and a recorded tensor
    is copied out of the graph with the output)."""
    return getattr(hook, "__module__", "").startswith("transformers.") and "output_capturing_hook" in getattr(
        hook, "__qualname__", ""
    )


class EagerSteps(DecodeCalls):
    """One closed loop's calls of a rewritten model: installed as its ``_compiled_call_impl``
    for the loop (``installed``), so the loop's ``self(...)`` comes here."""

    _PATH = "store"
    _STORELESS_CALLS = False

    def __init__(self, model: nn.Module, configs: list[Any]):
        super().__init__(
            model, configs, {"kv_store": STORE, "cuda_graphs": True, "deferred_stop": True, "lean_loop": True}
        )
        attention.register()
        self.compiled = model._call_impl
        self.call_graphs = replay.CallGraphs(model, None)
        self.thread = threading.get_ident()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self.thread:
            # Another thread's call of the model while this loop runs: the model's own forward,
            # never while a step of the loop runs (the step switches the configs' attention
            # implementation to the path's, which that forward would read: one call at a time).
            with self._calling:
                return self.model._call_impl(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _eager(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        output = super()._eager(model, args, kwargs)
        # The prompt's forward: ``generate`` may defer its stop check with the cache it returns.
        cache = output.get(self.cache_name) if isinstance(output, dict) else None
        if cache is not None and self._dynamic(cache):
            generate.mark(cache)
        return output

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The loop's calls come here; afterwards the model is as it was, the stores and graphs dropped."""
        model = self.model
        record = _record(model)
        with _CLAIMING:  # (two threads may both have found the model free)
            taken = model.__dict__.get("_compiled_call_impl") is not None
            if not taken:
                model._compiled_call_impl = self
        if taken:  # as usual: its calls reach the other loop's object, which hands them to the model
            record["refused"] = _refused(model)
            yield
            return
        record["refused"] = None
        record["loops"] += 1
        try:
            with self.closed_loop():
                yield
        finally:
            model._compiled_call_impl = None
            record["steps"] += self.calls[self._PATH]
            record["replays"] += self.call_graphs.replays
            record["capture_s"] += self.call_graphs.capture_seconds
            if self.call_graphs.failed is not None:
                record["failed"] = self.call_graphs.failed
            if self.abandoned is not None:
                record["failed"] = _ABANDONED[model] = self.abandoned
            if self.store_refused is not None:  # (its steps ran the model's own forward)
                _STORE_REFUSED[model] = self.store_refused
                record["refused"] = f"its decode steps could not go through a key/value store ({self.store_refused})"
            for store in self.stores.values():
                store.retire()
            self.stores.clear()
            self.call_graphs = replay.CallGraphs(model, None)


def _most_new_tokens(arguments: dict[str, Any]) -> int | None:
    """The most tokens the loop can add (its length criterion less the prompt), or None."""
    length = getattr(arguments.get("stopping_criteria"), "max_length", None)
    ids = arguments.get("input_ids")
    if length is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    return length - ids.shape[1]


def for_loop(model: nn.Module, arguments: dict[str, Any]) -> EagerSteps | None:
    """The path for a closed decoding loop of ``model`` starting now (``arguments``: the loop's,
    by name), or None (why: ``stats``)."""
    why, configs = _admission(model)
    model_kwargs = arguments.get("model_kwargs") or {}
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if why is None and cache is not None and not EagerSteps._dynamic(cache):
        # (a static cache also makes transformers compile the model's call for the loop)
        why = f"the cache is a {type(cache).__name__}, not transformers' dynamic one"
    new = _most_new_tokens(arguments)
    if why is None and new is not None and new < MIN_NEW_TOKENS:
        why = f"the loop makes at most {new} new tokens, fewer than {MIN_NEW_TOKENS} (a capture would not pay for itself)"
    if why is not None:
        _record(model)["refused"] = why
        return None
    return EagerSteps(model, configs)
