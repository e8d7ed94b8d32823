"""Provider conformance: every provider judged against its op's native definition at every shape
class the dispatch tells apart, before it runs.

A module's verification (``rewriter/``) sees one probe: one shape, the provider the dispatcher
picked for it. Providers branch on shape (a row count from which a kernel tiles differently, a
token count below which MoE takes its decode path, a split count for long caches) and on where
they run (under a CUDA-graph capture the CUDA ops leave small calls to Triton), so a kernel wrong
only at one decode step's shape would pass. Here each provider whose argument check accepts a
class is run on it, in the call's dtype and on its device, with random non-zero inputs, and
judged by the rule every fused computation meets (``accuracy``) against a float64 (or float32)
native run of the same inputs, next to the native run in the call's dtype.

The classes come from the op's ``Sampler`` (the call as it was made, one row, a few rows, a batch
of several sequences, rows cut from a wider tensor, and the op's own data classes, such as an
expert that receives no token) and from each provider's declared ``thresholds``: both sides of
every size at which a provider says its code changes path. A branch behind a threshold nobody
declared cannot be found this way: the declarations are where a provider states them.

Verdicts are kept per op, provider and call configuration (the sampler's ``key``: dtypes, the
device, widths and flags, without the sizes the classes vary) and autograd (a call that needs a
backward is judged on its gradients too, against native autograd), for the process. A provider
that fails is not dispatched for that configuration; the next one runs. A configuration first seen
where nothing can be checked (inside a CUDA-graph capture, on meta or fake tensors) runs native
code until an ordinary call has checked it: never an unchecked kernel.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten

from .accuracy import RULE, Judgement, Tolerance, judge_tensors

if TYPE_CHECKING:
    from .dispatch import Op, Provider

__all__ = [
    "Rows",
    "Sampler",
    "ShapeClass",
    "Verdict",
    "assumed",
    "can_check_now",
    "check",
    "watching",
]

logger = logging.getLogger("transfuse")

_LOCK = threading.RLock()
_THREAD = threading.local()


@dataclass(frozen=True)
class ShapeClass:
    """One class of inputs: a name for the report and the sizes (and layout, and data) a sampler
    makes it from."""

    name: str
    sizes: tuple[tuple[str, int], ...] = ()
    layout: str = "contiguous"  # "contiguous", "as called", "strided"
    data: str = "random"

    def size(self, dim: str, default: int) -> int:
        return dict(self.sizes).get(dim, default)


DECLINED = "verify.declined"  # the tag of a provider whose own argument check takes none of the classes


@dataclass(frozen=True)
class Verdict:
    """A provider's conformance for one op configuration."""

    op: str
    provider: str
    config: str  # the configuration, in words
    grad: bool
    classes: tuple[str, ...]  # the classes it was run on
    passed: bool
    reason: str = ""  # why it failed
    tag: str = "verify.provider"

    def describe(self) -> str:
        what = f"{self.op} by {self.provider!r} ({self.config}{', with gradients' if self.grad else ''})"
        if self.passed:
            return f"{what}: conforms at {', '.join(self.classes)}"
        return f"{what}: {self.reason}"


def _device_kind(t: torch.Tensor) -> str:
    # ``is_cuda``/``is_cpu`` first: building ``t.device`` costs several times more, on every call.
    return "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type


def _tensor_key(t: torch.Tensor, row: bool) -> tuple:
    """A tensor's part of a configuration: dtype, device and, for a tensor of rows, its width (the
    number of rows is what the classes vary), else its whole shape."""
    return (t.dtype, _device_kind(t), (t.shape[-1] if t.dim() else ()) if row else t.shape)


_SCALARS = (bool, int, float, str, type(None))


def _static_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return _tensor_key(value, False)
    if isinstance(value, (list, tuple)):
        return tuple(_static_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _static_key(v)) for k, v in value.items())
    return value


