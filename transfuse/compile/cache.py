"""A compile cache across processes: ``transfuse.compile(model, cache_dir=...)``.

What Inductor and AOTAutograd compiled for a model in one process is kept in a file of its own
(torch's portable cache artifacts: ``torch.compiler.save_cache_artifacts``, recorded around the
model's own compiled calls only) under a key of everything that changes the compiled code, and
loaded back (``load_cache_artifacts``) by the next process that compiles a model with the same key,
before anything is compiled: Inductor then finds every graph it would compile already built. A
changed key is another file; an old one is never read for it. An entry is written after a warm-up
and at exit, where the model compiled graphs the entry did not hold. Beside it, under the same key,
Dynamo's output of the model's calls is kept (``precompiled.py``: ``KEY.dynamo``), which spares a
later process the tracing and the compiling too.

The key (``key``) hashes: the model's structure (its modules' classes and their source, rewritten
or not, and its configuration), every parameter's and buffer's name, shape, dtype, device and tensor
type (quantized tensors are subclasses), the compile options, the dispatch state (each op's
provider order and compile mode, forced native), whether the model is in batch-invariant mode,
Inductor's, AOTAutograd's and Dynamo's configuration, the parallel plan, the versions of transfuse
(its sources' hash too), torch, transformers and Triton, and the device (its name, capability and
multiprocessor count on CUDA; the CPU's instruction set otherwise).

Where the cache lives: ``cache_dir`` if given, else ``TRANSFUSE_CACHE_DIR``, else
``$XDG_CACHE_HOME/transfuse/compile`` (``~/.cache/transfuse/compile``); ``cache_dir=False`` turns
it off. An entry is written to a temporary file and renamed into place, so two processes writing
the same key at once leave one whole file; an entry that cannot be read (cut short, corrupt, or of
another torch) is ignored with a warning, removed, and written again.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from .. import settings
from ..version import __version__

__all__ = ["CompileCache", "default_dir", "key", "supported"]

_MAGIC = b"transfuse-compile-cache 1\n"
_COUNTERS = "transfuse_cache"  # torch._dynamo.utils.counters[_COUNTERS]: hit, miss, corrupt, saved


def supported() -> bool:
    """Whether this torch has portable cache artifacts (2.7 and later)."""
    compiler = getattr(torch, "compiler", None)
    return hasattr(compiler, "save_cache_artifacts") and hasattr(compiler, "load_cache_artifacts")


def default_dir() -> Path:
    chosen = settings.value("TRANSFUSE_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transfuse" / "compile"


def _counters():
    from torch._dynamo.utils import counters

    return counters[_COUNTERS]


# --- the key -------------------------------------------------------------------------------------


def _source_of(cls: type) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"


_PACKAGE_HASH: str | None = None


def _package_hash() -> str:
    """A hash of transfuse's own sources, so an edited checkout is another key at one version."""
    global _PACKAGE_HASH
    if _PACKAGE_HASH is None:
        digest = hashlib.sha256()
        root = Path(__file__).resolve().parent.parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cu", ".cpp", ".h", ".cuh") and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
        _PACKAGE_HASH = digest.hexdigest()
    return _PACKAGE_HASH


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _device_parts(model: nn.Module) -> dict[str, Any]:
    devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
    parts: dict[str, Any] = {"devices": devices}
    for name in devices:
        device = torch.device(name)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            parts[name] = [props.name, f"{props.major}.{props.minor}", props.multi_processor_count]
    if any(torch.device(d).type == "cpu" for d in devices):
        capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
        parts["cpu"] = [platform.machine(), capability]
    return parts


def _dispatch_parts() -> dict[str, Any]:
    from ..ops import dispatch

    parts: dict[str, Any] = {
        "priority": {name: list(dispatch.priority(name)) for name in sorted(dispatch._OPS)},
        "compile_mode": sorted(dispatch._COMPILE_MODE.items()),
        "compile_mode_env": settings.value("TRANSFUSE_COMPILE_MODE"),
        "force_native": settings.value("TRANSFUSE_FORCE_NATIVE"),
    }
    # A batch-invariant switch torch itself may have (transfuse's mode is the model's: ``_invariant``).
    for owner in (dispatch, getattr(torch, "_inductor", None)):
        for attribute in ("batch_invariant", "batch_invariant_mode", "is_batch_invariant"):
            value = getattr(owner, attribute, None)
            if value is not None:
                parts[f"{getattr(owner, '__name__', owner)}.{attribute}"] = repr(value() if callable(value) else value)
    return parts


