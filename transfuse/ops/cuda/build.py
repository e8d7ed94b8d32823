"""Build the CUDA C++ kernels of ``transfuse/csrc/`` with torch's C++ extension tooling, once, on first use.

The build needs a CUDA build of torch, a visible NVIDIA GPU, ``nvcc`` and the sources. It
is compiled for the GPUs present (torch's default; ``TORCH_CUDA_ARCH_LIST`` overrides it)
into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), so later processes only load it. Where it cannot be built,
one warning line says why and the CUDA providers step aside for the next ones;
``python -m transfuse.ops.cuda`` builds verbosely, to read the compiler's own output.

The sources live inside the package, in ``transfuse/csrc/`` (plain files: a checkout, an
editable install, a wheel and an sdist all carry them the same way; ``package-data`` in
pyproject.toml). ``$TRANSFUSE_CSRC`` points the loader elsewhere.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from ... import settings
from ...progress import note
from ..platform import current_platform

__all__ = ["EXTENSION_NAME", "SOURCES", "build", "csrc_dir", "extension", "unavailable_reason"]

EXTENSION_NAME = "transfuse_cuda"
SOURCES = ("bindings.cpp", "rms_norm.cu", "act_and_mul.cu")
_PACKAGE_DIR = Path(__file__).resolve().parents[2]


def csrc_dir() -> Path | None:
    """The directory holding the CUDA sources, or None when none is installed."""
    candidates = [_PACKAGE_DIR / "csrc"]
    chosen = settings.value("TRANSFUSE_CSRC")
    if chosen is not None:
        candidates.insert(0, Path(chosen))
    for candidate in candidates:
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    return None


def unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot be built in this process, or None when a build can be tried."""
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is not a CUDA build"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if CUDA_HOME is None:
        return "nvcc was not found; set CUDA_HOME to the CUDA toolkit"
    if csrc_dir() is None:
        return "the CUDA sources (transfuse/csrc/) are not installed; set TRANSFUSE_CSRC to a directory holding them"
    return None


def _sources_digest(directory: Path) -> str:
    """A digest of every file of the sources: torch's build cache watches the listed sources, not the headers."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


# torch's build lock (a file in the build directory) outlives a process killed while building, and
# every later build then waits on it for ever; a build takes well under this long.
_STALE_LOCK_S = 300


def _clear_stale_lock(verbose: bool) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(EXTENSION_NAME, verbose)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > _STALE_LOCK_S:
        warnings.warn(f"transfuse: removing a build lock left {age:.0f} s ago by a build that did not finish ({lock}).")
        lock.unlink(missing_ok=True)


def build(verbose: bool = False) -> ModuleType:
    """Compile the extension, or load the cached build; raises what torch's tooling raises on failure."""
    from torch.utils.cpp_extension import load

    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"transfuse's CUDA kernels cannot be built here: {reason}.")
    source_dir = csrc_dir()
    _clear_stale_lock(verbose)
    version = f"-DTRANSFUSE_CSRC_DIGEST={_sources_digest(source_dir)}"
    started = time.perf_counter()
    fresh = not _built_before()
    if fresh:
        note("transfuse: building the CUDA kernels, once per machine and torch version (about 30 s)...")
    module = load(
        name=EXTENSION_NAME,
        sources=[str(source_dir / name) for name in SOURCES],
        extra_include_paths=[str(source_dir)],
        extra_cflags=["-O3", version],
        extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo", version],
        verbose=verbose,
    )
    if fresh:
        note(f"transfuse: CUDA kernels built in {time.perf_counter() - started:.0f} s")
    return module


def _built_before() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory(EXTENSION_NAME, False)) / f"{EXTENSION_NAME}.so").is_file()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@functools.cache
def extension() -> ModuleType | None:
    """The built extension, or None (with one warning line on a CUDA platform) when it cannot be had."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return build()
        except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
            reason = f"the build failed ({_first_line(exc)})"
    if current_platform().name == "cuda":
        warnings.warn(
            f"transfuse: CUDA C++ kernels unavailable: {reason}; using the next provider "
            "(`python -m transfuse.ops.cuda` shows the build log).",
            stacklevel=2,
        )
    return None
