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
then the platform's own list, ahead of which go the providers it does not name (registered from
outside, in the order they were registered).

An op is declared once, from its native function (``Op``): with ``library=True`` the
``torch.library`` op (``transfuse::<name>``, its schema from the native signature) and its fake
(the native function, or ``fake``) are derived from it, and so is the switch that ``torch.compile``
takes (``Op.__call__`` inlines the native code, or calls the library op, see
``under_compile_use_library_op``). Every provider's signature is checked against the native one
when it registers. Before a provider runs for a configuration of arguments it has not run before,
``conformance`` judges it against the native definition at every shape class the op's sampler and
the providers' declared ``thresholds`` tell apart; a provider that fails is passed over.

Inside ``batch_invariant_mode()`` (entered by a model that ``transfuse.rewrite(...,
batch_invariant=True)`` made batch-invariant, for the length of its forward) only providers that
declare ``batch_invariant`` run, and none defers: the provider an op gets never depends on the
row count, and each of those computes a row the same way whatever else is in the batch. The choice
and those providers run without the mode's torch-function handlers; a native definition runs with
them, which make its torch calls invariant.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten

from .. import settings
from . import conformance
from .conformance import Rows, Sampler
from .platform import current_platform

__all__ = [
    "Dispatch",
    "Op",
    "Provider",
    "get_op",
    "priority",
    "refresh",
    "register_provider",
    "unregister_provider",
    "set_priority",
    "trace",
    "set_compile_mode",
    "under_compile_use_library_op",
    "batch_invariant_active",
    "batch_invariant_mode",
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
    # Where this provider's code changes path: ``{dimension: (size, ...)}``, each size the first of
    # a new path along a dimension the op's sampler varies ("rows", "tokens", "length", "batch"),
    # or a function of the call's arguments giving that (for sizes that depend on the device or the
    # shapes). Conformance checks both sides of each; a branch not declared here is not sought.
    thresholds: Mapping[str, Sequence[int]] | Callable[..., Mapping[str, Sequence[int]]] | None = None
    # The error rule's constants for this provider's results, per dtype (``accuracy.Tolerance``),
    # where the rule's own would refuse honest work: stated beside the registration, never a
    # silent widening. None: the rule's own.
    tolerance: Callable[[torch.dtype], Any] | None = None
    # Computes each row with a reduction order that depends on nothing but the row and the op's
    # other arguments' shapes (not the row count, the other rows, the row's place, or a CUDA-graph
    # capture), with one launch configuration for every row count, inside ``batch_invariant_mode``:
    # the only providers, with native, that run there.
    batch_invariant: bool = False

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
    """A dispatched op: a native definition plus named providers, picked per call.

    Declared once, from ``native``: ``sampler`` says how conformance makes inputs for it (default:
    the rows of its first argument); ``library=True`` registers the ``torch.library`` op
    ``transfuse::<name>`` with ``native``'s signature as its schema and ``fake`` (default ``native``
    itself) as its fake, and makes ``torch.compile`` call it where ``under_compile_use_library_op``
    says (``compile_default``; ``autograd``, a ``(backward, setup_context)`` pair, registers its
    backward); without it, compiled code inlines ``native``. ``mutates``: the arguments the op
    writes in place.
    """

    def __init__(
        self,
        name: str,
        native: Callable[..., Any],
        *,
        sampler: Sampler | None = None,
        library: bool = False,
        fake: Callable[..., Any] | None = None,
        mutates: tuple[str, ...] = (),
        compile_default: str = "native",
        autograd: tuple[Callable, Callable] | None = None,
    ):
        if name in _OPS:
            raise ValueError(f"An op named {name!r} is already defined.")
        self.name = name
        self.native = Provider("native", native, differentiable=True)
        self.sampler = sampler if sampler is not None else Rows(next(iter(inspect.signature(native).parameters)))
        self.sampler.bind(native)
        self.compile_default = compile_default
        self.library = _library_op(name, native, fake, mutates, autograd) if library else None
        self.library_backward = autograd is not None
        self._providers: dict[str, Provider] = {}
        self._supported: dict[str, bool] = {}
        self._order: tuple[Provider, ...] | None = None
        # conformance verdicts: {(grad, configuration key): {provider name: Verdict}}
        self._verdicts: dict[Hashable, dict[str, conformance.Verdict]] = {}
        _OPS[name] = self

    def register(self, provider: Provider) -> Provider:
        """Add (or replace) a provider of this op; its signature must be the native definition's."""
        if provider.name == "native":
            raise ValueError("The native provider is the op's own definition; register under another name.")
        _check_signature(self, provider)
        self._providers[provider.name] = provider
        self._supported.pop(provider.name, None)
        self._order = None
        self._verdicts.clear()
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
            if not chosen_by_user:  # the platform's list: providers from outside it go first
                names = (*(n for n in _FROM_OUTSIDE if n in providers and n not in names), *names)
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
        deferred, key = None, None
        invariant = _BATCH_INVARIANT.get()
        for provider in self.order():
            if grad and not provider.has_backward:
                continue
            if invariant and not provider.batch_invariant:
                continue
            if provider is self.native:
                break
            if provider.supports_args(*args, **kwargs):
                if key is None:
                    key = (grad, self.sampler.key(args, kwargs))
                    if conformance._WATCHERS:
                        conformance.note_consulted(self, grad, key, args, kwargs)
                if not (conformance._ASSUMED or self._conforms(provider, key, args, kwargs)):
                    continue
                if deferred is None and not invariant and provider.defers(*args, **kwargs):
                    deferred = provider
                    continue
                return provider
        return deferred or self.native

    def verdicts(self, key: Hashable) -> list[conformance.Verdict]:
        """The conformance verdicts of this op's providers for one configuration (``(grad, the
        sampler's key)``), as far as they were checked."""
        return list(self._verdicts.get(key, {}).values())

    def _conforms(self, provider: Provider, key: Hashable, args: tuple, kwargs: dict) -> bool:
        """Whether ``provider`` passed its conformance check for this configuration (checked now,
        once, where it can be; where it cannot, the provider is passed over for this call)."""
        verdict = self._verdicts.get(key, {}).get(provider.name)
        if verdict is None:
            if not conformance.can_check_now(args, kwargs):
                return False
            verdict = conformance.check(self, key[0], key, args, kwargs).get(provider.name)
        return verdict is not None and verdict.passed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if self.library is not None and under_compile_use_library_op(
                self.name, args, self.compile_default, backward=self.library_backward
            ):
                return self.library(*args, **kwargs)
            return self.native.impl(*args, **kwargs)  # plain torch ops: Inductor fuses them with their neighbours
        if _BATCH_INVARIANT.get():
            # The choice and a provider declared ``batch_invariant``, which computes in its own
            # kernels, run without the mode's handlers (shapes, strides, allocations, launches);
            # the native definition runs with them, which make its torch calls invariant. A library
            # op called from compiled code runs without them on the stack: it enters them itself.
            if isinstance(torch.overrides._get_current_function_mode(), _INVARIANT_MODES):
                with torch.overrides._pop_mode_temporarily():
                    grad, provider = self._chosen(args, kwargs)
                    if provider is not self.native:
                        return provider.implementation(grad)(*args, **kwargs)
                return provider.implementation(grad)(*args, **kwargs)
            grad, provider = self._chosen(args, kwargs)
            if provider is self.native and _INVARIANT_MODES:
                with _INVARIANT_MODES[0]():
                    return provider.implementation(grad)(*args, **kwargs)
            return provider.implementation(grad)(*args, **kwargs)
        grad, provider = self._chosen(args, kwargs)
        return provider.implementation(grad)(*args, **kwargs)

    def _chosen(self, args: tuple, kwargs: dict) -> tuple[bool, Provider]:
        grad = _needs_grad(args, kwargs)
        provider = self._select(grad, args, kwargs)
        if _TRACES:
            _record(self.name, provider.name, args, kwargs, grad)
        return grad, provider

    def __repr__(self) -> str:
        return f"Op({self.name!r}, providers={list(self.providers)})"


# The torch-function modes of a batch-invariant forward (``batch_invariant.InvariantFunctions``,
# which registers itself here): only the native definitions run their torch calls through them.
_INVARIANT_MODES: tuple[type, ...] = ()


# Whether the code running now is inside a batch-invariant model's forward (``batch_invariant_mode``).
_BATCH_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("transfuse_batch_invariant", default=False)


# How many batch-invariant forwards are running, in any thread: what compiled code reads (Dynamo
# guards a module global; it cannot trace a context variable's read). While one runs, code compiled
# anywhere in the process calls library ops, which compute what inlined code would.
_INVARIANT_CALLS = 0


def batch_invariant_active() -> bool:
    """Whether dispatch is in batch-invariant mode here (see the module docstring)."""
    return _BATCH_INVARIANT.get()


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    """Dispatch in batch-invariant mode (or, ``on=False``, out of it) inside the block, in this
    thread or task only. A batch-invariant model enters it for its own forward."""
    global _INVARIANT_CALLS
    token = _BATCH_INVARIANT.set(on)
    _INVARIANT_CALLS += int(on)
    try:
        yield
    finally:
        _INVARIANT_CALLS -= int(on)
        _BATCH_INVARIANT.reset(token)


def _record(op: str, provider: str, args: tuple, kwargs: dict, grad: bool = False) -> None:
    if conformance.checking():  # a check's own calls are not the caller's
        return
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
        op._verdicts.clear()
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
    thresholds: Mapping[str, Sequence[int]] | Callable[..., Mapping[str, Sequence[int]]] | None = None,
) -> Provider:
    """Add a provider to an existing op: the entry point for out-of-tree kernels. ``autograd``:
    the same kernels with a backward, called when autograd needs one; ``thresholds``: the sizes at
    which its code changes path (see ``Provider``).

    Where the priority is the platform's own, a provider registered here runs before the
    platform's built-in ones (those registered here earlier first); a priority set by the user
    (``set_priority``, ``TRANSFUSE_OP_PRIORITY``) runs what it names. Either way it runs only for
    configurations where it passed its conformance check."""
    provider = get_op(op).register(
        Provider(name, impl, supported, supports_args, differentiable, autograd=autograd, thresholds=thresholds)
    )
    if name not in _FROM_OUTSIDE:
        _FROM_OUTSIDE.append(name)
        for each in _OPS.values():
            each._order = None
    return provider


