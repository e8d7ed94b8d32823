"""One dispatch mechanism for every op on every platform.

Each op has a native definition: its semantics, the CPU path, and the reference every
other implementation is tested against. Other implementations register as providers
under a name ("torch", "triton", "cuda", or a plugin's) with two checks: ``supported``
(static, evaluated once: does this platform and installation have it) and
``supports_args`` (per call, cheap: dtype, shape, contiguity). The first provider in the
priority list that passes both runs; native is always the last resort. A provider with
no backward is skipped whenever autograd needs one; a provider may bring its kernels' own
backward (``Provider.autograd``), which is called only then.

Priority, from strongest to weakest: ``set_priority`` from Python, the environment
(``TRANSFUSE_FORCE_NATIVE=1``; ``TRANSFUSE_OP_PRIORITY="rms_norm=triton,native;silu_and_mul=cuda"``),
then the platform's own list.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten

from .. import settings
from .platform import current_platform

__all__ = [
    "Dispatch",
    "Op",
    "Provider",
    "get_op",
    "priority",
    "refresh",
    "register_provider",
    "set_priority",
    "trace",
    "set_compile_mode",
    "under_compile_use_library_op",
    "PROVIDER_ENTRY_POINT_GROUP",
]

PROVIDER_ENTRY_POINT_GROUP = "transfuse.providers"


def _always(*args: Any, **kwargs: Any) -> bool:
    return True


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


@dataclass(frozen=True)
class Provider:
    """One implementation of an op.

    supported: whether it can run here at all (evaluated once). supports_args: whether it can run
    these arguments (per call, cheap). defers: whether, though it can, a later provider in the
    order should take these arguments (a measured preference, per call, cheap); when no later
    provider can, it runs after all. differentiable: ``impl`` itself records a backward (it is
    made of differentiable torch ops). autograd: the same kernels wrapped with a backward of
    their own (a ``torch.autograd.Function``), called instead of ``impl`` when autograd needs
    one; a provider with neither is skipped then.
    """

    name: str
    impl: Callable[..., Any]
    supported: Callable[[], bool] = _always
    supports_args: Callable[..., bool] = _always
    differentiable: bool = False
    defers: Callable[..., bool] = _never
    autograd: Callable[..., Any] | None = None
    # ``(grad_output, *args, in_place=..., output=...) -> (grad_input, output or None)``: the
    # backward that can also give the forward's output again, for callers that recompute it
    # instead of keeping it (act_and_mul before a linear layer); None: autograd differentiates
    # ``autograd`` or ``impl``.
    backward_and_output: Callable[..., Any] | None = None
    # The kernels' backward as a plain function of the outputs' gradients and what the op keeps
    # (its signature is the op's own: ``rotary`` gives ``(grad_q, grad_k, cos, sin, unsqueeze_dim)``),
    # for a library op's registered backward under ``torch.compile``; None: the op has none.
    backward: Callable[..., Any] | None = None

    @property
    def has_backward(self) -> bool:
        return self.differentiable or self.autograd is not None

    def implementation(self, grad: bool) -> Callable[..., Any]:
        """What to call: the kernels with their backward when autograd needs one and they have it."""
        return self.autograd if grad and self.autograd is not None else self.impl


@dataclass(frozen=True)
class Dispatch:
    """A record of one dispatched call, as ``trace()`` collects them."""

    op: str
    provider: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    device: str
    grad: bool = False  # autograd needed a backward of this call


_OPS: dict[str, "Op"] = {}
_USER_PRIORITY: dict[str, tuple[str, ...]] = {}
_TRACES: list[list[Dispatch]] = []


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    # Ops take tensors, scalars and None, so a flat scan is the common case; a pytree walk (a few
    # microseconds per call, which eager decoding pays per op) only for nested arguments.
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple, dict)):
            leaves, _ = tree_flatten(value)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
                return True
    return False


class Op:
    """A dispatched op: a native definition plus named providers, picked per call."""

    def __init__(self, name: str, native: Callable[..., Any]):
        if name in _OPS:
            raise ValueError(f"An op named {name!r} is already defined.")
        self.name = name
        self.native = Provider("native", native, differentiable=True)
        self._providers: dict[str, Provider] = {}
        self._supported: dict[str, bool] = {}
        self._order: tuple[Provider, ...] | None = None
        _OPS[name] = self

    def register(self, provider: Provider) -> Provider:
        """Add (or replace) a provider of this op."""
        if provider.name == "native":
            raise ValueError("The native provider is the op's own definition; register under another name.")
        self._providers[provider.name] = provider
        self._supported.pop(provider.name, None)
        self._order = None
        _changed()
        return provider

    @property
    def providers(self) -> dict[str, Provider]:
        _load_plugins()
        return {**self._providers, "native": self.native}

    def is_supported(self, provider: Provider) -> bool:
        ok = self._supported.get(provider.name)
        if ok is None:
            try:
                ok = bool(provider.supported())
            except Exception as exc:  # a provider that cannot even check itself is unsupported
                warnings.warn(f"transfuse: provider {provider.name!r} of op {self.name!r} is unavailable: {exc}")
                ok = False
            self._supported[provider.name] = ok
        return ok

    def order(self) -> tuple[Provider, ...]:
        """Providers to try, in priority order, among those supported here; native last."""
        if self._order is None:
            providers = self.providers
            names, chosen_by_user = _priority_and_origin(self.name)
            chosen = []
            for name in names:
                provider = providers.get(name)
                if provider is None:
                    if chosen_by_user:  # a platform's list names providers an op may not have
                        _warn_unknown_provider(self.name, name, tuple(providers))
                elif provider is not self.native and self.is_supported(provider):
                    chosen.append(provider)
            self._order = (*chosen, self.native)
        return self._order

    def select(self, *args: Any, **kwargs: Any) -> Provider:
        return self._select(_needs_grad(args, kwargs), args, kwargs)

    def select_with_backward(self, *args: Any, **kwargs: Any) -> Provider:
        """The provider a call of these arguments gets when autograd needs its backward (for a
        ``torch.autograd.Function`` that calls the op in its own forward, where grad is off)."""
        provider = self._select(True, args, kwargs)
        if _TRACES:
            _record(self.name, provider.name, args, kwargs, True)
        return provider

    def _select(self, grad: bool, args: tuple, kwargs: dict) -> Provider:
        deferred = None
        for provider in self.order():
            if grad and not provider.has_backward:
                continue
            if provider is self.native:
                break
            if provider.supports_args(*args, **kwargs):
                if deferred is None and provider.defers(*args, **kwargs):
                    deferred = provider
                    continue
                return provider
        return deferred or self.native

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        grad = _needs_grad(args, kwargs)
        provider = self._select(grad, args, kwargs)
        if _TRACES:
            _record(self.name, provider.name, args, kwargs, grad)
        return provider.implementation(grad)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.name!r}, providers={list(self.providers)})"


def _record(op: str, provider: str, args: tuple, kwargs: dict, grad: bool = False) -> None:
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    entry = Dispatch(
        op=op,
        provider=provider,
        shapes=tuple(tuple(t.shape) for t in tensors),
        dtypes=tuple(t.dtype for t in tensors),
        device=str(tensors[0].device) if tensors else "none",
        grad=grad,
    )
    for log in _TRACES:
        log.append(entry)


@contextlib.contextmanager
def trace() -> Iterator[list[Dispatch]]:
    """Record which provider ran for each dispatched op call inside the block."""
    log: list[Dispatch] = []
    _TRACES.append(log)
    try:
        yield log
    finally:
        _TRACES.remove(log)


@functools.cache
def _warn_unknown_provider(op: str, name: str, known: tuple[str, ...]) -> None:
    warnings.warn(f"transfuse: op {op!r} has no provider {name!r} (it has: {', '.join(known)}); skipping it.")


def _priority_and_origin(op: str) -> tuple[tuple[str, ...], bool]:
    """The provider names for ``op`` and whether a user chose them (rather than the platform)."""
    if op in _USER_PRIORITY:
        return _USER_PRIORITY[op], True
    if "*" in _USER_PRIORITY:
        return _USER_PRIORITY["*"], True
    if settings.value("TRANSFUSE_FORCE_NATIVE"):
        return ("native",), True
    env = settings.value("TRANSFUSE_OP_PRIORITY")
    if op in env:
        return env[op], True
    return current_platform().priority, False


def priority(op: str) -> tuple[str, ...]:
    """The provider names tried for ``op``, strongest setting first (native is always added last)."""
    return _priority_and_origin(op)[0]


def set_priority(providers: list[str] | tuple[str, ...] | None, op: str | None = None) -> None:
    """Set the provider order for one op (or, with ``op=None``, for every op); None clears it."""
    key = "*" if op is None else op
    if op is not None and op not in _OPS:
        raise ValueError(f"Unknown op {op!r}; the ops are: {', '.join(sorted(_OPS))}.")
    if providers is None:
        _USER_PRIORITY.pop(key, None)
    else:
        _USER_PRIORITY[key] = tuple(providers)
    for each in _OPS.values():
        each._order = None
    _changed()


def refresh() -> None:
    """Forget cached provider orders and checks, e.g. after changing TRANSFUSE_* variables."""
    for op in _OPS.values():
        op._order = None
        op._supported.clear()
    _changed()


_GENERATION = 0


def _changed() -> None:
    global _GENERATION
    _GENERATION += 1


def generation() -> int:
    """A number that changes whenever the providers or their order may have changed: whoever
    keeps the result of past dispatch (a captured CUDA graph) keys it on this."""
    return _GENERATION


def get_op(name: str) -> Op:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"Unknown op {name!r}; the ops are: {', '.join(sorted(_OPS))}.") from None


def register_provider(
    op: str,
    name: str,
    impl: Callable[..., Any],
    *,
    supported: Callable[[], bool] = _always,
    supports_args: Callable[..., bool] = _always,
    differentiable: bool = False,
    autograd: Callable[..., Any] | None = None,
) -> Provider:
    """Add a provider to an existing op: the entry point for out-of-tree kernels. ``autograd``:
    the same kernels with a backward, called when autograd needs one (see ``Provider``)."""
    return get_op(op).register(
        Provider(name, impl, supported, supports_args, differentiable, autograd=autograd)
    )


_COMPILE_MODE: dict[str, str] = {}
_COMPILE_MODES = ("native", "library")


def set_compile_mode(mode: str | None, op: str | None = None) -> None:
    """Under ``torch.compile``: inline the native code ("native", which Inductor fuses with its
    neighbours) or call the registered ``torch.ops.transfuse`` op ("library", the dispatched
    kernel as one opaque node). None restores the default (``TRANSFUSE_COMPILE_MODE`` or native)."""
    if mode is not None and mode not in _COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {_COMPILE_MODES}, not {mode!r}.")
    key = "*" if op is None else op
    if mode is None:
        _COMPILE_MODE.pop(key, None)
    else:
        _COMPILE_MODE[key] = mode


def under_compile_use_library_op(op: str, args: tuple, default: str = "native", backward: bool = False) -> bool:
    """Whether a layer being compiled calls the library op. ``default`` applies when neither
    ``set_compile_mode`` nor the environment chose (an op whose native code has data-dependent
    shapes defaults to its library op).

    When autograd needs a backward: never, unless the library op has one of its own
    (``backward``: registered with ``torch.library.register_autograd``, its gradient computed by
    the providers' backward kernels). Such an op is called in library mode, and by default
    wherever a provider with backward kernels runs on the arguments' device: Inductor's code for
    the gradient of a merged projection's split (one kernel that also concatenates the parts)
    measured several times slower on the GPU than those kernels
    (``benchmarks/results/h200_profile_train_llama_*compiled_fourteenth.txt``)."""
    chosen = _COMPILE_MODE.get(op) or _COMPILE_MODE.get("*") or settings.value("TRANSFUSE_COMPILE_MODE")
    mode = chosen or default
    if mode not in _COMPILE_MODES:
        raise ValueError(f"TRANSFUSE_COMPILE_MODE must be one of {_COMPILE_MODES}, not {mode!r}.")
    if not _needs_grad(args, {}):
        return mode == "library"
    if not backward:
        return False
    if chosen is not None:
        return chosen == "library"
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False  # a tensor subclass (a DTensor under tensor parallelism) computes its own way
    devices = {t.device.type for t in tensors}
    return len(devices) == 1 and _backward_kernels_run_on(op, devices.pop())


@torch.compiler.assume_constant_result
def _backward_kernels_run_on(op: str, device: str) -> bool:
    """Some provider of ``op`` other than native, with the backward kernels a library op's backward
    calls (``backward`` or ``backward_and_output``), runs on this platform and on ``device`` (run
    once per compiled graph, outside the trace: a constant in the graph)."""
    found = _OPS[op]
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    for provider in found.order():
        if provider is found.native:
            return False
        if provider.backward is not None or provider.backward_and_output is not None:
            return True
    return False


_PLUGINS_LOADED = False


def _load_plugins() -> None:
    """Run each ``transfuse.providers`` entry point once: it registers providers or layers."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    for ep in entry_points(group=PROVIDER_ENTRY_POINT_GROUP):
        register = ep.load()
        register()