def _config_parts() -> dict[str, str]:
    """Inductor's, AOTAutograd's and Dynamo's configuration, as text."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    parts = {}
    for module in (torch._inductor.config, torch._functorch.config, torch._dynamo.config):
        try:
            config = module.get_config_copy()
        except Exception:  # noqa: BLE001 - a configuration that cannot be copied: its items' text
            config = {}
        parts[module.__name__] = repr(sorted((k, _stable(v)) for k, v in config.items()))
    return parts


def _stable(value: Any) -> str:
    """``repr(value)`` with the same text in every process: sets in order, no object addresses."""
    import re

    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_stable(k)}: {_stable(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable(v) for v in value) + "]"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def key(model: nn.Module, options: dict[str, Any]) -> str:
    """The hex digest naming ``model``'s entry under ``options`` (``compile``'s) in this process's state."""
    digest = hashlib.sha256()

    def add(label: str, value: Any) -> None:
        digest.update(label.encode() + b"\0" + str(value).encode() + b"\0")

    add("versions", [__version__, _package_hash(), torch.__version__, _version("transformers"), _version("triton")])
    add("options", sorted(options.items()))
    add("structure", repr(model))
    classes = sorted({type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__))
    for cls in classes:
        add("class", _source_of(cls))
    config = getattr(model, "config", None)
    if config is not None:
        add("config", config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config))
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        add("tensor", (name, tuple(tensor.shape), tensor.dtype, tensor.device.type, type(tensor).__qualname__))
    add("dispatch", _stable(_dispatch_parts()))
    add("batch invariant", _invariant(model))
    add("torch config", _config_parts())
    add("parallel plan", [getattr(model, a, None) for a in ("_tp_plan", "_pp_plan", "_ep_plan")] + [_world()])
    add("device", _stable(_device_parts(model)))
    return digest.hexdigest()


def _invariant(model: nn.Module) -> bool:
    """Whether the model is in batch-invariant mode (its compiled code then calls library ops)."""
    from ..ops import batch_invariant

    return batch_invariant.is_enabled(model)


