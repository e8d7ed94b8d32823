"""All-leaf tracer: one module class's own forward as an fx graph, with a meta value on every node.

Plain ``torch.fx`` stops on nearly every attention and decoder layer of transformers 5:
shape unpacking, ``*``-splats, wrapped forwards, the attention interface. This tracer
differs from ``fx.Tracer`` in these ways:

* every child module is a leaf (one ``call_module`` node), so a graph shows only the
  traced class's own code;
* every proxy carries a value (``node.meta["val"]``): the op is also run on meta
  tensors, so ``x.shape``, ``len``, iteration and ``bool`` of shapes are concrete,
  while ``x.dtype`` stays a node, so a cast back to the input dtype is told apart from a
  cast to float32; ``torch.finfo(x.dtype)`` (and ``iinfo``) reads the dtype that node holds, as a
  guard, so ``masked_fill(..., torch.finfo(scores.dtype).min)`` does not stop the trace;
* scalar attributes of ``self`` (floats such as eps, ints such as top_k, bools such as
  a normalisation flag) become ``get_attr`` nodes, so a fuser knows which attribute
  supplied a constant and can read it per instance; control flow that reads one is a
  guard, and ``Trace.specialisation`` names the attributes the graph is specialised on;
* the attention interface and declared leaf callables become single nodes, and so do calls the
  forward makes that a proxy cannot enter (``einops`` functions, TorchScript functions without their
  Python: ``_as_leaf``), valued by running them on meta tensors; a ``@torch.jit.script`` function
  whose Python torch kept is traced through that Python;
* sizes read off a traced tensor (``x.shape``, ``x.size(1)``, ``x.dim()``, ``x.numel()``) are
  ints that remember where they came from (``sizes``): when Python control flow tests one (``if x.dim()
  == 2``, in the forward or in any helper it calls), the trace records a ``ShapeGuard`` with
  its source line, so a fuser that replaces the whole module knows its graph holds for
  inputs of this shape only;
* when the forward cannot go on (a data-dependent branch, an op that has no meta
  kernel and whose value is then needed), the graph built so far is kept and the trace
  is marked partial, with the reason and the source line;
* an op whose output size or data meta tensors cannot give (``nonzero``, indexing with a
  tensor, ``.item()``) gets a *stand-in* value: one element where the count is
  data-dependent, zero where a number is. Python that reads a stand-in (a loop over
  ``nonzero()``, a branch or an index on its data) then follows one representative path:
  a loop runs once, a branch is not taken, an index is 0. Each such place is recorded in
  ``Trace.assumptions`` with its source line, for a fuser to prove on the source or refuse.

The graph is evidence for fusers, never code to run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.fx.proxy import Attribute, Scope, TracerBase
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .sizes import SIZE_READS, ShapeGuard, SizeInt, SizeOrigin, SizeTuple, plain_size, tracked_size

__all__ = ["UNKNOWN", "Assumption", "ShapeGuard", "Trace", "TraceStop", "is_kv_cache", "leaf_callable", "trace_module"]


class _Unknown:
    """The value of a node that could not be computed (no example input, no meta kernel)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()

# Argument names under which transformers passes a KV cache; fixed to None while tracing.
CACHE_ARG_NAMES = frozenset({"past_key_value", "past_key_values", "cache", "layer_past"})

_TORCH_DIR = os.path.dirname(torch.__file__)
_TRANSFUSE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_FILES = (contextlib.__file__, functools.__file__)

# Tensor attributes whose concrete value is read off the meta value; ``dtype`` is not
# among them on purpose (see the module docstring).
_CONCRETE_ATTRS = frozenset({"shape", "ndim", "device", "is_cuda", "is_meta", "layout", "requires_grad"})
_CONCRETE_METHODS = frozenset({"size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous"})


class TraceStop(Exception):
    """Raised inside a trace when the forward cannot go on; the graph built so far is kept."""


