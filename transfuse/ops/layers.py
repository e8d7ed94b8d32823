"""The fused layers that rewritten models call: ``nn.Module``s over dispatched ops.

Fusers build these from a model's own tensors (no copies, no re-initialisation) and
keep the original parameter names, so ``state_dict`` keys do not change. A plugin can
replace a layer class with ``register_layer``; fusers look classes up with ``layer``.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_globals

from .act_and_mul import CONSUMABLE
from .fused_add_rms_norm import fused_add_rms_norm
from .hooks import global_hooks, hooked, watched
from .low_rank import linear_with_adapters
from .moe_layer import MoE
from .rms_norm import RMSNormSpec, gated_rms_norm, input_gated_rms_norm, rms_norm
from .sharding import ColwiseShards, is_sharded

__all__ = [
    "Assumption",
    "GatedRMSNorm",
    "LinearPart",
    "MergedProjection",
    "MoE",
    "RMSNorm",
    "add_rms_norm",
    "check_assumptions",
    "layer",
    "register_layer",
]


class MergedProjection(nn.Module):
    """Several linear projections of one input as one: weights concatenated along the output.

    ``split_sizes`` are the output widths of the original projections, in order, so
    ``out.split(self.split_sizes, dim=-1)`` gives back their outputs. ``parts`` names them;
    ``activation`` is set when the parts are a GLU's gate and up halves.

    It computes ``F.linear`` like ``nn.Linear`` but is not one (nor named like one): tools that
    find linear layers by class (PEFT's ``all-linear``) find the original projections instead,
    which stay under their names as ``LinearPart`` views of this weight. When such a tool wraps a
    part (a LoRA adapter), ``part_hook`` is asked for the wrapper's adapters, which
    ``linear_with_adapters`` adds to that part's columns: the merged matmul runs once, adapters or not.

    A part (or the module in its place) with hooks, or hooks registered for every module, is called
    as a module, as the original forward called it, and the outputs are concatenated: its hooks run
    with its input and output, as often as in the original, and a hook that changes the output
    changes what follows. So is the activation module of a GLU (``activation`` is then that module,
    which ``act_and_mul`` calls on the gate).
    """

    __transfuse_layer__ = True
    # (wrapper, x, first column of its part) -> the wrapper's ``low_rank.Adapter``s (none when it adds
    # nothing). Set by an integration (``transfuse.integrations.peft``); None: a wrapped part is an error.
    part_hook = None

    def __init__(
        self,
        in_features: int,
        split_sizes: tuple[int, ...],
        bias: bool,
        parts: tuple[str, ...],
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.in_features = in_features
        self.split_sizes = tuple(int(s) for s in split_sizes)
        self.out_features = sum(self.split_sizes)
        self.parts = tuple(parts)
        self.activation_name = activation
        # The owner's child that applies the activation, if one does (not a child of this module).
        self.__dict__["_activation_module"] = None
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)) if bias else None
        self._owner = None  # the module holding the parts under their names (a weak reference)
        self._part_modules: tuple = ()
        # Set when the parts were column-parallel shards (tp_plan): split_sizes are then this rank's.
        self.shards: ColwiseShards | None = None

    def attach(
        self, owner: nn.Module, part_modules: tuple[nn.Module, ...], activation_module: str | None = None
    ) -> None:
        """Where the parts live (``owner.<part>``), the ``LinearPart`` each slot holds unwrapped, and
        the owner's child that applies a GLU's activation, if a module does."""
        self._owner = weakref.ref(owner)
        self._part_modules = tuple(part_modules)
        self.__dict__["_activation_module"] = owner._modules[activation_module] if activation_module else None

    @property
    def activation(self) -> str | nn.Module | None:
        """The GLU's activation as ``act_and_mul`` takes it: its name, or while the module that applies
        it in the original has hooks (its own or global ones), that module, called on the gate so that
        its hooks run. Read on every GLU call: the checks are written out."""
        module = self._activation_module
        if module is not None and (
            module._forward_hooks
            or module._forward_pre_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
            or module_globals._global_forward_hooks
            or module_globals._global_forward_pre_hooks
            or module_globals._global_backward_hooks
            or module_globals._global_backward_pre_hooks
        ):
            return module
        return self.activation_name

    def use_shards(self, shards: ColwiseShards) -> None:
        """From now on this rank's rows of each part (its weight and bias already replaced by the
        merged DTensors of those rows): the split sizes become the local ones, and the parts' views
        follow."""
        self.shards = shards
        self.split_sizes = shards.local_sizes()
        self.out_features = sum(self.split_sizes)
        for index, part in enumerate(self._part_modules):
            part.locate(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots, watched = self._slots()
        if watched:
            return self._call_parts(x, slots)
        adapters = self._adapters(x, slots)
        if self.shards is not None:
            if adapters:
                raise NotImplementedError(
                    "LoRA adapters on a tensor-parallel merged projection are not supported; rewrite the model "
                    "without the qkv and gate_up fusions to train adapters under tensor parallelism."
                )
            x = self.shards.input(x)
            return F.linear(x, self.weight.to_local(), self.bias.to_local() if self.bias is not None else None)
        out = linear_with_adapters(x, self.weight, self.bias, adapters)
        hooked = self._forward_hooks or module_globals._global_forward_hooks
        if self.activation_name is not None and not hooked and not torch.compiler.is_compiling():
            # Only the GLU reads a gate/up output (the fusion proved it): its backward may reuse it.
            # Compiled code runs the GLU's native definition, which never does. With adapters too:
            # their op keeps its input and the adapters' hidden values, never its output. (The
            # 3.6 GiB LoRA once seemed to cost with this was the benchmark's: the previous
            # variant's model, still alive.)
            setattr(out, CONSUMABLE, True)
        return out

    def _slots(self) -> tuple[list[nn.Module], bool]:
        """The module in each part's place (the part, or a tool's wrapper of it), with each part's
        replaced view data written back (``sync``); and whether calling one of them would run hooks.

        One pass with the checks written out: this runs on every call, in eager decoding too."""
        owner = self._owner() if self._owner is not None else None
        modules = owner._modules if owner is not None else {}
        watched = global_hooks()
        slots = []
        for name, part in zip(self.parts, self._part_modules):
            if part._views:
                part.sync()
            slot = modules.get(name)
            if slot is None:
                slot = part
            watched = watched or bool(
                part._forward_hooks or part._forward_pre_hooks or part._backward_hooks or part._backward_pre_hooks
            )
            watched = watched or (slot is not part and hooked(slot))
            slots.append(slot)
        return slots, watched

    def _call_parts(self, x: torch.Tensor, slots: list[nn.Module]) -> torch.Tensor:
        """Each part computed by calling the module in its place, as the original forward called it
        (its hooks run), the outputs concatenated as the merged matmul would give them."""
        if self.shards is not None:
            raise NotImplementedError(
                f"A hook on {', '.join(self.parts)} of a tensor-parallel merged projection would not run: it is "
                "computed as one sharded matmul. Remove the hook, or rewrite the model without the qkv and gate_up "
                "fusions to hook the projections under tensor parallelism."
            )
        return torch.cat([slot(x) for slot in slots], dim=-1)

    def _adapters(self, x: torch.Tensor, slots: list[nn.Module]) -> list:
        """The adapters of the parts that a tool wrapped (PEFT's LoRA), each on its part's columns."""
        adapters, start = [], 0
        for name, size, part, slot in zip(self.parts, self.split_sizes, self._part_modules, slots):
            if slot is not part:
                hook = type(self).part_hook
                found = hook(slot, x, start) if hook is not None else NotImplemented
                if found is NotImplemented:
                    raise TypeError(
                        f"{name} is now a {type(slot).__name__}, which wraps a projection that transfuse merged "
                        f"into {type(self).__name__}; only PEFT's LoRA adapters on merged projections are supported."
                    )
                adapters += found
            start += size
        return adapters

    def __getstate__(self):
        state = self.__dict__.copy()
        owner = state["_owner"]() if state["_owner"] is not None else None
        state["_owner"] = owner  # a strong reference while pickled or copied
        return state

    def __setstate__(self, state):
        owner = state["_owner"]
        state["_owner"] = weakref.ref(owner) if owner is not None else None
        self.__dict__.update(state)

    def extra_repr(self) -> str:
        merged = " + ".join(f"{name}:{size}" for name, size in zip(self.parts, self.split_sizes))
        act = f", activation={self.activation_name}" if self.activation_name else ""
        return f"in_features={self.in_features}, bias={self.bias is not None}, parts=[{merged}]{act}"


class LinearPart(nn.Linear):
    """One projection that a ``MergedProjection`` computes, kept under its original name: an
    ``nn.Linear`` whose weight and bias are views of its rows of the merged tensors (no copy, no
    parameter of its own, so nothing is trained or saved twice). The model's rewritten forward calls
    it only where it has hooks (``MergedProjection``); called, it computes what the original did.
    Tools find it by name and class (PEFT wraps it with an adapter, whose contribution the merged
    projection adds); an in-place change of its weight (a merged adapter) changes the merged weight.
    """

    __transfuse_layer__ = True

    def __init__(self, merged: MergedProjection, index: int):
        nn.Module.__init__(self)
        self.in_features = merged.in_features
        shards = merged.shards
        self.out_features = shards.full_sizes[index] if shards is not None else merged.split_sizes[index]
        object.__setattr__(self, "_merged", merged)  # not a child: the owner holds the merged module
        self.locate(index)

    def locate(self, index: int) -> None:
        """Take the rows of part ``index`` of the merged tensors as they are split now."""
        sizes = self._merged.split_sizes
        self._rows = (sum(sizes[:index]), sum(sizes[: index + 1]))
        self._views: dict = {}

    def _view(self, name: str):
        merged = getattr(self._merged, name)
        if merged is None:
            return None
        source = _local(merged)
        cached = self._views.get(name)
        # A view is current while the merged tensor keeps its storage (``model.half()`` and ``.to()``
        # give it new storage: the view is then made again from it).
        if cached is not None and cached[0] is merged and cached[1] == source.data_ptr():
            view, ptr = cached[2], cached[3]
            # A view made while gradients were off (an evaluation, a rewrite's check) has no path back
            # to the merged tensor: where a gradient is wanted now, it is made again.
            untracked = view.grad_fn is None and merged.requires_grad and torch.is_grad_enabled()
            if _local(view).data_ptr() != ptr:
                # Someone replaced the view's data (PEFT's safe merge assigns ``weight.data``): write it back.
                with torch.no_grad():
                    source[self._rows[0] : self._rows[1]].copy_(_local(view))
            elif not untracked:
                return view
        rows = source[self._rows[0] : self._rows[1]]
        view = self._part_of(rows)
        self._views[name] = (merged, source.data_ptr(), view, rows.data_ptr())
        return view

    def _part_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The part's tensor over ``rows``: under tensor parallelism, this rank's rows of the part as
        the DTensor shard of the full part."""
        shards = self._merged.shards
        return shards.sharded(rows, self.out_features) if shards is not None else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The original projection, computed from fresh slices of the merged tensors (the views that
        ``weight`` hands out are neither made nor compared here, so compiled code traces this)."""
        if not torch.compiler.is_compiling():
            self.sync()
        return F.linear(x, self._slice("weight"), self._slice("bias"))

    def _slice(self, name: str) -> torch.Tensor | None:
        merged = getattr(self._merged, name)
        return None if merged is None else self._part_of(_local(merged)[self._rows[0] : self._rows[1]])

    def sync(self) -> None:
        """Write back into the merged tensors a view whose data was replaced since it was handed out
        (a no-op unless someone asked for the part's weight)."""
        for name, (merged, _, view, ptr) in list(self._views.items()):
            if _local(view).data_ptr() != ptr:
                self._view(name)

    @property
    def weight(self):
        return self._view("weight")

    @property
    def bias(self):
        return self._view("bias")

    def __setattr__(self, name, value):
        if name in ("weight", "bias"):
            raise AttributeError(
                f"LinearPart.{name} is a view of the merged projection's rows; change the merged module's "
                f"{name} instead (or rewrite the model without merging)."
            )
        super().__setattr__(name, value)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_views"] = {}
        return state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_sharded(tensor) else tensor


class Assumption(NamedTuple):
    """An attribute the replaced module's code branched on, with the value it had then: with
    ``tensor``, any tensor (a parameter or buffer, not None); else ``value``, of the same type."""

    name: str
    value: bool | int | float | str | None = None
    tensor: bool = False

    def holds(self, now) -> bool:
        if self.tensor:
            return isinstance(now, torch.Tensor)
        return type(now) is type(self.value) and now == self.value

    def describe(self) -> str:
        return f"{self.name} a tensor" if self.tensor else f"{self.name} = {self.value!r}"


_MISSING = object()


def check_assumptions(module: nn.Module, assumes) -> None:
    """Raise if an attribute of ``module`` no longer has the value its fused code was made for (the
    original code takes another path for the new value). ``assumes``: ``Assumption``s or their tuples."""
    for assumption in assumes:
        assumption = Assumption(*assumption)
        now = getattr(module, assumption.name, _MISSING)
        if not assumption.holds(now):
            shown = "missing" if now is _MISSING else f"{type(now).__name__}" if assumption.tensor else repr(now)
            raise ValueError(
                f"This fused {type(module).__name__} was made for {assumption.describe()}, and it is now {shown}: "
                "the original code takes another path for that value. Rewrite the model again (or emit it "
                "again) after changing it."
            )


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with the rounding of ``spec``; the weight is optional.

    ``assumes``: attributes the original module's code branched on (``with_scale``, ``weight`` being
    a tensor); the layer holds them with their values and raises if one changes (``check_assumptions``).
    ``eps_name``: the original module's name for the epsilon (``variance_epsilon``): the layer answers
    to it too, and setting either name sets both (code outside the module reads it: Mamba-2's CUDA
    path hands ``self.norm.variance_epsilon`` to its own kernel)."""

    __transfuse_layer__ = True

    def __init__(
        self,
        weight: nn.Parameter | None,
        eps: float,
        spec: RMSNormSpec = RMSNormSpec(),
        weight_name: str = "weight",
        assumes: tuple[Assumption, ...] = (),
        eps_name: str = "eps",
    ):
        super().__init__()
        self.eps_name = eps_name
        self.eps = float(eps)
        self.spec = spec
        self.weight_name = weight_name
        self.register_parameter(weight_name, weight)
        self.assumes = tuple(Assumption(*a) for a in assumes)
        for assumption in self.assumes:
            if assumption.name == weight_name:
                continue  # the layer's own weight (a tensor or None)
            if assumption.tensor or hasattr(self, assumption.name):
                raise ValueError(f"RMSNorm cannot hold the assumed attribute {assumption.describe()}: it is its own.")
            setattr(self, assumption.name, assumption.value)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        alias = self.__dict__.get("eps_name", "eps")
        if alias != "eps" and name in ("eps", alias):
            self.__dict__[alias if name == "eps" else "eps"] = value  # the epsilon under both names

    def run_original_unless_none(self, globals_none: tuple[tuple[object, str], ...], original: nn.Module) -> None:
        """The original module's code branched on these globals being None, each given as ``(a function
        of the module that holds it, its name)``: while one is not None, ``original`` runs instead
        (held as a plain attribute: no state-dict keys)."""
        self.globals_none = tuple(globals_none)
        self.__dict__["_original"] = (original,)

    def _globals_hold(self) -> bool:
        return all(reader.__globals__.get(name) is None for reader, name in self.__dict__.get("globals_none", ()))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.assumes:
            check_assumptions(self, self.assumes)
        if "_original" in self.__dict__ and not self._globals_hold():
            return self.__dict__["_original"][0](hidden_states)
        return rms_norm(hidden_states, getattr(self, self.weight_name), self.eps, self.spec)

    def extra_repr(self) -> str:
        weight = getattr(self, self.weight_name)
        shape = tuple(weight.shape) if weight is not None else None
        assumed = "".join(f", {a.describe()}" for a in self.assumes)
        return f"{shape}, eps={self.eps}, {self.spec.describe()}{assumed}"


def add_rms_norm(norm: nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(a + b), a + b)``: a decoder layer's ``h = a + b; r = h; h = norm(h)``, which the
    add_rms_norm fusion puts this call in place of.

    One ``fused_add_rms_norm`` where that is exactly what those statements compute: ``norm`` is a
    plain ``RMSNorm`` layer, or a class of an emitted modeling file whose forward is that op (it
    says so with ``_transfuse_rms_norm``: its weight's and epsilon's names and its rounding); it
    has no hooks to run (forward, forward-pre or backward; its own or global ones) and no forward
    of its own set on the instance (accelerate's offloading hooks replace it); and ``a`` and ``b``
    are plain tensors of one shape and dtype (the sum is then taken in that dtype either way, and
    ``a + b`` equals ``b + a``). Otherwise the statements as written: the sum, then the norm's call."""
    if (
        "forward" not in norm.__dict__
        and type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.dtype == b.dtype
        and a.shape == b.shape
        and not watched(norm)
    ):
        if type(norm) is RMSNorm and norm._globals_hold():
            if norm.assumes:
                check_assumptions(norm, norm.assumes)
            return fused_add_rms_norm(b, a, getattr(norm, norm.weight_name), norm.eps, norm.spec)
        described = type(norm).__dict__.get("_transfuse_rms_norm")
        if described is not None:
            weight, eps, spec = described
            return fused_add_rms_norm(b, a, getattr(norm, weight) if weight is not None else None, getattr(norm, eps), spec)
    total = a + b
    return norm(total), total


