"""A model's state, captured before a rewrite runs the model's own Python, and put back after.

Probing, tracing and checking run module forwards; a forward may assign anything: a rotary cache
moved to the input's device (a meta tensor under tracing, a float64 one in a reference run), a
call counter, a global of its module, the random state. ``ModelState`` records, for every module of
the model, each entry of its ``__dict__`` by identity (the tables of parameters, buffers, children
and hooks with their contents), a copy of each tensor that is not a parameter (buffers and plain
tensor attributes, which a forward may write in place) and the version counter of each parameter;
the globals of the modules that define the model's classes; and the random state of torch (CPU and
any CUDA device in use) and of Python's ``random``.

``restore`` puts every entry back; with ``keep`` (a capture taken after the fusions were applied),
the entries the fusions themselves changed are left as they are. ``differences`` says, in words,
what is still not as captured: a rewrite that says the model is as it was checks it first.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ModelState"]

# A tensor larger than this is not copied: an in-place write to it is reported, not undone.
COPY_BYTES = 64 * 2**20
_CONTAINERS = (dict, list, set)


def _contents(value: Any) -> Any:
    """A shallow copy of a container's contents (compared and put back by identity)."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list):
        return list(value)
    return set(value)


def _same_contents(value: Any, saved: Any) -> bool:
    now = _contents(value)
    if isinstance(value, set):
        return {id(v) for v in now} == {id(v) for v in saved}
    return len(now) == len(saved) and all(
        (a[0] == b[0] and a[1] is b[1]) if isinstance(value, dict) else a is b for a, b in zip(now, saved)
    )


def _put_contents(value: Any, saved: Any) -> None:
    if isinstance(value, dict):
        value.clear()
        value.update(saved)
    elif isinstance(value, list):
        value[:] = saved
    else:
        value.clear()
        value.update(saved)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    if isinstance(value, (list, tuple, set)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


@dataclass
class _Tensor:
    tensor: torch.Tensor
    name: str
    version: int | None
    copy: torch.Tensor | None  # None for parameters, meta tensors and tensors over COPY_BYTES


def _copyable(t: torch.Tensor) -> bool:
    return not t.is_meta and type(t) is torch.Tensor and t.numel() * t.element_size() <= COPY_BYTES


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _defining_globals(model: nn.Module) -> dict[str, dict]:
    """The globals of every module that defines a class of the model (or a base of one), outside torch."""
    found: dict[str, dict] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            name = cls.__module__
            if name in found or name.startswith(("torch", "builtins")):
                continue
            namespace = getattr(sys.modules.get(name), "__dict__", None)
            if namespace is not None:
                found[name] = namespace
    return found


@dataclass
class ModelState:
    """Everything a forward may change, as it was when captured (see the module docstring)."""

    modules: list[tuple[str, nn.Module, dict[str, Any], dict[str, Any]]]  # (path, module, entries, contents)
    tensors: dict[int, _Tensor]
    namespaces: dict[str, tuple[dict, dict]] = field(default_factory=dict)  # module name -> (globals, copy)
    rng: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, model: nn.Module, copies: bool = True, also: ModelState | None = None) -> ModelState:
        """The state of ``model`` now; ``copies=False`` records identities only (no tensor copies);
        ``also``: an earlier capture whose modules are recorded too, in the model or not now (the
        linears a merge took out of it, say)."""
        modules, tensors = [], {}
        parameters = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
        found = list(model.named_modules(remove_duplicate=False))
        if also is not None:
            present = {id(m) for _, m in found}
            found += [(path, m) for path, m, _, _ in also.modules if id(m) not in present]
        for path, module in found:
            entries = dict(module.__dict__)
            contents = {k: _contents(v) for k, v in entries.items() if type(v) in _CONTAINERS or isinstance(v, dict)}
            modules.append((path, module, entries, contents))
            for key, value in entries.items():
                inner = [*value.values()] if key in ("_parameters", "_buffers") else _tensors_in(value)
                for t in inner:
                    if t is None or id(t) in tensors:
                        continue
                    name = f"{path}.{key}" if path else key
                    keep = copies and id(t) not in parameters and _copyable(t)
                    tensors[id(t)] = _Tensor(t, name, _version(t), t.detach().clone() if keep else None)
        namespaces = {name: (ns, dict(ns)) for name, ns in _defining_globals(model).items()}
        return cls(modules, tensors, namespaces, _rng_state())

    def restore(self, keep: ModelState | None = None) -> None:
        """Put back every entry; with ``keep``, leave the entries that differ between this capture and
        ``keep`` (what the fusions did) as they are now."""
        later = {id(m): (entries, contents) for _, m, entries, contents in keep.modules} if keep else {}
        for _, module, entries, contents in self.modules:
            changed = _changed_keys(entries, contents, *later[id(module)]) if id(module) in later else set()
            _restore_entries(module.__dict__, entries, contents, changed)
        kept_versions = {i: t.version for i, t in keep.tensors.items()} if keep else {}
        with torch.no_grad():
            for key, saved in self.tensors.items():
                if saved.copy is None or _version(saved.tensor) == saved.version:
                    continue
                if key in kept_versions and kept_versions[key] != saved.version:
                    continue  # written by a fusion
                _put_tensor(saved)
        for name, (namespace, saved) in self.namespaces.items():
            changed = set()
            if keep is not None and name in keep.namespaces:
                later_ns = keep.namespaces[name][1]
                changed = {k for k in set(saved) | set(later_ns) if saved.get(k, _MISSING) is not later_ns.get(k, _MISSING)}
            _restore_namespace(namespace, saved, changed)
        _set_rng_state(self.rng)

    def differences(self) -> list[str]:
        """What is not as captured, one phrase each (empty: the model is as it was)."""
        found = []
        for path, module, entries, contents in self.modules:
            where = path or type(module).__name__
            now = module.__dict__
            for key in set(entries) | set(now):
                if key not in now:
                    found.append(f"{where}.{key} is gone")
                elif key not in entries:
                    found.append(f"{where}.{key} was added")
                elif now[key] is not entries[key]:
                    found.append(f"{where}.{key} is another object")
                elif key in contents and not _same_contents(now[key], contents[key]):
                    found.append(f"{where}.{key} holds other entries")
        for saved in self.tensors.values():
            if _version(saved.tensor) != saved.version and not _equal_tensor(saved):
                found.append(f"{saved.name} was written in place")
        for name, (namespace, saved) in self.namespaces.items():
            for key in set(saved) | set(namespace):
                if saved.get(key, _MISSING) is not namespace.get(key, _MISSING):
                    found.append(f"the global {key} of {name} was rebound")
        return found


