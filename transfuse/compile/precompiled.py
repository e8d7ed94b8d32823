"""Dynamo's output kept across processes: a second process runs the model's compiled calls
without tracing the model again and without preparing its graphs again.

``transfuse.compile`` hands Dynamo's whole graph of a call to the ``"transfuse"`` backend, which
splits it at attention and compiles each piece (``backend.py``). Torch's own precompile
(``torch._dynamo.aot_compile``) traces a call once, fullgraph, and keeps the result as a
function with its guards, Dynamo's bytecode and the backend's output, which pickles when the
backend's output says how to (a ``SerializableCallable``). ``SplitGraph`` is that output for the
split graph: the graph between the pieces (pickled by torch.fx's ``GraphPickler``), the attention
pieces as traced, and each compiled piece as AOTAutograd's bundled entry (Inductor's code with
it), which loads without AOTAutograd or Inductor running again.

``Precompiled`` stands for the model's compiled entry: a call runs the first of its functions
whose guards pass; a call none of them serves is traced and compiled here (and kept); past
Dynamo's recompile limit, and wherever this torch has no such functions or a call cannot be
precompiled (a graph break, a guard that cannot be kept), calls go to ``torch.compile``'s own
entry, with one line saying why. The functions are written with the compile cache's entry
(``cache.py``: the same key, in a file of their own) and read back at the first call of a later
process, which loads the first of them then and each other one when a call the loaded ones do not
serve comes.

Guards kept across processes are Dynamo's less those that name an object of this process (its
identity checks) and those on global variables (torch leaves both out of a kept function). The
key of the entry stands for them across processes: it covers the model's classes and source,
its configuration and tensors, the dispatch state and the versions. Within a process the model's
module tree is checked instead (``replay._Snapshot``: every submodule, weight, buffer and hook
the same object, where it was, each module in the same training mode): once it changes, every
call goes through ``torch.compile``'s own entry, with all of Dynamo's guards.

On CUDA with whole-call graphs (``replay.py``), which read Dynamo's own entries of a call,
calls go through ``torch.compile`` as before and only Inductor's artifacts are kept
(``cache.py``).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import inspect
import itertools
import linecache
import pickle
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from . import backend

__all__ = ["Precompiled", "SplitGraph", "supported"]

_MAGIC = b"transfuse-precompiled 1\n"


# The first torch whose kept functions of a model's call were seen to round-trip here. torch 2.11
# has every piece by name but keeps nothing: the function it builds refuses the builtin ``type``
# that Dynamo's code reads ("Missing required external references"), after the call was traced
# for it (traced again for ``torch.compile``'s own entry), and with that worked around a second
# process failed unpickling a guard (``DefaultsSource``). 2.12 was not tried.
_FIRST_KEEPING_TORCH = (2, 13)


def _torch_parts() -> dict[str, Any] | None:
    """torch's precompile pieces this module uses, or None where this torch lacks one or is older
    than ``_FIRST_KEEPING_TORCH``."""
    if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < _FIRST_KEEPING_TORCH:
        return None
    try:
        from torch._dynamo import aot_compile
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable, SerializableCallable
        from torch._dynamo.guards import CheckFunctionManager
        from torch._dynamo.hooks import Hooks
        from torch.fx._graph_pickler import GraphPickler, Options
    except ImportError:
        return None
    compile_fullgraph = getattr(aot_compile, "aot_compile_fullgraph", None)
    function = getattr(aot_compile, "AOTCompiledFunction", None)
    if compile_fullgraph is None or function is None:
        return None
    if not all(hasattr(function, name) for name in ("serialize", "deserialize", "guard_check")):
        return None
    if "f_globals" not in inspect.signature(function.deserialize).parameters:
        return None  # (the objects a kept function's bytecode reads are handed over by name)
    parameters = inspect.signature(compile_fullgraph).parameters
    if not {"hooks", "backend"} <= set(parameters):
        return None
    return {
        "compile": compile_fullgraph,
        "dynamic": "dynamic" in parameters,
        "function": function,
        "bundled": BundledAOTAutogradSerializableCallable,
        "serializable": SerializableCallable,
        "unkept_guards": frozenset(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())),
        "hooks": Hooks,
        "pickler": GraphPickler,
        # Any op pickles by name (transfuse's attention op is registered again at import).
        "pickle_options": Options(ops_filter=None),
    }


@functools.cache
def _parts() -> dict[str, Any] | None:
    return _torch_parts()


def supported() -> bool:
    """Whether this torch keeps Dynamo's output of a call across processes (2.13 and later)."""
    return _parts() is not None