class Sampler:
    """What conformance needs of an op: the configuration of a call (``key``), the classes of inputs
    to check it at (``classes``), and each class's inputs (``make``). Subclasses say which arguments
    carry the sizes that vary; every other argument is kept from the call."""

    # Arguments that autograd differentiates in a training call (their gradients are compared);
    # None: every floating tensor argument.
    grads: tuple[str, ...] | None = None

    def bind(self, native: Callable) -> None:
        """Learn the positions of the native definition's parameters (once, at definition)."""
        self.names = tuple(inspect.signature(native).parameters)

    def position(self, name: str) -> int:
        return self.names.index(name)

    def argument(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The argument of a call bound to the native definition's parameter ``name``."""
        at = self.position(name)
        return args[at] if at < len(args) else kwargs[name]

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        raise NotImplementedError

    def describe(self, args: tuple, kwargs: dict) -> str:
        """The configuration in words, for the report."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            return "no tensors"
        return f"{str(tensors[0].dtype).replace('torch.', '')} on {tensors[0].device.type}"

    def classes(self, args: tuple, kwargs: dict, thresholds: dict[str, set[int]]) -> list[ShapeClass]:
        raise NotImplementedError

    def make(self, shape_class: ShapeClass, args: tuple, kwargs: dict, generator: torch.Generator) -> tuple[tuple, dict]:
        raise NotImplementedError

    def mutated(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """Positions of the arguments the op writes in place (compared like outputs)."""
        return ()

    def comparable(self, outputs: list[torch.Tensor], args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The op's results on these arguments as they are compared with the original's: as they
        are, unless the op's definition leaves something to the implementation (an order)."""
        return outputs

    def backward_forms(self, provider: Provider) -> list[tuple[str, Callable]]:
        """The provider's own backward entry points, each as ``(name, run)`` with ``run(grads,
        args, kwargs)`` giving the gradients of the ``grads`` arguments (those not given: None)."""
        return []


def _random_like(shape: Sequence[int], dtype: torch.dtype, device: torch.device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Non-zero random values of ``shape``: normal, on ``device``, drawn from ``generator``."""
    if not dtype.is_floating_point:
        raise TypeError(f"no random values of {dtype} here")
    out = torch.randn(tuple(shape), dtype=torch.float32, device=device, generator=generator) * scale
    return out.to(dtype)


class Rows(Sampler):
    """An op over the rows of some tensor arguments (``rows``: their names), which share every
    dimension but the last; everything else is kept from the call. Classes: the call as made,
    1 row, 3 rows, a batch of 2 sequences of 5, rows cut from a wider tensor at an odd offset, and
    both sides of each declared ``"rows"`` threshold."""

    def __init__(self, *rows: str, grads: tuple[str, ...] | None = None, scale: float = 1.0,
                 mutates: tuple[str, ...] = ()):  # fmt: skip
        self.rows = rows
        self.grads = grads
        self.scale = scale
        self.mutates = mutates

    def bind(self, native: Callable) -> None:
        super().bind(native)
        self._row_positions = frozenset(self.position(n) for n in self.rows if n in self.names)

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        rows = self._row_positions
        parts = [
            (_tensor_key(a, i in rows) if isinstance(a, torch.Tensor) else a if isinstance(a, _SCALARS) else _static_key(a))
            for i, a in enumerate(args)
        ]
        if kwargs:
            parts += [(name, _tensor_key(value, name in self.rows) if isinstance(value, torch.Tensor) else _static_key(value))
                      for name, value in kwargs.items()]  # fmt: skip
        return tuple(parts)

    def _first_row(self, args: tuple, kwargs: dict) -> torch.Tensor:
        for name in self.rows:
            value = _argument(self, name, args, kwargs)
            if isinstance(value, torch.Tensor):
                return value
        raise ValueError(f"none of {self.rows} is a tensor in this call")

    def describe(self, args: tuple, kwargs: dict) -> str:
        x = self._first_row(args, kwargs)
        return f"{str(x.dtype).replace('torch.', '')} on {x.device.type}, rows of {x.shape[-1]}"

    def classes(self, args: tuple, kwargs: dict, thresholds: dict[str, set[int]]) -> list[ShapeClass]:
        x = self._first_row(args, kwargs)
        found = [
            ShapeClass(f"as called ({'x'.join(map(str, x.shape[:-1])) or 1} rows)", layout="as called"),
            ShapeClass("1 row", (("rows", 1),)),
            ShapeClass("3 rows", (("rows", 3),)),
            ShapeClass("2 sequences of 5", (("batch", 2), ("rows", 5))),
            ShapeClass("7 rows cut from wider rows", (("rows", 7),), layout="strided"),
        ]
        for size in sorted(thresholds.get("rows", ())):
            for n in (size - 1, size):
                if n >= 1:
                    found.append(ShapeClass(f"{n} rows", (("rows", n),)))
        return _unique(found)

    def make(self, shape_class: ShapeClass, args: tuple, kwargs: dict, generator: torch.Generator) -> tuple[tuple, dict]:
        def fresh(value: torch.Tensor) -> torch.Tensor:
            if shape_class.layout == "as called":
                return _like_call(value, generator, self.scale)
            width = value.shape[-1]
            rows = shape_class.size("rows", 1)
            batch = shape_class.size("batch", 0)
            shape = (batch, rows, width) if batch else (rows, width)
            if shape_class.layout == "strided":
                wide = _random_like((rows, width + 5), value.dtype, value.device, generator, self.scale)
                return wide[:, 1 : width + 1]
            return _random_like(shape, value.dtype, value.device, generator, self.scale)

        return _replace(self, args, kwargs, {n: fresh for n in self.rows})

    def mutated(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        return tuple(self.position(n) for n in self.mutates)


def _unique(classes: list[ShapeClass]) -> list[ShapeClass]:
    seen, out = set(), []
    for c in classes:
        if (c.sizes, c.layout, c.data) not in seen:
            seen.add((c.sizes, c.layout, c.data))
            out.append(c)
    return out


def _argument(sampler: Sampler, name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    i = sampler.position(name)
    return args[i] if i < len(args) else None


def _replace(sampler: Sampler, args: tuple, kwargs: dict, makers: dict[str, Callable]) -> tuple[tuple, dict]:
    """The call's arguments with each tensor named in ``makers`` replaced by ``makers[name](it)``."""
    args, kwargs = list(args), dict(kwargs)
    for name, make in makers.items():
        if name in kwargs:
            if isinstance(kwargs[name], torch.Tensor):
                kwargs[name] = make(kwargs[name])
            continue
        i = sampler.position(name)
        if i < len(args) and isinstance(args[i], torch.Tensor):
            args[i] = make(args[i])
    return tuple(args), kwargs


def _like_call(value: torch.Tensor, generator: torch.Generator, scale: float) -> torch.Tensor:
    """Fresh random values in ``value``'s shape, strides and offset within its storage (so its
    alignment and layout, which a kernel's argument check may read, are the call's)."""
    extent = value.storage_offset() + sum((s - 1) * st for s, st in zip(value.shape, value.stride())) + 1
    if value.numel() == 0:
        extent = value.storage_offset() + 1
    storage = _random_like((extent,), value.dtype, value.device, generator, scale)
    return storage.as_strided(value.shape, value.stride(), value.storage_offset())


# ---- running a check -----------------------------------------------------------------------


def can_check_now(args: tuple, kwargs: dict) -> bool:
    """Whether a check can run at this call: real tensors (not meta, fake or another subclass), no
    CUDA-graph capture under way, no ``torch.compile`` trace, no dispatch mode intercepting."""
    if torch.compiler.is_compiling():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return False
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor):
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:
                return False
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
    return True


_WATCHERS: list[list] = []
_ASSUMED: list[bool] = []


@contextlib.contextmanager
def assumed() -> Iterator[None]:
    """Inside the block, providers run without conformance checks: for callers that compare a
    provider with the native definition themselves (kernel tests, kernel benchmarks)."""
    _ASSUMED.append(True)
    try:
        yield
    finally:
        _ASSUMED.pop()


@contextlib.contextmanager
def watching() -> Iterator[list]:
    """Record, inside the block, each (op, grad, key, args, kwargs) whose providers a call consulted:
    the configurations a rewritten model runs, for its report and for checks with gradients."""
    log: list = []
    _WATCHERS.append(log)
    try:
        yield log
    finally:
        _WATCHERS.remove(log)


def note_consulted(op: Op, grad: bool, key: Hashable, args: tuple, kwargs: dict) -> None:
    for log in _WATCHERS:
        log.append((op, grad, key, args, kwargs))


def check(op: Op, grad: bool, key: Hashable, args: tuple, kwargs: dict) -> dict[str, Verdict]:
    """Judge every provider of ``op`` in its current order that has no verdict for this
    configuration yet; the verdicts, by provider name (also kept on the op)."""

    def judge_waiting() -> dict[str, Verdict]:
        with _LOCK:
            known = op._verdicts.setdefault(key, {})
            waiting = [p for p in op.order() if p is not op.native and p.name not in known and (p.has_backward or not grad)]
            found = _check(op, grad, args, kwargs, waiting) if waiting else {}
            known.update(found)
        return found

    # A check a provider's own code asks for (a backward that dispatches) runs on the checking
    # thread itself; any other on a thread of its own.
    found = judge_waiting() if getattr(_THREAD, "checking", False) else _isolated(judge_waiting)
    for verdict in found.values():
        if not verdict.passed and verdict.tag != DECLINED:
            logger.warning("transfuse: %s; the next provider runs instead.", verdict.describe())
    return op._verdicts[key]


def _check(op: Op, grad: bool, args: tuple, kwargs: dict, providers: list[Provider]) -> dict[str, Verdict]:
    sampler = op.sampler
    thresholds: dict[str, set[int]] = {}
    for provider in providers:
        for dim, sizes in _thresholds(provider, args, kwargs).items():
            thresholds.setdefault(dim, set()).update(int(s) for s in sizes)
    config = sampler.describe(args, kwargs)
    classes = sampler.classes(args, kwargs, thresholds)
    device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    generator = torch.Generator(device=device).manual_seed(0)
    results: dict[str, list] = {p.name: [] for p in providers}
    failures: dict[str, tuple[str, str]] = {}
    with _clean_state(device):
        for shape_class in classes:
            sample = sampler.make(shape_class, args, kwargs, torch.Generator(device=device).manual_seed(0))
            taking = [p for p in providers if p.name not in failures and _accepts(op, p, grad, sample)]
            if not taking:
                continue
            for provider, verdict in _judge_class(op, grad, shape_class, (args, kwargs), taking, generator):
                if verdict.passed:
                    results[provider.name].append(shape_class.name)
                else:
                    failures[provider.name] = (f"at {shape_class.name}: {verdict.reason}", verdict.tag)
    verdicts = {}
    for provider in providers:
        if provider.name in failures:
            reason, tag = failures[provider.name]
            verdicts[provider.name] = Verdict(op.name, provider.name, config, grad, tuple(results[provider.name]), False,
                                              f"not conformant {reason}")  # fmt: skip
        elif results[provider.name]:
            verdicts[provider.name] = Verdict(op.name, provider.name, config, grad, tuple(results[provider.name]), True)
        else:
            # Not a fault: the provider does not compute this form of the op (``F.rms_norm`` and a
            # norm that rounds otherwise); it is not dispatched here, and nobody is warned.
            verdicts[provider.name] = Verdict(
                op.name, provider.name, config, grad, (), False, "its argument check accepted none of the classes checked",
                tag=DECLINED,
            )
    return verdicts


# A class whose results are small is drawn again (new random values, the same shapes) until its
# results hold this many elements, so that a scale error of a percent stands out of the rounding
# noise even at one decode step's row; at most _MOST_DRAWS draws.
_ENOUGH_ELEMENTS = 4096
_MOST_DRAWS = 16


def _judge_class(op: Op, grad: bool, shape_class: ShapeClass, call: tuple[tuple, dict], providers: list[Provider],
                 generator: torch.Generator) -> list[tuple[Provider, Judgement]]:  # fmt: skip
    """Each provider's verdict on one class (drawn from the call's arguments), over as many draws
    as ``_ENOUGH_ELEMENTS`` asks."""
    sample = op.sampler.make(shape_class, *call, generator)
    draws: dict[str, list] = {p.name: [] for p in providers}
    failed: dict[str, Judgement] = {}
    elements = 0
    while True:
        expected = _expected(op, grad, sample)
        for provider in providers:
            if provider.name in failed:
                continue
            try:
                draws[provider.name].append((_provider_results(op, provider, grad, sample, expected), expected))
            except _Refused as exc:
                failed[provider.name] = Judgement(False, str(exc))
            except Exception as exc:  # a provider that raises on arguments it accepted fails its check
                failed[provider.name] = Judgement(False, f"it raised {type(exc).__name__}: {exc}")
        elements += sum(t.numel() for t in expected.original["output"])
        if elements >= _ENOUGH_ELEMENTS or len(next(iter(draws.values()))) >= _MOST_DRAWS:
            break
        sample = op.sampler.make(shape_class, *call, generator)
    return [(p, failed.get(p.name) or _judge_draws(p, draws[p.name], sample)) for p in providers]


def _thresholds(provider: Provider, args: tuple, kwargs: dict) -> dict[str, Sequence[int]]:
    declared = provider.thresholds
    if declared is None:
        return {}
    return declared(*args, **kwargs) if callable(declared) else declared


def checking() -> bool:
    """Whether this thread is running a conformance check."""
    return getattr(_THREAD, "checking", False)


def _isolated(work: Callable[[], Any]) -> Any:
    """``work()`` on a thread of its own: autograd's mode, inference mode, autocast, saved-tensor
    hooks and dispatch modes are thread-local, so a check made in the middle of a caller's forward
    (under ``no_grad``, inside a profiler, with hooks counting what autograd saves) neither sees
    the caller's state nor leaves a trace in it."""
    result: list = []

    def run() -> None:
        _THREAD.checking = True
        try:
            result.append((True, work()))
        except BaseException as exc:  # handed back to the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name="transfuse-conformance")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def _clean_state(device: torch.device):
    """On the check's own thread: no autograd unless a check asks for it, on the samples' device."""
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        stack.enter_context(torch.no_grad())
        yield


def _accepts(op: Op, provider: Provider, grad: bool, sample: tuple[tuple, dict]) -> bool:
    args, kwargs = _with_grads(op, sample) if grad else sample
    with torch.enable_grad() if grad else contextlib.nullcontext():
        try:
            return bool(provider.supports_args(*args, **kwargs))
        except Exception:  # an argument check that cannot read these arguments does not take them
            return False


def _copy(sample: tuple[tuple, dict], dtype: torch.dtype | None = None) -> tuple[tuple, dict]:
    """A fresh copy of the sample's tensors (ops may write their inputs), floating ones cast to
    ``dtype`` when given; strides are kept where no cast happens."""

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if dtype is not None and x.is_floating_point():
            return x.detach().to(dtype)
        return x.detach().clone()

    args, kwargs = sample
    return tuple(leaf(a) for a in args), {k: leaf(v) for k, v in kwargs.items()}


def _with_grads(op: Op, sample: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """The sample with its floating tensors (those the sampler's ``grads`` names, when it names
    any) as leaves that require grad."""
    args, kwargs = sample
    names, positions = op.sampler.grads, op.sampler.names

    def leaf(x: Any, name: str | None) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and (names is None or name in names):
            return x.detach().requires_grad_(True)
        return x

    named = [positions[i] if i < len(positions) else None for i in range(len(args))]
    return tuple(leaf(a, n) for a, n in zip(args, named)), {k: leaf(v, k) for k, v in kwargs.items()}


@dataclass
class _Expected:
    """Native results on one sample, by group ("output", "gradient"): in the sample's dtype (the
    original) and in higher precision (the reference, or None), and the output gradients used."""

    original: dict[str, list[torch.Tensor]]
    reference: dict[str, list[torch.Tensor]] | None
    grad_output: list = field(default_factory=list)


def _outputs(op: Op, sample: tuple[tuple, dict], output: Any) -> list[torch.Tensor]:
    """The op's result tensors, then the arguments it writes in place."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    args, kwargs = sample
    for i in op.sampler.mutated(args, kwargs):
        if i < len(args) and isinstance(args[i], torch.Tensor):
            tensors.append(args[i])
    return tensors


def _run(op: Op, fn: Callable, grad: bool, sample: tuple[tuple, dict], grad_output: list | None,
         dtype: torch.dtype | None = None) -> tuple[dict[str, list[torch.Tensor]], list]:  # fmt: skip
    """``fn`` on a fresh copy of the sample (cast to ``dtype`` when given): its results by group,
    with the gradients of the inputs that require grad for ``grad_output`` (random when None, and
    returned) when ``grad``."""
    run = _copy(sample, dtype)
    if grad:
        run = _with_grads(op, run)
    with torch.enable_grad() if grad else contextlib.nullcontext():
        outputs = _outputs(op, run, fn(*run[0], **run[1]))
    groups = {"output": [t.detach() for t in op.sampler.comparable(outputs, *run)]}
    if not grad:
        return groups, []
    differentiable = [t for t in outputs if t.requires_grad]
    if grad_output is None:
        generator = torch.Generator(device=outputs[0].device).manual_seed(1)
        grad_output = [_random_like(t.shape, t.dtype, t.device, generator) for t in differentiable]
    if len(differentiable) != len(grad_output):
        raise _Refused("its result records no backward where the native definition's does")
    groups["gradient"] = _grads(differentiable, [g.to(t.dtype) for g, t in zip(grad_output, differentiable)], run)
    return groups, grad_output


class _Refused(Exception):
    """A provider's results cannot even be compared (a reason for the verdict)."""


def _expected(op: Op, grad: bool, sample: tuple[tuple, dict]) -> _Expected:
    original, grad_output = _run(op, op.native.impl, grad, sample, None)
    coarsest = max((torch.finfo(t.dtype).eps for t in _floating(sample)), default=None)
    for dtype in (torch.float64, torch.float32):
        if coarsest is None or torch.finfo(dtype).eps >= coarsest:
            continue
        try:
            reference, _ = _run(op, op.native.impl, grad, sample, grad_output, dtype)
        except (RuntimeError, TypeError, NotImplementedError):  # no kernel in this dtype: try the next
            continue
        return _Expected(original, reference, grad_output)
    return _Expected(original, None, grad_output)


def _floating(sample: tuple[tuple, dict]) -> list[torch.Tensor]:
    return [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _grads(outputs: list[torch.Tensor], grad_output: list[torch.Tensor], sample: tuple[tuple, dict]) -> list:
    leaves = [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs or not leaves:
        return []
    with torch.enable_grad():
        found = torch.autograd.grad(outputs, leaves, grad_output, allow_unused=True)
    return [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(found, leaves)]


def _provider_results(op: Op, provider: Provider, grad: bool, sample: tuple[tuple, dict], expected: _Expected):
    """The provider's results on the sample, by group (its backward kernels' gradients as groups of
    their own, compared with native's gradients)."""
    results, _ = _run(op, provider.implementation(grad), grad, sample, expected.grad_output)
    if grad:
        for name, backward in op.sampler.backward_forms(provider):
            results[name] = [g.detach() for g in backward(expected.grad_output, *_copy(sample))]
    return results


def _stacked(draws: list[dict[str, list[torch.Tensor]]]) -> dict[str, list[torch.Tensor]]:
    """Each group's tensors of several draws, flattened and concatenated position by position."""
    return {
        group: [torch.cat([d[group][i].reshape(-1) for d in draws]) for i in range(len(tensors))]
        for group, tensors in draws[0].items()
    }


def _judge_draws(provider: Provider, draws: list, sample: tuple[tuple, dict]) -> Judgement:
    """The provider's results on every draw of one class, against native's, group by group."""
    working = _floating(sample)
    tolerance = provider.tolerance(working[0].dtype) if provider.tolerance is not None and working else RULE
    got = _stacked([results for results, _ in draws])
    original = _stacked([expected.original for _, expected in draws])
    reference = _stacked([expected.reference for _, expected in draws]) if draws[0][1].reference is not None else None
    verdict = Judgement(True, "")
    for group, tensors in got.items():
        against = group if group in original else "gradient"  # a backward kernel's: native's gradients
        names = [f"output {i}" if group == "output" else f"{group} of input {i}" for i in range(len(tensors))]
        refs = reference[against] if reference is not None else None
        verdict = judge_tensors(tensors, original[against], refs, names, tolerance=tolerance)
        if not verdict.passed:
            return verdict
    return verdict