# Scalar types of ``self`` attributes that become get_attr nodes (bool is a subclass of int,
# but attributes are matched by exact type so that enums and subclasses stay constants).
_SCALAR_ATTR_TYPES = (float, int, bool)


@dataclass(frozen=True)
class Assumption:
    """Where Python read a stand-in value, and what the trace assumed there.

    kind: "loop" (a loop over a data-dependent count ran once), "branch" (a condition on
    data was taken as False), "index" (a data-dependent Python index was taken as 0) or
    "size" (the size of a data-dependent value was read).
    """

    kind: str
    node: fx.Node
    location: tuple[str, int] | None

    def describe(self) -> str:
        where = f" at {os.path.basename(self.location[0])}:{self.location[1]}" if self.location else ""
        return f"{self.kind} on {self.node.name}{where}"


@dataclass
class Trace:
    """The result of tracing one module class: a (possibly partial) graph and what it rests on."""

    cls: type
    graph: fx.Graph
    partial: bool = False
    stop_reason: str | None = None
    stop_location: tuple[str, int] | None = None
    # Places where Python control flow read a traced value (the graph is specialised there).
    guards: list[fx.Node] = field(default_factory=list)
    # Scalar attributes of ``self`` that became nodes, by attribute name.
    self_attrs: dict[str, fx.Node] = field(default_factory=dict)
    # Places where Python read a stand-in value (see the module docstring).
    assumptions: list[Assumption] = field(default_factory=list)
    # Places where Python control flow tested a size of a traced tensor.
    shape_guards: list[ShapeGuard] = field(default_factory=list)

    @property
    def float_attrs(self) -> dict[str, fx.Node]:
        return {name: node for name, node in self.self_attrs.items() if type(node.meta["val"]) is float}

    @functools.cached_property
    def specialisation(self) -> dict[str, Any]:
        """The ``self`` attributes that guards read, with the values this trace saw: the graph
        holds for an instance only where its attributes have these values."""
        found: dict[str, Any] = {}
        for guard in self.guards:
            for node in _ancestors(guard):
                name = node.meta.get("self_attr")
                if name is not None:
                    found[name] = node.meta["val"]
        return found

    @property
    def output(self) -> fx.Node | None:
        for node in reversed(self.graph.nodes):
            if node.op == "output":
                return node
        return None

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder" and n.name != "self"]

    def describe_stop(self) -> str:
        if not self.partial:
            return "traced to the end"
        where = f" at {os.path.basename(self.stop_location[0])}:{self.stop_location[1]}" if self.stop_location else ""
        return f"trace stopped{where}: {self.stop_reason}"


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it was computed from."""
    seen, pending = {node}, [node]
    while pending:
        for parent in pending.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                pending.append(parent)
    return list(seen)


def _user_location(skip_frames: int = 2) -> tuple[str, int] | None:
    """The innermost frame outside torch, transfuse and the stdlib wrappers: the model's own code."""
    frame = sys._getframe(skip_frames)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _TRANSFUSE_DIR)) and filename not in _STDLIB_FILES:
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def _traceback_location(tb) -> tuple[str, int] | None:
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _TRANSFUSE_DIR)) and filename not in _STDLIB_FILES:
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


