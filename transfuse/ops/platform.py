"""Which platform this process runs on: detected once, lazily.

Built-in platforms are cuda, rocm, xpu, mps and cpu. A package can add its own through
the entry-point group ``transfuse.platforms``: the entry point loads a ``Platform`` (or
a callable returning one, or None when its hardware is absent). Exactly one such
platform wins over the built-ins; two is an error that names both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import torch

__all__ = ["Platform", "current_platform", "current_stream_handle", "PLATFORM_ENTRY_POINT_GROUP"]

PLATFORM_ENTRY_POINT_GROUP = "transfuse.platforms"


@dataclass(frozen=True)
class Platform:
    """A platform: its name, the torch device type of its tensors, and its provider priority."""

    name: str
    device_type: str
    priority: tuple[str, ...] = ()
    out_of_tree: bool = field(default=False, compare=False)

    @property
    def is_gpu(self) -> bool:
        return self.name in ("cuda", "rocm", "xpu")


# Provider names in the order they are tried on each built-in platform; "native" is
# always tried last and is not listed.
BUILTIN_PRIORITY = {
    "cuda": ("cuda", "triton", "torch"),
    "rocm": ("triton", "torch"),
    "xpu": ("triton", "torch"),
    "mps": ("torch",),
    "cpu": ("torch",),
}


def _builtin_platform() -> Platform:
    if torch.cuda.is_available():
        name = "rocm" if torch.version.hip else "cuda"
        return Platform(name, "cuda", BUILTIN_PRIORITY[name])
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return Platform("xpu", "xpu", BUILTIN_PRIORITY["xpu"])
    if torch.backends.mps.is_available():
        return Platform("mps", "mps", BUILTIN_PRIORITY["mps"])
    return Platform("cpu", "cpu", BUILTIN_PRIORITY["cpu"])


def _out_of_tree_platforms() -> list[tuple[str, Platform]]:
    found = []
    for ep in entry_points(group=PLATFORM_ENTRY_POINT_GROUP):
        obj = ep.load()
        platform = obj if isinstance(obj, Platform) else obj()
        if platform is None:
            continue
        if not isinstance(platform, Platform):
            raise TypeError(
                f"Entry point {ep.name!r} in group {PLATFORM_ENTRY_POINT_GROUP!r} gave "
                f"{type(platform).__name__}, not a transfuse.ops.Platform."
            )
        priority = platform.priority or (platform.name, "torch")
        found.append((ep.value, Platform(platform.name, platform.device_type, priority, out_of_tree=True)))
    return found


@functools.cache
def current_platform() -> Platform:
    """The platform of this process; an out-of-tree platform wins over the built-ins."""
    plugins = _out_of_tree_platforms()
    if len(plugins) > 1:
        names = ", ".join(f"{p.name!r} (from {source})" for source, p in plugins)
        raise RuntimeError(
            f"More than one out-of-tree transfuse platform is installed: {names}. "
            "Uninstall all but one of the packages that provide them."
        )
    if plugins:
        return plugins[0][1]
    return _builtin_platform()


def _stream_handle(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# The raw handle (``cudaStream_t``) of a CUDA device's current stream, without building a Stream
# object, where torch has the binding: kernel launchers and graph keys ask for it on every call.
current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_handle)
