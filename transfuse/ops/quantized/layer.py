"""``QuantizedProjection``: a merged projection whose parts are quantized linear layers."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..hooks import global_hooks, hooked
from ..layers import MergedProjection
from ..low_rank import Adapter
from .base import Scheme, storage_bytes

__all__ = ["QuantizedProjection"]


class QuantizedProjection(MergedProjection):
    """Quantized linear layers of one input as one, through their scheme's own kernel.

    The merged quantized storage (the parts' data and scales concatenated along the output) is held
    here, outside the module's parameters and state dict; the parts stay the original modules under
    their names, their quantized tensors views of their rows of it. So ``state_dict`` and
    ``save_pretrained`` give the original checkpoint, and nothing is stored twice. Where a part's
    tensors were replaced since (a ``load_state_dict`` that assigns, ``model.to(...)``), the storage
    is merged again from the parts before the next call.

    Hooks and tools' wrappers are honoured as in ``MergedProjection``: a hooked part is called as a
    module; PEFT LoRA adapters on a part add to its columns of the scheme's output.
    """

    def __init__(
        self,
        scheme: Scheme,
        modules: Sequence[nn.Module],
        parts: tuple[str, ...],
        activation: str | None = None,
    ):
        nn.Module.__init__(self)
        first = modules[0]
        self.in_features = first.in_features
        self.split_sizes = tuple(int(m.out_features) for m in modules)
        self.out_features = sum(self.split_sizes)
        self.parts = tuple(parts)
        self.activation_name = activation
        self.__dict__["_activation_module"] = None
        self._owner = None
        self._part_modules = tuple(modules)
        self.shards = None
        self.scheme = scheme
        self.storage = scheme.describe(first)
        self.__dict__["kernel"] = None  # not a child: its tensors are the parts', saved under their names
        self._pointers: tuple = ()
        self._merge()

    @property
    def weight(self):
        return None

    @property
    def bias(self):
        return None

    def _merge(self) -> None:
        kernel = self.scheme.merge(self._part_modules)
        self.scheme.point_parts(kernel, self._part_modules, self.split_sizes)
        self.__dict__["kernel"] = kernel
        self._pointers = self._current()

    def _current(self) -> tuple:
        return tuple(t.data_ptr() for m in self._part_modules for t in self.scheme.tensors(m))

    def quantized_bytes(self) -> int:
        """Bytes of the quantized storage (data, scales, bias) of all parts."""
        return sum(storage_bytes(self.scheme.tensors(m)) for m in self._part_modules)

    def _slots(self) -> tuple[list[nn.Module], bool]:
        owner = self._owner() if self._owner is not None else None
        modules = owner._modules if owner is not None else {}
        watched = global_hooks()
        slots = []
        for name, part in zip(self.parts, self._part_modules):
            slot = modules.get(name)
            if slot is None:
                slot = part
            watched = watched or hooked(part) or (slot is not part and hooked(slot))
            slots.append(slot)
        return slots, watched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots, watched = self._slots()
        if watched:
            return self._call_parts(x, slots)
        if not torch.compiler.is_compiling() and self._current() != self._pointers:
            self._merge()
        out = self.scheme.forward(self.kernel, x)
        adapters = self._adapters(x, slots)
        return _add_adapters(out, x, adapters) if adapters else out

    def __getstate__(self):
        state = super().__getstate__()
        state["_pointers"] = ()  # a copy's tensors are new: merged again on its first call
        return state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, storage={self.storage}"


def _add_adapters(out: torch.Tensor, x: torch.Tensor, adapters: list[Adapter]) -> torch.Tensor:
    """Each adapter's output added to its part's columns, as PEFT's LoRA layers on quantized layers
    add it: ``lora_B(lora_A(x in the adapter's dtype)) * scaling``, cast to the output's dtype."""
    pieces, start = [], 0
    for adapter in sorted(adapters, key=lambda a: a.start):
        inputs = adapter.inputs if adapter.inputs is not None else x.to(adapter.a.dtype)
        delta = F.linear(F.linear(inputs, adapter.a), adapter.b, adapter.b_bias) * adapter.scale
        columns = out[..., adapter.start : adapter.start + adapter.size]
        pieces += [out[..., start : adapter.start], columns + delta.to(out.dtype)]
        start = adapter.start + adapter.size
    pieces.append(out[..., start:])
    return torch.cat(pieces, dim=-1)