class ValueProxy(fx.Proxy):
    """An fx proxy whose node carries a value: a meta tensor, a Python value, or UNKNOWN."""

    @property
    def value(self) -> Any:
        return self.node.meta.get("val", UNKNOWN)

    def _known(self, what: str) -> Any:
        value = self.value
        if value is UNKNOWN:
            raise TraceStop(f"{what} of {self.node.name}, whose value is unknown")
        return value

    @property
    def stand_in(self) -> bool:
        return bool(self.node.meta.get("stand_in"))

    def _assume(self, kind: str) -> None:
        self.tracer.assumptions.append(Assumption(kind, self.node, _user_location(3)))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = self.node.meta.get("val", UNKNOWN)
        if isinstance(value, torch.Tensor) and (name in _CONCRETE_ATTRS or name in _CONCRETE_METHODS):
            if self.stand_in and name in ("shape", "size", "numel", "nelement"):
                self._assume("size")
            concrete = getattr(value, name)
            if name not in SIZE_READS or self.stand_in:  # a stand-in's sizes are assumptions already
                return concrete
            if not callable(concrete):
                return tracked_size(concrete, SizeOrigin(self.node, name, self.tracer.record_shape_guard))
            origin = SizeOrigin(self.node, f"{name}()", self.tracer.record_shape_guard)
            return lambda *args, **kwargs: tracked_size(concrete(*args, **kwargs), origin)
        return _ValueAttribute(self, name)

    def __bool__(self) -> bool:
        value = self._known("control flow on the value")
        if isinstance(value, torch.Tensor):
            if not self.stand_in:
                raise TraceStop(f"data-dependent control flow on tensor {self.node.name}")
            self._assume("branch")
            return False
        self.tracer.guards.append(self.node)
        return bool(value)

    def __iter__(self) -> Iterator[ValueProxy]:
        value = self._known("iteration over the value")
        if isinstance(value, torch.Tensor):
            count = value.shape[0] if value.dim() else 0
            if self.stand_in:
                self._assume("loop")
        else:
            count = len(value)
        return iter([self[i] for i in range(count)])

    def __len__(self) -> int:
        value = self._known("len()")
        if isinstance(value, torch.Tensor) and self.stand_in:
            self._assume("size")
        return value.shape[0] if isinstance(value, torch.Tensor) else len(value)

    def __index__(self) -> int:
        value = self._known("use as an index")
        if isinstance(value, torch.Tensor) and self.stand_in and value.numel() == 1:
            self._assume("index")
            return 0
        if isinstance(value, torch.Tensor) or not isinstance(value, int):
            raise TraceStop(f"{self.node.name} used as a Python int")
        self.tracer.guards.append(self.node)
        return value

    def __int__(self) -> int:
        return self.__index__()

    def __float__(self) -> float:
        value = self._known("float()")
        if isinstance(value, torch.Tensor):
            raise TraceStop(f"data-dependent float() of {self.node.name}")
        self.tracer.guards.append(self.node)
        return float(value)

    def __setitem__(self, key: Any, item: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, item), {})

    def __hash__(self) -> int:
        return id(self)


class _ValueAttribute(Attribute, ValueProxy):
    """``proxy.attr``: a node only once used as a value; a method call otherwise."""