_MISSING = object()


def _changed_keys(entries: dict, contents: dict, later: dict, later_contents: dict) -> set[str]:
    changed = {k for k in set(entries) | set(later) if entries.get(k, _MISSING) is not later.get(k, _MISSING)}
    for key, saved in contents.items():
        if key in later_contents and not _same_contents_saved(saved, later_contents[key]):
            changed.add(key)
    return changed


def _same_contents_saved(a: Any, b: Any) -> bool:
    if isinstance(a, set):
        return {id(v) for v in a} == {id(v) for v in b}
    if len(a) != len(b):
        return False
    return all((x[0] == y[0] and x[1] is y[1]) if isinstance(x, tuple) else x is y for x, y in zip(a, b))


def _restore_entries(now: dict, entries: dict, contents: dict, changed: set[str]) -> None:
    for key in [k for k in now if k not in entries and k not in changed]:
        del now[key]
    for key, value in entries.items():
        if key in changed:
            continue
        now[key] = value
        if key in contents and not _same_contents(value, contents[key]):
            _put_contents(value, contents[key])


def _restore_namespace(namespace: dict, saved: dict, changed: set[str]) -> None:
    for key in [k for k in namespace if k not in saved and k not in changed]:
        del namespace[key]
    for key, value in saved.items():
        if key not in changed and namespace.get(key, _MISSING) is not value:
            namespace[key] = value


def _put_tensor(saved: _Tensor) -> None:
    t, copy = saved.tensor, saved.copy
    if t.shape == copy.shape and t.dtype == copy.dtype and t.device == copy.device:
        t.copy_(copy)
    else:
        t.set_(copy.clone())
    saved.version = _version(t)


def _equal_tensor(saved: _Tensor) -> bool:
    """A tensor written in place holds its captured value again (put back, or written with the same)."""
    copy = saved.copy
    t = saved.tensor
    if copy is None or t.is_meta:
        return False
    return t.shape == copy.shape and t.dtype == copy.dtype and bool(torch.equal(t.detach(), copy))