def unregister_provider(op: str, name: str) -> None:
    """Remove a provider that ``register_provider`` added."""
    found = get_op(op)
    if name not in found._providers:
        raise ValueError(f"Op {op!r} has no provider {name!r} (it has: {', '.join(found.providers)}).")
    del found._providers[name]
    found._supported.pop(name, None)
    found._verdicts.clear()
    if not any(name in each._providers for each in _OPS.values()) and name in _FROM_OUTSIDE:
        _FROM_OUTSIDE.remove(name)
    for each in _OPS.values():
        each._order = None
    _changed()


# Names of providers registered through ``register_provider``, in order.
_FROM_OUTSIDE: list[str] = []


def _check_signature(op: Op, provider: Provider) -> None:
    """A provider takes the native definition's parameters, in order (a ``*args`` catch-all, as a
    lazily imported kernel's wrapper has, is taken on trust)."""
    for what, fn in (("impl", provider.impl), ("autograd", provider.autograd)):
        if fn is None:
            continue
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            continue
        native = list(inspect.signature(op.native.impl).parameters.values())
        if len(params) != len(native) or any(
            a.name != b.name for a, b in zip(params, native) if a.kind is not a.VAR_KEYWORD
        ):
            raise TypeError(
                f"Provider {provider.name!r} of op {op.name!r}: its {what} takes ({', '.join(p.name for p in params)}), "
                f"but the op's native definition takes ({', '.join(p.name for p in native)}); give it the same parameters."
            )


def _library_op(name: str, native: Callable, fake: Callable | None, mutates: tuple[str, ...], autograd) -> Any:
    """``transfuse::<name>``, with ``native``'s signature as its schema: it dispatches at run time."""
    op_name = name

    def run(*args: Any, **kwargs: Any) -> Any:
        return _OPS[op_name](*args, **kwargs)

    # Annotations resolved in the native definition's module, for the schema inferred from them.
    run.__signature__ = inspect.signature(native, eval_str=True)  # type: ignore[attr-defined]
    defined = torch.library.custom_op(f"transfuse::{name}", run, mutates_args=mutates)
    defined.register_fake(fake if fake is not None else native)
    if autograd is not None:
        backward, setup_context = autograd
        defined.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.transfuse, name)


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
    (``benchmarks/results/h200_profile_train_llama_compiled*_2026-12-02.txt``).

    While a batch-invariant forward runs: always. The op is then one node that computes what the
    eager path's call computes (its chosen provider's kernels), neither reordered by Inductor nor
    replaced by the native definition's arithmetic (a GPU provider rounds once where the native
    code rounds after each step)."""
    if _INVARIANT_CALLS:
        return True
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