# --- the backend's output, pickled --------------------------------------------------------------

# Seconds this process spent (a benchmark reads them): tracing and compiling calls to keep
# ("compile"), loading kept ones ("load"), and of that, loading Inductor's compiled pieces
# ("inductor_load").
SECONDS = {"compile": 0.0, "load": 0.0, "inductor_load": 0.0}

# What a ``SplitGraph`` being loaded in this thread reads: the model's tensor addresses (its
# CUDA-graphed pieces key on them).
_LOADING = threading.local()


def _serializable_base() -> type:
    parts = _parts()
    return parts["serializable"] if parts is not None else object


class SplitGraph(_serializable_base()):  # type: ignore[misc]
    """The ``"transfuse"`` backend's split graph as something torch's precompile can keep: the
    runnable graph (``backend.assemble``), and what makes it again in another process."""

    def __init__(self, runner: Callable[..., Any], layout: backend.Layout, compiled: dict[str, Any], outputs: dict[str, bool]):
        self.runner = runner
        self.layout = layout
        self.compiled = compiled
        # Per compiled piece: whether it returns one value (Inductor's code returns a sequence).
        self.outputs = outputs

    def __call__(self, *args: Any) -> Any:
        return self.runner(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SplitGraph") -> bytes:
        parts = _parts()
        layout = fn.layout
        pieces = {}
        for name, compiled in fn.compiled.items():
            if getattr(compiled, "serialize", None) is None:
                raise RuntimeError(f"piece {name} of the split graph has no serializable Inductor output")
            pieces[name] = parts["bundled"].serialize_compile_artifacts(parts["bundled"](compiled))
        return pickle.dumps({
            "graph": parts["pickler"].dumps(layout.split, parts["pickle_options"]),
            "layout": layout.pieces,
            "step_graph": layout.step_graph,
            "pieces": pieces,
            "outputs": fn.outputs,
            "vec_isa": _probed_vec_isa(),
        })

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SplitGraph":
        from torch._subclasses import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        parts = _parts()
        state = pickle.loads(data)
        split = parts["pickler"].loads(state["graph"], FakeTensorMode(shape_env=ShapeEnv()))
        compiled = {}
        start = time.perf_counter()
        with _vec_isa_known(state.get("vec_isa")):
            for name, piece in state["pieces"].items():
                loaded = parts["bundled"].deserialize_compile_artifacts(piece)
                compiled[name] = _first(loaded) if state["outputs"][name] else loaded
        SECONDS["inductor_load"] += time.perf_counter() - start
        layout = backend.Layout(split, state["layout"], state["step_graph"])
        runner = backend.assemble(split, layout.pieces, compiled, layout.step_graph, getattr(_LOADING, "static_pointers", None))
        return cls(runner, layout, compiled, state["outputs"])


def _probed_vec_isa() -> str | None:
    """The CPU vector instruction set Inductor built this process's CPU code for, where it has
    probed which sets the compiler builds and the CPU loads (None where it has not: no CPU code)."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    listed = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if not hasattr(listed, "cache_info") or not listed.cache_info().currsize:
        return None
    return str(cpu_vec_isa.pick_vec_isa())


@contextlib.contextmanager
def _vec_isa_known(recorded: str | None):
    """Load a split graph's CPU pieces without Inductor's probe of the CPU's vector instruction
    sets (it builds a test library and loads it in a child Python, in every process that loads CPU
    code: about 0.6 s of a process that only loads kept code), where the entry names the set its
    pieces were built for and the set Inductor picks here without probing is that one. The
    unprobed list is dropped afterwards, so that code compiled later in the process is probed as
    usual. Elsewhere (no CPU pieces, a list already probed, another set): Inductor's own way."""
    try:
        from torch._inductor import config, cpu_vec_isa
    except ImportError:
        yield
        return
    listed = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if recorded is None or not hasattr(listed, "cache_clear") or listed.cache_info().currsize:
        yield
        return
    with config.patch({"cpp.vec_isa_ok": True}):
        same = str(cpu_vec_isa.pick_vec_isa()) == recorded
    listed.cache_clear()
    if not same:
        yield
        return
    try:
        with config.patch({"cpp.vec_isa_ok": True}):
            yield
    finally:
        listed.cache_clear()


def _first(fn: Callable[..., Any]) -> Callable[..., Any]:
    def single(*args: Any) -> Any:
        return fn(*args)[0]

    return single


def _split_backend(options: dict[str, Any], static_pointers: Callable[[], set[int]]) -> Callable[..., Any]:
    def compile_split(gm: fx.GraphModule, example_inputs: list[Any]) -> SplitGraph:
        kept: list[backend.Layout] = []
        runner = backend.compile_graph(
            gm, example_inputs, inductor=True, cuda_graphs=options["cuda_graphs"], static_pointers=static_pointers,
            kept=kept,
        )  # fmt: skip
        return SplitGraph(runner, kept[0], kept[0].compiled, kept[0].single)

    return compile_split


# --- the model's calls --------------------------------------------------------------------------


class _Unkeepable(Exception):
    """A call whose compiled function cannot be kept across processes."""


class Precompiled:
    """The compiled entry of one model's forward (``transfuse.compile``'s ``_Compiled`` calls it
    with keyword arguments): the kept functions first, ``fallback`` (``torch.compile``'s entry)
    where they cannot serve."""

    def __init__(self, model: nn.Module, options: dict[str, Any], fallback: Callable[..., Any], path: Path | None,
                 static_pointers: Callable[[], set[int]]):  # fmt: skip
        # Weakly: the compile cache's entries, which hold this, live as long as the process (they
        # are written at its exit); the model is the caller's to drop.
        self._model = weakref.ref(model)
        self.options = options
        self.fallback = fallback
        # What is written at the process's exit (the compile cache's entry holds it; it holds
        # nothing of the model, which may be freed before).
        self.store = KeptCalls(path)
        self.static_pointers = static_pointers
        self.functions: list[Any] = []
        self.loaded = 0
        # Kept functions not loaded yet: each is loaded when a call the loaded ones do not serve
        # comes (a generate's first token waits for the prompt's function only).
        self.pending: list[bytes] = []
        # Why calls a kept function does not serve go to ``fallback`` (None: they are compiled here).
        self.refused: str | None = None
        self._read = False
        # A function of this model's own for Dynamo to trace: Dynamo keeps what it learns of a
        # function's inputs (which sizes change) per code object, as for any compiled function.
        self.function = _forward_function()
        self.counts = {"kept": 0, "compiled": 0, "fallback": 0}
        # The model's module tree at its first call (``replay._Snapshot``): the guards a kept function
        # drops (objects' identities) are what tell torch.compile's entry that a submodule, a weight
        # or a hook changed, so a change sends every later call there.
        self.snapshot: Any = None

    path = property(lambda self: self.store.path)
    kept = property(lambda self: self.store.kept)

    def save(self) -> bool:
        return self.store.save()

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model transfuse.compile kept these calls for was freed")
        return model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if args:  # (the compiled path passes arguments by name)
            self.counts["fallback"] += 1
            return self.fallback(model, *args, **kwargs)
        self.read()
        if self.snapshot is None:
            from .replay import _Snapshot

            self.snapshot = _Snapshot(model)
        elif not self.snapshot.holds():
            if self.refused is None or self.functions:
                self.functions, self.pending = [], []  # (what the dropped guards would have noticed: torch.compile's entry decides)
                self._refuse("the model's modules, weights or hooks changed after its first compiled call")
            self.counts["fallback"] += 1
            return self.fallback(model, **kwargs)
        for function in self.functions:
            if function.guard_check(model, **kwargs):
                self.counts["kept"] += 1
                return function.fn(model, **kwargs)
        while self.pending:
            function = self._load_pending()
            if function is not None and function.guard_check(model, **kwargs):
                self.counts["kept"] += 1
                return function.fn(model, **kwargs)
        if self.refused is None and len(self.functions) < torch._dynamo.config.recompile_limit:
            try:
                function = self._compile(kwargs)
            except _Unkeepable as exc:
                self._refuse(str(exc))
            else:
                self.counts["compiled"] += 1
                return function.fn(model, **kwargs)
        elif self.refused is None:
            self._refuse(f"the model's calls reached Dynamo's recompile limit ({len(self.functions)} kept functions)")
        self.counts["fallback"] += 1
        return self.fallback(model, **kwargs)

    def _refuse(self, why: str) -> None:
        self.refused = why
        warnings.warn(f"transfuse.compile: calls no kept function serves go through torch.compile: {why}", stacklevel=4)

    def _compile(self, kwargs: dict[str, Any]) -> Any:
        parts = _parts()
        start = time.perf_counter()
        try:
            return self._compile_kept(parts, kwargs)
        finally:
            SECONDS["compile"] += time.perf_counter() - start

    def _compile_kept(self, parts: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        extra = {"dynamic": self.options["dynamic"]} if parts["dynamic"] else {}
        hooks = parts["hooks"](guard_filter_fn=_guard_filter(parts, self.options["trust_modules"]))
        try:
            function = parts["compile"](
                self.function, ((self.model,), kwargs), hooks=hooks,
                backend=_split_backend(self.options, self.static_pointers), **extra,
            )  # fmt: skip
            data = _serialize(parts, function)
        except Exception as exc:  # noqa: BLE001 - torch's refusals (a graph break, a guard it cannot keep)
            raise _Unkeepable(_first_line(exc)) from exc
        self.functions.append(function)
        self.store.kept.append(data)
        self.store.unsaved = True
        return function

    # --- reading and writing ------------------------------------------------------------------

    def read(self) -> int:
        """Read the kept functions from ``path`` and load the first (the others are loaded when a
        call the loaded ones do not serve comes); how many were kept. An entry that cannot be read,
        or whose first function cannot be loaded, is ignored with a warning and removed (it is
        written again)."""
        if self._read or self.path is None:
            return len(self.store.kept) if self.loaded else 0
        self._read = True
        start = time.perf_counter()
        try:
            return self._read_kept()
        finally:
            SECONDS["load"] += time.perf_counter() - start

    def _read_kept(self) -> int:
        from .cache import _counters, _unwrap

        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            warnings.warn(f"transfuse.compile: the kept compiled calls {self.path} cannot be read ({exc}); compiling anew")
            return 0
        chunks = _unwrap(data, _MAGIC)
        reason = "it is cut short or corrupt"
        if chunks:
            try:
                function = self._load(chunks[0])
            except Exception as exc:  # noqa: BLE001 - whatever torch or pickle raise on another torch's data
                reason = f"it cannot be loaded: {_first_line(exc)}"
            else:
                self.functions, self.store.kept, self.loaded = [function], list(chunks), 1
                self.pending = list(chunks[1:])
                _counters()["dynamo_hit"] += 1
                return len(chunks)
        _counters()["dynamo_corrupt"] += 1
        warnings.warn(f"transfuse.compile: ignored the kept compiled calls {self.path} ({reason}); they are rebuilt")
        try:
            self.path.unlink()
        except OSError:
            pass
        return 0

    def _load(self, chunk: bytes) -> Any:
        _LOADING.static_pointers = self.static_pointers
        try:
            return _deserialize(_parts(), chunk)
        finally:
            _LOADING.static_pointers = None

    def _load_pending(self) -> Any:
        """Load the next kept function not loaded yet; None where it cannot be loaded (said once, and
        left out of the entry, which is written again without it)."""
        chunk = self.pending.pop(0)
        start = time.perf_counter()
        try:
            function = self._load(chunk)
        except Exception as exc:  # noqa: BLE001 - as in ``_read_kept``
            warnings.warn(f"transfuse.compile: ignored a kept compiled call of {self.path} (it cannot be loaded: "
                          f"{_first_line(exc)}); the calls it served are compiled anew", stacklevel=4)  # fmt: skip
            self.store.kept = [kept for kept in self.store.kept if kept is not chunk]
            self.store.unsaved = True
            return None
        finally:
            SECONDS["load"] += time.perf_counter() - start
        self.functions.append(function)
        self.loaded += 1
        return function


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class KeptCalls:
    """The serialized kept functions of one compile cache entry and where they are written."""

    def __init__(self, path: Path | None):
        self.path = path
        # Serialized (data, external references) of each function, in order.
        self.kept: list[bytes] = []
        self.unsaved = False

    def save(self) -> bool:
        """Write the functions, atomically, if this process compiled any."""
        from .cache import _counters, _wrap, write_atomically

        if not self.unsaved or self.path is None:
            return False
        write_atomically(self.path, _wrap(self.kept, _MAGIC))
        self.unsaved = False
        _counters()["dynamo_saved"] += 1
        return True


def _guard_filter(parts: dict[str, Any], trust_modules: bool) -> Callable[[Any], list[bool]]:
    """The guards a kept function keeps: not those on globals, not those torch cannot keep (an
    object's identity), and with ``trust_modules`` not those on the model's modules."""
    unkept = parts["unkept_guards"]
    modules = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None) if trust_modules else None

    def keep(entries: Any) -> list[bool]:
        kept = [
            not (entry.is_global or entry.guard_type in unkept or set(getattr(entry, "derived_guard_types", ()) or ()) & unkept)
            for entry in entries
        ]
        if modules is not None:
            kept = [a and b for a, b in zip(kept, modules(entries))]
        return kept

    return keep


def _serialize(parts: dict[str, Any], function: Any) -> bytes:
    """A function's bytes: torch's own, and how to find the objects its bytecode reads from globals
    that torch leaves to the caller (modules and importable objects)."""
    data = parts["function"].serialize(function).serialized_data
    env = function._artifacts.runtime_env
    references = {}
    for name in getattr(env, "external_refs", ()):
        if name in env.import_sources or name in env.used_globals or name.startswith("__compiled_fn"):
            continue
        references[name] = _importable(function.fn.__globals__[name])
    return pickle.dumps((data, references))


def _importable(value: Any) -> tuple[str, ...]:
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and name and "<locals>" not in name and _resolve(("object", module, name)) is value:
        return ("object", module, name)
    raise _Unkeepable(f"the compiled call reads {type(value).__name__} {value!r:.60}, which another process cannot find")


def _resolve(reference: tuple[str, ...]) -> Any:
    if reference[0] == "module":
        return importlib.import_module(reference[1])
    return functools.reduce(getattr, reference[2].split("."), importlib.import_module(reference[1]))


def _deserialize(parts: dict[str, Any], chunk: bytes) -> Any:
    data, references = pickle.loads(chunk)
    f_globals = {name: _resolve(reference) for name, reference in references.items()}
    return parts["function"].deserialize(data, f_globals=f_globals)


_FUNCTIONS = itertools.count()


def _forward_function() -> Callable[..., Any]:
    """``forward(model, **kwargs)``: the model's forward called by name, as a function with a code
    object of its own (and its source known to ``linecache``, as Dynamo wants)."""
    from ..ops import batch_invariant

    source = (
        "def transfuse_precompiled_call(model, /, **kwargs):\n"
        + batch_invariant.CLASS_FORWARD_IN_THE_MODE.replace("*args, **kwargs", "**kwargs")
        + "    return model.forward(**kwargs)\n"
    )
    filename = f"<transfuse.compile precompiled {next(_FUNCTIONS)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": __name__, "InvariantForward": batch_invariant.InvariantForward}
    exec(builtins.compile(source, filename, "exec"), namespace)  # noqa: S102
    return namespace["transfuse_precompiled_call"]