class _LeafTracer(TracerBase):
    """Builds the graph of one module's forward; see ``trace_module``."""

    def __init__(self, root: nn.Module, recorded_outputs: dict[str, Any] | None = None):
        self.graph = fx.Graph()
        self.scope = Scope("", None)
        self.module_stack = {}
        self.node_name_to_scope = {}
        self.root = root
        self.executing = False
        self.guards: list[fx.Node] = []
        self.assumptions: list[Assumption] = []
        self.shape_guards: list[ShapeGuard] = []
        self.thread = threading.get_ident()
        self.recorded_outputs = recorded_outputs or {}
        self._module_names = {id(m): name for name, m in root.named_modules() if m is not root}
        self._tensor_names: dict[int, str] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            self._tensor_names.setdefault(id(p), name)
        for name, b in root.named_buffers(remove_duplicate=False):
            self._tensor_names.setdefault(id(b), name)
        self._attr_nodes: dict[str, fx.Node] = {}
        self._meta_cache: dict[int, torch.Tensor] = {}
        self._shadowed: dict[str, Any] = {}  # name -> original __dict__ entry (or _MISSING)
        self._shadows: dict[str, ValueProxy] = {}  # name -> the node proxy shadowing it
        self.self_node: fx.Node | None = None

    def record_shape_guard(self, node: fx.Node, read: str) -> None:
        """Control flow of the traced code tested a size read off ``node`` (``sizes.SizeOrigin``)."""
        if _ACTIVE is self and not self.executing:
            self.shape_guards.append(ShapeGuard(node, read, _user_location(3)))

    # -- graph building -------------------------------------------------------------
    def proxy(self, node: fx.Node) -> ValueProxy:
        return ValueProxy(node, self)

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):
            return a.node
        if isinstance(a, (SizeInt, SizeTuple)):
            return plain_size(a)
        if isinstance(a, torch.Tensor):
            return self._tensor_node(a)
        if isinstance(a, nn.Module):
            if a is self.root:
                return self.self_node
            name = self._module_names.get(id(a))
            if name is not None:
                return self._get_attr(name, a)
            return a
        try:
            return super().create_arg(a)
        except NotImplementedError:
            return a  # an opaque Python object (a config, a cache): kept as a constant

    def _get_attr(self, name: str, value: Any) -> fx.Node:
        node = self._attr_nodes.get(name)
        if node is None:
            node = self.graph.create_node("get_attr", name)
            node.meta["val"] = self._to_meta(value) if isinstance(value, torch.Tensor) else value
            self._attr_nodes[name] = node
        return node

    def _tensor_node(self, t: torch.Tensor) -> fx.Node:
        name = self._tensor_names.get(id(t))
        if name is not None:
            return self._get_attr(name, t)
        node = self.graph.create_node("get_attr", f"<constant {tuple(t.shape)}>")
        node.meta["val"] = self._to_meta(t)
        node.meta["constant"] = True
        base = self._viewed(t)
        if base is not None:
            node.meta["view_of"] = base  # Python reshaped a tensor of the module (``self.child.w.view(...)``)
        return node

    def _viewed(self, t: torch.Tensor) -> tuple[str, tuple[int, ...]] | None:
        """(name, shape) of the module's tensor that ``t`` is the whole of, reshaped (``w.view(E, r, c)``
        computed outside the graph), else None: then ``t`` equals ``that.view(t.shape)``."""
        base = t._base
        name = self._tensor_names.get(id(base)) if base is not None else None
        if name is None or t.numel() != base.numel() or t.storage_offset() != base.storage_offset():
            return None
        return (name, tuple(base.shape)) if t.is_contiguous() and base.is_contiguous() else None

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        value = UNKNOWN
        error = None
        stand_in = False
        if kind != "placeholder":
            value, error, stand_in = self._evaluate(kind, target, args, kwargs)
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        proxy.node.meta["val"] = value
        if stand_in or any(n.meta.get("stand_in") for n in proxy.node.all_input_nodes):
            proxy.node.meta["stand_in"] = True
        if error is not None:
            proxy.node.meta["val_error"] = error
        location = _user_location()
        if location is not None:
            proxy.node.meta["location"] = location
        return proxy

    # -- meta evaluation ------------------------------------------------------------
    def _to_meta(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        cached = self._meta_cache.get(id(t))
        if cached is None:
            cached = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            self._meta_cache[id(t)] = cached
        return cached

    def _materialise(self, obj: Any) -> Any:
        def convert(x):
            if isinstance(x, fx.Proxy):
                return x.node.meta.get("val", UNKNOWN)
            if isinstance(x, torch.Tensor):
                return self._to_meta(x)
            return plain_size(x)

        return tree_map(convert, obj)

    @contextlib.contextmanager
    def running(self):
        """Run real code (meta evaluation): module calls go through; ``self`` reads its real
        floats and meta copies of its tensors (a leaf such as the attention function reads them)."""
        previous = self.executing
        self.executing = True
        _restore(self.root, self._shadowed)
        for name, proxy in self._shadows.items():
            if isinstance(proxy.value, torch.Tensor):
                self.root.__dict__[name] = proxy.value
        try:
            yield
        finally:
            self.root.__dict__.update(self._shadows)
            self.executing = previous

    def _evaluate(self, kind: str, target: Any, args: tuple, kwargs: dict) -> tuple[Any, str | None, bool]:
        """The node's value, the error that prevented computing it, and whether it is a stand-in."""
        args, kwargs = self._materialise(args), self._materialise(kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        if any(leaf is UNKNOWN for leaf in leaves):
            return UNKNOWN, None, False
        stand_ins = _StandIns()
        try:
            with self.running(), stand_ins:
                if kind == "call_function":
                    return target(*args, **kwargs), None, stand_ins.used
                if kind == "call_method":
                    return getattr(args[0], target)(*args[1:], **kwargs), None, stand_ins.used
                if kind == "call_module":
                    return self._run_module(target, args, kwargs), None, stand_ins.used
        except Exception as exc:  # no meta kernel: the value stays unknown
            recorded = self.recorded_outputs.get(target) if kind == "call_module" else None
            if recorded is not None:
                return recorded, None, False
            return UNKNOWN, f"{type(exc).__name__}: {exc}", False
        return UNKNOWN, None, False

    def _run_module(self, name: str, args: tuple, kwargs: dict) -> Any:
        module = self.root.get_submodule(name)
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        state = {k: self._to_meta(v) for k, v in tensors}
        return torch.func.functional_call(module, state, args, kwargs, strict=False)

    # -- leaves -----------------------------------------------------------------------
    def call_module(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        name = self._module_names[id(module)]
        return self.create_proxy("call_module", name, args, kwargs)

    def call_leaf(self, fn: Callable, arity: int | None, args: tuple, kwargs: dict) -> Any:
        proxy = self.create_proxy("call_function", fn, args, kwargs)
        if proxy.value is UNKNOWN and arity is not None:
            proxy.node.meta["val"] = tuple([UNKNOWN] * arity)
        return proxy

    def owns(self, module: nn.Module) -> bool:
        """A child of the traced module, called from the traced forward (on the tracing thread:
        another thread running the same modules meanwhile runs them as usual)."""
        return not self.executing and id(module) in self._module_names and threading.get_ident() == self.thread


_aten = torch.ops.aten


class _StandIns(TorchDispatchMode):
    """On meta tensors, ops that need data answer with stand-ins: ``nonzero`` finds one
    element, a read of a number gives 0 (False for a bool). ``used`` says whether any did."""

    def __init__(self):
        super().__init__()
        self.used = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.is_meta:
            if func is _aten._local_scalar_dense.default:
                self.used = True
                return False if first.dtype == torch.bool else (0.0 if first.dtype.is_floating_point else 0)
            if func is _aten.nonzero.default:
                self.used = True
                return torch.empty((1, first.dim()), dtype=torch.long, device="meta")
        return func(*args, **kwargs)


# The tracer of the trace in progress; traces are serialised by _TRACE_LOCK.
_ACTIVE: _LeafTracer | None = None
_TRACE_LOCK = threading.RLock()


def _has_proxy(args: tuple, kwargs: dict) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(leaf, fx.Proxy) for leaf in leaves)


def leaf_callable(fn: Callable, arity: int | None = None) -> Callable:
    """Wrap ``fn`` so that, while tracing, a call with traced arguments becomes one node.

    ``arity`` is the number of outputs to assume when the call cannot be evaluated on
    meta tensors (the attention interface returns ``(output, weights)``).
    """
    if getattr(fn, "__transfuse_leaf__", False):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        tracer = _ACTIVE
        if tracer is not None and not tracer.executing and _has_proxy(args, kwargs):
            return tracer.call_leaf(fn, arity, args, kwargs)
        return fn(*args, **kwargs)

    call.__transfuse_leaf__ = True
    return call


@contextlib.contextmanager
def _patched_module_call(tracer: _LeafTracer):
    original = nn.Module.__call__

    def call(module, *args, **kwargs):
        if tracer.owns(module):
            return tracer.call_module(module, args, kwargs)
        return original(module, *args, **kwargs)

    nn.Module.__call__ = call
    try:
        yield
    finally:
        nn.Module.__call__ = original


@contextlib.contextmanager
def _attention_interface_as_leaf():
    """Calls through transformers' attention interface become leaves of arity 2."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # transformers is optional for the tracer itself
        yield
        return
    original_get = AttentionInterface.get_interface
    original_getitem = AttentionInterface.__getitem__
    # The class's own entries, put back as they were (an inherited method is deleted again, not set).
    own = {name: AttentionInterface.__dict__.get(name) for name in ("get_interface", "__getitem__")}

    def get_interface(self, *args, **kwargs):
        return leaf_callable(original_get(self, *args, **kwargs), arity=2)

    def getitem(self, key):
        return leaf_callable(original_getitem(self, key), arity=2)

    AttentionInterface.get_interface = get_interface
    AttentionInterface.__getitem__ = getitem
    try:
        yield
    finally:
        for name, entry in own.items():
            if entry is None:
                delattr(AttentionInterface, name)
            else:
                setattr(AttentionInterface, name, entry)


def _concrete_dtype(value: Any) -> Any:
    """A traced dtype (``x.dtype``) as the dtype its node holds, read as a guard; anything else as is."""
    if isinstance(value, ValueProxy) and isinstance(value.value, torch.dtype):
        value.tracer.guards.append(value.node)
        return value.value
    return value


def _info_reading_traced_dtypes(original: type) -> type:
    """A stand-in for ``torch.finfo`` or ``torch.iinfo`` (types that take only a real ``torch.dtype``)
    that takes a traced dtype too: ``torch.finfo(scores.dtype).min`` is the number for the dtype
    the trace saw. Its instances are the original's, and ``isinstance`` answers as for the original."""

    class InfoType(type):
        def __call__(cls, *args, **kwargs):
            return original(*map(_concrete_dtype, args), **{k: _concrete_dtype(v) for k, v in kwargs.items()})

        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, original)

        def __subclasscheck__(cls, sub) -> bool:
            return issubclass(sub, original)

    return InfoType(original.__name__, (), {"__module__": original.__module__, "__doc__": original.__doc__})


@contextlib.contextmanager
def _dtype_infos_of_traced_values():
    """``torch.finfo`` and ``torch.iinfo`` take traced dtypes for the length of the trace (a dtype
    stays a node, see the module docstring, and the real types refuse anything but a dtype); a call
    from another thread meanwhile, with a real dtype, gets what the original gives."""
    originals = {name: getattr(torch, name) for name in ("finfo", "iinfo")}
    for name, original in originals.items():
        setattr(torch, name, _info_reading_traced_dtypes(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


# Libraries whose functions take a tensor of any framework and look at its type (a proxy has none
# they know): their calls are leaves, valued by running them on meta tensors.
_OPAQUE_LIBRARIES = ("einops",)


def _is_opaque_library(value: Any) -> bool:
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None) or ""
    return name.split(".")[0] in _OPAQUE_LIBRARIES


def _leaf_namespace(module: types.ModuleType) -> types.ModuleType:
    """A stand-in for an opaque library module whose functions are leaves (``einops.rearrange(...)``)."""
    stand_in = types.ModuleType(module.__name__)
    stand_in.__dict__.update({k: leaf_callable(v) if callable(v) and not isinstance(v, type) else v for k, v in vars(module).items()})
    return stand_in


def _as_leaf(value: Any) -> Any:
    """What a global of the forward's module is replaced by while tracing, or None: transfuse's own
    ops (emitted files call them: their dispatch code is not the model's), TorchScript functions
    (``@torch.jit.script``: no Python to follow) and opaque libraries' functions become leaves."""
    if isinstance(value, types.ModuleType):
        return _leaf_namespace(value) if _is_opaque_library(value) else None
    if not callable(value) or isinstance(value, type):
        return None
    if isinstance(value, torch.jit.ScriptFunction):
        python = getattr(value, "_torchdynamo_inline", None)  # the function as written, kept by torch
        return python if isinstance(python, types.FunctionType) else leaf_callable(value)
    if _is_opaque_library(value):
        return leaf_callable(value)
    if (getattr(value, "__module__", None) or "").startswith("transfuse.ops"):
        return leaf_callable(value)
    return None


def _with_fused_ops_as_leaves(fn: Callable) -> Callable:
    """``fn``, or a copy of it whose globals make calls the tracer must not enter single leaf nodes
    (``_as_leaf``), valued on meta tensors. The copy has globals of its own: the module's are never
    changed."""
    namespace = fn.__globals__
    ops = {name: leaf for name, value in namespace.items() if (leaf := _as_leaf(value)) is not None}
    if not ops:
        return fn
    copy = types.FunctionType(fn.__code__, {**namespace, **ops}, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@contextlib.contextmanager
def _methods_as_leaves(module: nn.Module):
    """A quantization scheme's projection methods of ``module`` (``ops.quantized.projection_leaves``:
    block-FP8 experts' ``linear``) are one leaf node each while its forward is traced, valued on
    meta tensors: their kernels are the scheme's, not code to follow. Set on the instance and
    removed after."""
    from ..ops.quantized.fp8_experts import projection_leaves

    leaves = projection_leaves(module)
    own = {name: module.__dict__[name] for name in leaves if name in module.__dict__}
    for name, leaf in leaves.items():
        module.__dict__[name] = leaf_callable(leaf)
    try:
        yield
    finally:
        for name in leaves:
            module.__dict__.pop(name, None)
        module.__dict__.update(own)


def is_kv_cache(value: Any) -> bool:
    """A transformers KV cache (any ``Cache`` subclass): state that a call changes in place."""
    return any(c.__name__ == "Cache" and c.__module__.endswith("cache_utils") for c in type(value).__mro__)


def _is_cache(name: str, value: Any) -> bool:
    return name in CACHE_ARG_NAMES or is_kv_cache(value)


def _has_tensor(value: Any) -> bool:
    leaves, _ = tree_flatten(value)
    return any(isinstance(leaf, torch.Tensor) for leaf in leaves)


def unwrapped_forward(cls: type) -> Callable:
    """The class's own forward, below ``functools.wraps`` decorators such as ``@deprecate_kwarg``."""
    return inspect.unwrap(cls.forward)


def _bind_inputs(tracer: _LeafTracer, fn: Callable, example: tuple[tuple, dict] | None) -> tuple[list, dict]:
    """Placeholders for tensor arguments (valued from the example call), constants for the rest."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    ex_args, ex_kwargs = example if example is not None else ((), {})
    call_args: list[Any] = []
    call_kwargs: dict[str, Any] = {}
    positional = list(ex_args)
    for p in params:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            continue  # **kwargs are treated as empty
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            extra = [_placeholder(tracer, f"{p.name}_{i}", v) for i, v in enumerate(positional)]
            call_args.extend(extra)
            positional = []
            continue
        if positional and p.kind is not inspect.Parameter.KEYWORD_ONLY:
            value, have = positional.pop(0), True
        elif p.name in ex_kwargs:
            value, have = ex_kwargs[p.name], True
        else:
            value, have = p.default, p.default is not inspect.Parameter.empty
        if _is_cache(p.name, value) if have else p.name in CACHE_ARG_NAMES:
            value, have = None, True
        if not have:
            value = _placeholder(tracer, p.name, UNKNOWN)
        elif _has_tensor(value):
            value = _placeholder(tracer, p.name, value)
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            call_kwargs[p.name] = value
        else:
            call_args.append(value)
    return call_args, call_kwargs


def _placeholder(tracer: _LeafTracer, name: str, value: Any) -> ValueProxy:
    proxy = tracer.create_proxy("placeholder", name, (), {})
    proxy.node.meta["val"] = tracer._materialise(value) if value is not UNKNOWN else UNKNOWN
    return proxy


_MISSING = object()


@contextlib.contextmanager
def _self_state_as_nodes(tracer: _LeafTracer, module: nn.Module):
    """Scalar attributes, parameters and buffers of ``module`` read as nodes for the length of the trace.

    They shadow the real values in the instance ``__dict__`` (which attribute lookup
    consults before ``nn.Module.__getattr__``), so ``self.weight.float()`` is recorded
    rather than computed eagerly, ``self.eps`` is known to come from ``eps``, and
    ``if self.norm_topk_prob:`` is a guard on ``norm_topk_prob``.
    """
    shadows: dict[str, ValueProxy] = {}
    for name, v in vars(module).items():
        if type(v) in _SCALAR_ATTR_TYPES:
            node = tracer.graph.create_node("get_attr", name)
            node.meta["val"] = v
            node.meta["self_attr"] = name
            shadows[name] = tracer.proxy(node)
    for name, t in [*module._parameters.items(), *module._buffers.items()]:
        if t is not None:
            shadows[name] = tracer.proxy(tracer._get_attr(name, t))
    tracer._shadowed = {name: module.__dict__.get(name, _MISSING) for name in shadows}
    tracer._shadows = shadows
    module.__dict__.update(shadows)
    try:
        yield {name: p.node for name, p in shadows.items() if "self_attr" in p.node.meta}
    finally:
        _restore(module, tracer._shadowed)


def _restore(module: nn.Module, originals: dict[str, Any]) -> None:
    for name, original in originals.items():
        if original is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = original


def trace_module(
    module: nn.Module,
    example: tuple[tuple, dict] | None = None,
    recorded_outputs: dict[str, Any] | None = None,
) -> Trace:
    """Trace ``module``'s class forward with every child module as a leaf.

    ``example`` is one recorded call ``(args, kwargs)`` of this module (tensors may be
    meta); without it, tensor arguments have unknown values and the trace stops where a
    shape is needed. ``recorded_outputs`` maps child names to outputs recorded in that
    call, used when a child cannot run on meta tensors.
    """
    global _ACTIVE
    cls = type(module)
    fn = _with_fused_ops_as_leaves(unwrapped_forward(cls))
    tracer = _LeafTracer(module, recorded_outputs)
    trace = Trace(cls=cls, graph=tracer.graph)
    with _TRACE_LOCK:
        previous, _ACTIVE = _ACTIVE, tracer
        try:
            tracer.self_node = tracer.graph.placeholder("self")
            tracer.self_node.meta["val"] = module
            with _patched_module_call(tracer), _attention_interface_as_leaf(), _dtype_infos_of_traced_values():
                with _self_state_as_nodes(tracer, module) as attr_nodes, _methods_as_leaves(module):
                    trace.self_attrs = attr_nodes
                    try:
                        args, kwargs = _bind_inputs(tracer, fn, example)
                        result = fn(module, *args, **kwargs)
                        tracer.graph.output(tracer.create_arg(result))
                    except Exception as exc:  # partial graph: keep what was built
                        trace.partial = True
                        trace.stop_reason = str(exc) if isinstance(exc, TraceStop) else f"{type(exc).__name__}: {exc}"
                        trace.stop_location = _traceback_location(exc.__traceback__)
        finally:
            _ACTIVE = previous
    trace.guards = tracer.guards
    trace.assumptions = tracer.assumptions
    trace.shape_guards = tracer.shape_guards
    _weaken_module_values(trace.graph)
    return trace


def _weaken_module_values(graph: fx.Graph) -> None:
    """Nodes that stand for modules (``self``, children) keep weak references to them: traces are
    cached per class, and a strong one would keep the traced instance, and its model's weights,
    alive for as long as the class is."""
    for node in graph.nodes:
        found = node.meta.get("val")
        if isinstance(found, nn.Module) and not isinstance(found, weakref.ProxyType):
            node.meta["val"] = weakref.proxy(found)
