"""Launch compiled Triton kernels without Triton's per-call argument binding.

``kernel[grid](*args)`` re-derives, on every call, everything the compiled binary was
specialised on: it binds the arguments to the signature, classifies each one, builds a
cache key and looks the binary up. For the small calls of a decode step (one row to
normalise, eight experts to run) that host work costs more than the kernel itself.

``Kernel`` wraps a ``@triton.jit`` function and keeps the same call syntax. The first call
of each specialisation goes through Triton (which compiles and launches it) and the
``CompiledKernel`` it returns is kept under a key that records the same properties Triton
specialises on:

* tensors: dtype, and whether the data pointer is 16-byte aligned;
* integers: 32- or 64-bit, and (unless the parameter is ``do_not_specialize``) whether the
  value is 1 or a multiple of 16;
* floats, bools and None by type; constexpr values and launch options by value;
* the current device.

Later calls with the same key go straight to the compiled kernel's launcher. Anything else
(the CPU interpreter, a callable grid, launch hooks set by a profiler, an argument type
not listed above) takes Triton's own path, so the fast path can only skip work, never
change which binary runs. ``TRANSFUSE_TRITON_FAST_LAUNCH=0`` (or ``launch.FAST = False``)
sends every call through Triton's path.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import settings
from ..platform import current_stream_handle as _raw_stream
from . import interpreting

__all__ = ["Kernel"]

FAST = settings.at_import("TRANSFUSE_TRITON_FAST_LAUNCH")
# Launch options a call may pass besides constexprs; each is part of the key by value.
# (``enable_fp_fusion=False``: no multiply-add contracted into an FMA, for kernels that must round
# each product as separate PyTorch ops do.)
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


def _hook_holder() -> Any:
    """Where this Triton version keeps its launch hooks: ``triton.knobs.runtime`` or ``CompiledKernel``."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "launch_enter_hook"):
        return runtime
    from triton.compiler import CompiledKernel

    return CompiledKernel


def _hook_set(hook: Any) -> bool:
    """A launch hook is installed: None and an empty ``HookChain`` (newer Triton's default) are not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set(holder: Any) -> bool:
    """A launch hook (e.g. a profiler's) is installed: only Triton's own path calls it."""
    return _hook_set(getattr(holder, "launch_enter_hook", None)) or _hook_set(getattr(holder, "launch_exit_hook", None))


def _arg_key(arg: Any, specialize: bool | None, align: bool) -> Any:
    """What Triton's specialisation sees of one argument (``specialize`` None: a constexpr, keyed by
    value); raises TypeError for other types. Exact types first: this runs per argument per launch."""
    if specialize is None:
        return ("constexpr", arg)
    kind = type(arg)
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # before isinstance, which is slow for tensors
        return (arg.dtype, align and arg.data_ptr() % 16 == 0)
    if kind is int:
        width = "i32" if -(2**31) <= arg < 2**31 else "i64" if arg < 2**63 else "u64"
        return (width, arg == 1, arg % 16 == 0) if specialize else width
    if kind is float:
        return "fp32"
    if kind is bool:
        return "i1"
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, align and arg.data_ptr() % 16 == 0)
    raise TypeError(kind.__name__)


class _Compiled:
    """One specialisation's launcher, the handles it takes, and the values of the parameters
    after the positional ones (constexprs and defaults: fixed by the key)."""

    __slots__ = ("function", "metadata", "run", "tail")

    def __init__(self, kernel: Any, tail: tuple):
        self.run = kernel.run  # a property in some Triton versions: it loads the module first
        self.function = kernel.function
        self.metadata = kernel.packed_metadata
        self.tail = tail


class Kernel:
    """A ``@triton.jit`` function launched as ``Kernel(fn)[grid](*runtime_args, **constexprs_and_options)``.

    Runtime arguments are passed by position and constexprs and launch options
    (``num_warps``, ``num_stages``) by keyword, as at every call site in transfuse.
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self._compiled: dict[tuple, _Compiled] = {}
        params = getattr(fn, "params", None)
        # Only plain parameters are modelled: a type annotation changes how Triton specialises one.
        self._fast = (
            not interpreting()
            and params is not None
            and all(p.is_constexpr or not getattr(p, "annotation_type", "") for p in params)
        )
        if self._fast:
            self._names = tuple(p.name for p in params)
            self._specialize = tuple(None if p.is_constexpr else not p.do_not_specialize for p in params)
            self._align = tuple(not p.do_not_specialize_on_alignment for p in params)
            self._keywords = frozenset(p.name for p in params if p.is_constexpr) | _OPTIONS
            self._defaults = {p.name: p.default for p in params if p.is_constexpr and p.has_default}
            self._hooks = _hook_holder()

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        if not self._keywords.issuperset(kwargs):
            return None  # a runtime argument passed by keyword: let Triton bind it
        try:
            positional = tuple(map(_arg_key, args, self._specialize, self._align))
            # Keywords in call order: a call site always passes them in the same order.
            return (torch.cuda.current_device(), positional, tuple(kwargs.items()))
        except TypeError:  # an argument type the key does not model
            return None

    def _all_args(self, args: tuple, kwargs: dict) -> tuple | None:
        """Every parameter's value in declaration order, as Triton passes them to the launcher."""
        values = list(args)
        for name in self._names[len(args) :]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self._defaults:
                values.append(self._defaults[name])
            else:
                return None
        return tuple(values)

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        if not (FAST and self._fast) or callable(grid) or len(args) > len(self._names) or _hooks_set(self._hooks):
            self.fn[grid](*args, **kwargs)
            return
        key = self._key(args, kwargs)
        try:
            compiled = self._compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable constexpr: no key
            key = compiled = None
        if compiled is None:
            kernel = self.fn[grid](*args, **kwargs)
            values = self._all_args(args, kwargs)
            if key is not None and values is not None and hasattr(kernel, "packed_metadata"):
                self._compiled[key] = _Compiled(kernel, values[len(args) :])
            return
        values = args + compiled.tail
        device = key[0]
        stream = _raw_stream(device)
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.metadata, None, None, None, *values)