class GatedRMSNorm(RMSNorm):
    """An RMSNorm with a gate: ``(rms_norm(x) * act(gate in float32)).to(x.dtype)`` (an output gate),
    or with ``gate_first``, ``rms_norm(x in float32 * act(gate in float32))`` normalised in groups of
    ``group_size`` features (None: whole rows). ``optional_gate``: called without a gate, the gate-first
    norm computes the norm of ``x`` alone (the original's path for ``gate=None``); otherwise a gate is
    required."""

    def __init__(
        self,
        weight: nn.Parameter | None,
        eps: float,
        spec: RMSNormSpec = RMSNormSpec(),
        weight_name: str = "weight",
        activation: str = "silu",
        assumes: tuple[Assumption, ...] = (),
        gate_first: bool = False,
        group_size: int | None = None,
        optional_gate: bool = False,
        eps_name: str = "eps",
    ):
        super().__init__(weight, eps, spec, weight_name, assumes, eps_name)
        self.activation = activation
        self.gate_first = gate_first
        self.group_size = group_size
        self.optional_gate = optional_gate

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if self.assumes:
            check_assumptions(self, self.assumes)
        weight = getattr(self, self.weight_name)
        if gate is None and not self.optional_gate:
            raise TypeError(f"This fused {type(self).__name__} needs its gate: the original norm was traced with one.")
        if self.gate_first:
            return input_gated_rms_norm(
                hidden_states, gate, weight, self.eps, self.spec, self.activation, self.group_size
            )
        return gated_rms_norm(hidden_states, gate, weight, self.eps, self.spec, self.activation)

    def extra_repr(self) -> str:
        where = "before the norm" if self.gate_first else "after the norm"
        groups = f", groups of {self.group_size}" if self.group_size is not None else ""
        return f"{super().extra_repr()}, gate: {self.activation} {where}{groups}"


_LAYERS: dict[str, type[nn.Module]] = {
    "RMSNorm": RMSNorm,
    "GatedRMSNorm": GatedRMSNorm,
    "MergedProjection": MergedProjection,
    "MoE": MoE,
}


def register_layer(name: str, cls: type[nn.Module]) -> None:
    """Replace the layer class fusers build under ``name`` (for out-of-tree platforms)."""
    if name not in _LAYERS:
        raise KeyError(f"No layer named {name!r}; the layers are: {', '.join(sorted(_LAYERS))}.")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"A replacement for layer {name!r} must be an nn.Module subclass, not {cls!r}.")
    _LAYERS[name] = cls


def layer(name: str) -> type[nn.Module]:
    """The class fusers instantiate for ``name`` (a plugin's replacement, if registered)."""
    from .dispatch import _load_plugins

    _load_plugins()
    return _LAYERS[name]