def _world() -> Any:
    import torch.distributed as dist

    return (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else None


# --- the entries ---------------------------------------------------------------------------------


class CompileCache:
    """One key's entry in ``directory``: loaded once, at ``transfuse.compile``; saved after a warm-up
    and when the process exits, if the model compiled anything since.

    The artifacts are this model's own: each of its compiled calls runs with a fresh record of
    torch's cache artifacts (``recording``), which Inductor fills on a compile and on a hit of its
    local cache alike, so an entry holds every graph of the model, whichever process compiled it,
    and none of another model's."""

    def __init__(self, directory: str | os.PathLike, key_hex: str):
        self.directory = Path(directory)
        self.key = key_hex
        self.path = self.directory / f"{key_hex}.bin"
        self.loaded = False
        # Serialized artifacts with the (type, key) of each artifact in them: those loaded, and
        # those recorded in this process.
        self.loaded_chunks: list[tuple[bytes, frozenset]] = []
        self.recorded_chunks: list[tuple[bytes, frozenset]] = []
        self._unsaved = False
        # Dynamo's output of the model's calls, kept beside the artifacts (``precompiled.py``;
        # set by ``transfuse.compile`` where it is kept).
        self.precompiled_path = self.directory / f"{key_hex}.dynamo"
        self.precompiled: Any = None

    def load(self) -> bool:
        """Hand this key's artifacts to torch; False (a miss) where there is no whole entry."""
        counters = _counters()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            counters["miss"] += 1
            return False
        except OSError as exc:
            warnings.warn(f"transfuse.compile: the compile cache entry {self.path} cannot be read ({exc}); compiling anew")
            counters["miss"] += 1
            return False
        chunks = _unwrap(data)
        reason = "it is cut short or corrupt"
        if chunks is not None:
            try:
                infos = [torch.compiler.load_cache_artifacts(chunk) for chunk in chunks]
            except Exception as exc:  # noqa: BLE001 - torch's own errors for artifacts it cannot use
                infos, reason = [None], f"torch could not load it: {type(exc).__name__}"
            else:
                reason = "torch could not read its artifacts"
            if chunks and all(info is not None for info in infos):
                counters["hit"] += 1
                self.loaded = True
                self.loaded_chunks = [(chunk, _keys(info)) for chunk, info in zip(chunks, infos)]
                return True
        counters["corrupt"] += 1
        counters["miss"] += 1
        warnings.warn(f"transfuse.compile: ignored the compile cache entry {self.path} ({reason}); it is rebuilt")
        try:
            self.path.unlink()
        except OSError:
            pass
        return False

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the cache artifacts of what runs inside (one compiled call) as this entry's."""
        manager = _artifact_manager()
        if manager is None:
            yield
            return
        with manager.with_fresh_cache():
            yield
            if manager.need_serialize():
                result = torch.compiler.save_cache_artifacts()
                if result is not None:
                    keys = _keys(result[1])
                    self.recorded_chunks.append((result[0], keys))
                    known = frozenset().union(*(k for _, k in self.loaded_chunks + self.recorded_chunks[:-1]))
                    self._unsaved |= not keys <= known

    def save(self) -> bool:
        """Write this entry's artifacts, atomically, if artifacts it did not hold were recorded:
        those recorded in this process, and those loaded that they do not cover; and the model's
        kept compiled calls, if this process compiled any."""
        wrote = self.precompiled is not None and self.precompiled.save()
        if not self._unsaved:
            return wrote
        recorded = frozenset().union(*(k for _, k in self.recorded_chunks))
        chunks = [c for c, k in self.loaded_chunks if not k <= recorded] + [c for c, _ in self.recorded_chunks]
        write_atomically(self.path, _wrap(chunks))
        self._unsaved = False
        _counters()["saved"] += 1
        return True


def _keys(info: Any) -> frozenset:
    """The (type, key) of each artifact a ``CacheInfo`` lists."""
    artifacts = getattr(info, "artifacts", None) or {}
    return frozenset((kind, key) for kind, keys in artifacts.items() for key in keys)


def _artifact_manager() -> Any:
    """torch's record of cache artifacts, where it can be swapped for a fresh one (None otherwise:
    then nothing is recorded)."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        return None
    return CacheArtifactManager if hasattr(CacheArtifactManager, "with_fresh_cache") else None


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place: a reader, or
    another writer at once, sees one whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _wrap(chunks: list[bytes], magic: bytes = _MAGIC) -> bytes:
    """An entry: the magic line, then per chunk its length and checksum on a line, and its bytes."""
    parts = [magic]
    for chunk in chunks:
        parts += [f"{len(chunk)} {hashlib.sha256(chunk).hexdigest()}\n".encode(), chunk]
    return b"".join(parts)


def _unwrap(data: bytes, magic: bytes = _MAGIC) -> list[bytes] | None:
    """The chunks of a whole entry, None for one cut short or changed."""
    if not data.startswith(magic):
        return None
    chunks, at = [], len(magic)
    while at < len(data):
        end = data.find(b"\n", at)
        if end < 0:
            return None
        try:
            size, checksum = data[at:end].decode().split(" ")
            size = int(size)
        except ValueError:
            return None
        chunk = data[end + 1 : end + 1 + size]
        if len(chunk) != size or hashlib.sha256(chunk).hexdigest() != checksum:
            return None
        chunks.append(chunk)
        at = end + 1 + size
    return chunks


_OPEN: list[CompileCache] = []


def open_for(model: nn.Module, options: dict[str, Any], cache_dir: Any) -> CompileCache | None:
    """The cache entry for ``model`` (loaded into torch where it exists), None where turned off or
    where this torch has no portable artifacts."""
    if cache_dir is False or not supported():
        return None
    directory = default_dir() if cache_dir is None or cache_dir is True else Path(cache_dir).expanduser()
    entry = CompileCache(directory, key(model, options))
    entry.load()
    if not _OPEN:
        atexit.register(_save_all)
    _OPEN.append(entry)
    return entry


def _save_all() -> None:
    for entry in _OPEN:
        try:
            entry.save()
        except Exception as exc:  # noqa: BLE001 - at exit: a cache not written is a warning, not a failure
            warnings.warn(f"transfuse.compile: the compile cache entry {entry.path} was not written ({exc})")
