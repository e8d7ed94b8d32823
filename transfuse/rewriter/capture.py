"""One short forward pass of the whole model, recording what each module was called with.

Tracing one class needs a real call of it: the shapes and dtypes of its inputs, and the
outputs of its children where those cannot be computed on meta tensors. The probe
forward records, for every module, its first call (as meta tensors: nothing real is
kept) and, for modules asked for by name, the real inputs and outputs (for verification).

A model whose parameters are on the meta device has no data; its probe runs on meta
tensors, and data-dependent reads (``.item()``, ``nonzero``) answer with fixed defaults.
Those runs only give shapes, which is all tracing needs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .tracer import is_kv_cache

__all__ = ["Call", "Probe", "ProbeUnavailable", "class_key", "eval_mode", "is_meta_model", "make_probe", "record_calls"]

_aten = torch.ops.aten


@dataclass
class Call:
    """One recorded module call: positional and keyword arguments and the output."""

    args: tuple
    kwargs: dict
    output: Any = None

    def fresh(self) -> tuple[tuple, dict]:
        """The arguments, copied for one more call: a module may write its inputs in place, and a
        cache it is handed grows with every call (the recorded one holds the state before it)."""
        return _snapshot(self.args), _snapshot(self.kwargs)


@dataclass
class Probe:
    """The input of the probe forward and what it gave."""

    args: tuple
    kwargs: dict
    output: Any = None
    error: str | None = None
    calls: dict[str, Call] = field(default_factory=dict)  # module path -> first call, as meta tensors
    real_calls: dict[str, Call] = field(default_factory=dict)  # module path -> first call, real tensors
    classes: dict[str, tuple] = field(default_factory=dict)  # module path (of ``calls``) -> its ``class_key``

    def call_of_class(self, key: tuple) -> tuple[str, Call] | None:
        """The first recorded call that returned of a module whose ``class_key`` is ``key``, with its path."""
        for path, call in self.calls.items():
            if call.output is not None and self.classes.get(path) == key:
                return path, call
        return None


def class_key(module: nn.Module) -> tuple:
    """A module's class and its children's names and classes: what its traced graph depends on
    besides the instance's attributes (a decoder layer with a dense MLP and one with a mixture of
    experts have different keys)."""
    return (type(module), tuple((name, type(child)) for name, child in module.named_children()))


def is_meta_model(model: nn.Module) -> bool:
    """All of the model's parameters are on the meta device: it has shapes but no data."""
    params = list(model.parameters())
    return bool(params) and all(p.is_meta for p in params)


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's token embeddings: ``get_input_embeddings()`` where it is implemented (remote code
    may not), else the first ``nn.Embedding`` it holds."""
    getter = getattr(model, "get_input_embeddings", None)
    if getter is not None:
        try:
            found = getter()
        except (NotImplementedError, AttributeError):
            found = None
        if found is not None:
            return found
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _vocabulary(model: nn.Module) -> int | None:
    """How many token ids the model takes: its config's vocabulary (a composite model's text
    config's), else its token embeddings' size."""
    config = getattr(model, "config", None)
    for candidate in (config, getattr(config, "text_config", None)):
        vocab = getattr(candidate, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        vocab = getattr(get_text_config(), "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    embeddings = _input_embeddings(model)
    vocab = getattr(embeddings, "num_embeddings", None)
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def _model_device(model: nn.Module) -> torch.device:
    embeddings = _input_embeddings(model)
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class ProbeUnavailable(Exception):
    """No probe input can be made for the model; the message says why and what to pass instead."""


def make_probe(model: nn.Module, example_inputs: Any = None, seq_len: int = 32, seed: int = 0) -> Probe:
    """The probe input: the caller's example, or random token ids for a model with a vocabulary."""
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            if not all(isinstance(k, str) for k in example_inputs):
                raise TypeError("example_inputs as a dict must map the forward's parameter names to values.")
            return Probe(args=(), kwargs=dict(example_inputs))
        if isinstance(example_inputs, torch.Tensor):
            return Probe(args=(example_inputs,), kwargs={})
        if isinstance(example_inputs, (tuple, list)):
            return Probe(args=tuple(example_inputs), kwargs={})
        raise TypeError(
            f"example_inputs must be a tensor, a tuple of positional arguments or a dict of keyword arguments "
            f"of {type(model).__name__}.forward, not {type(example_inputs).__name__}."
        )
    vocab = _vocabulary(model)
    if vocab is None:
        raise ProbeUnavailable(
            f"{type(model).__name__} has no vocabulary (config.vocab_size, a text config's, or token embeddings), "
            "so transfuse cannot make a probe input for it; pass example_inputs=(tensor, ...) or "
            "example_inputs={'name': tensor} to rewrite()"
        )
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (1, seq_len), generator=generator).to(_model_device(model))
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    parameters = inspect.signature(model.forward).parameters
    if "use_cache" in parameters:
        kwargs["use_cache"] = False
    if "labels" in parameters:
        kwargs["labels"] = input_ids  # the loss's path is traced too, and checked where a fusion changes it
    return Probe(args=(), kwargs=kwargs)


class _MetaDefaults(TorchDispatchMode):
    """On meta tensors, data-dependent reads give fixed defaults instead of raising."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.is_meta:
            if func is _aten._local_scalar_dense.default:
                return False if first.dtype == torch.bool else (0.0 if first.dtype.is_floating_point else 0)
            if func is _aten.nonzero.default:
                return torch.empty((0, first.dim()), dtype=torch.long, device="meta")
        return func(*args, **kwargs)


def _as_meta(obj: Any) -> Any:
    return tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, obj)


def _snapshot(obj: Any) -> Any:
    """Tensors detached and cloned, caches deep-copied: a record that later calls cannot change."""

    def copy_leaf(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if is_kv_cache(x):
            return copy.deepcopy(x)
        return x

    return tree_map(copy_leaf, obj)



@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Probe in eval mode (dropout off), then restore each module's own training flag."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def record_calls(model: nn.Module, probe: Probe, real_paths: set[str] = frozenset()) -> Probe:
    """Run ``model`` on the probe, recording each module's first call; returns the probe."""
    handles = []

    def hooks_for(path: str):
        def pre(module, args, kwargs):
            if path not in probe.calls:
                probe.calls[path] = Call(_as_meta(args), _as_meta(kwargs))
                probe.classes[path] = class_key(module)
            if path in real_paths and path not in probe.real_calls:
                probe.real_calls[path] = Call(_snapshot(args), _snapshot(kwargs))

        def post(module, args, kwargs, output):
            call = probe.calls.get(path)
            if call is not None and call.output is None:
                call.output = _as_meta(output)
            real = probe.real_calls.get(path)
            if real is not None and real.output is None:
                real.output = _snapshot(output)

        return pre, post

    for path, module in model.named_modules():
        pre, post = hooks_for(path)
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    meta = is_meta_model(model)
    try:
        with torch.no_grad(), eval_mode(model), (_MetaDefaults() if meta else contextlib.nullcontext()):
            probe.output = model(*probe.args, **probe.kwargs)
    except Exception as exc:  # keep what was recorded before the failure
        probe.error = f"{type(exc).__name__}: {exc}"
    finally:
        for handle in handles:
            handle.remove()
    return probe
