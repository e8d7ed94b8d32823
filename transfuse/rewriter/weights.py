"""Merged projections that keep their original ``state_dict`` keys.

``merge_linears(parent, "qkv_proj", ["q_proj", "k_proj", "v_proj"])`` adds one
``MergedProjection`` child whose weight (and bias) is the concatenation of the parent's linear
children along the output dimension, and leaves in their places ``LinearPart`` views of its rows
(the originals' tensors are freed): the names still resolve, for tools that find modules by name
(PEFT's ``target_modules``), without a second copy or a second parameter. The layout change
lives at the load/save boundary, never in ``forward``:

* ``parent.state_dict()`` shows the originals' keys and shapes, as slices of the merged
  tensors (no copies) that each have a storage of their own, so ``save_pretrained`` writes files
  stock transformers loads and tie detection (which groups tensors by storage) finds no tie the
  original model did not have;
* ``parent.load_state_dict`` of a state dict with the original keys concatenates them
  into the merged parameters.

``unmerge_linears`` undoes a merge with the merged tensors' rows (each over a storage of its
own, the same memory), so neither direction keeps a second copy of the weights.

Quantized parts (a scheme ``transfuse.ops.quantized`` has an adapter for) merge into a
``QuantizedProjection`` that holds their quantized storage concatenated and runs the scheme's kernel;
the parts stay the original modules, their quantized tensors views of that storage, so their
``state_dict`` is the original's without any hook.

Under tensor parallelism (``tp_plan``), column-parallel parts (DTensors ``Shard(0)``) merge
from this rank's shards (``transfuse.ops.sharding``): the parts, their state-dict entries and
their checkpoints stay DTensors of the full originals, which transformers gathers when it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..ops import LinearPart, identify_activation, layer
from ..ops.hooks import share_hooks
from ..ops.quantized import QuantizedProjection, SchemeError, scheme_of
from ..ops.sharding import ColwiseShards, colwise_shards, is_sharded

__all__ = [
    "ActivationError",
    "Merge",
    "MergeError",
    "merge_declared",
    "merge_linears",
    "merges_of",
    "shard_merge",
    "unmerge_linears",
]

_MERGES = "_transfuse_merges"
_TENSORS = ("weight", "bias")


class MergeError(ValueError):
    """The linears cannot be merged (different inputs, dtypes, devices, or bias presence)."""


class ActivationError(MergeError):
    """A GLU's activation module is not exactly one of the fused activations."""


@dataclass
class _Merge:
    parts: tuple[str, ...]
    sizes: tuple[int, ...]
    originals: tuple[nn.Linear, ...]  # the original modules, emptied of their tensors
    # Each original's own Parameter objects, holding no memory while merged: an unmerge gives them
    # back their pieces, so the model holds the very objects it held before (an optimiser's, a
    # caller's references stay valid). Empty where a tensor subclass cannot be emptied.
    parameters: tuple[dict[str, nn.Parameter], ...] = ()


def merges_of(parent: nn.Module) -> dict[str, _Merge]:
    """The merges made on ``parent``: merged child name → parts."""
    return parent.__dict__.get(_MERGES, {})


def _check_mergeable(parent: nn.Module, into: str, parts: Sequence[str]) -> tuple[list[nn.Linear], ColwiseShards | None]:
    if len(parts) < 2:
        raise MergeError(f"Merging needs at least two linears, got {list(parts)}.")
    if hasattr(parent, into):
        raise MergeError(f"{type(parent).__name__} already has an attribute {into!r}.")
    children = [parent._modules.get(name) for name in parts]
    scheme = scheme_of(children[0]) if isinstance(children[0], nn.Module) else None
    if scheme is not None:
        return _check_quantized(scheme, parts, children), None
    linears = []
    for name in parts:
        child = parent._modules.get(name)
        if isinstance(child, nn.Module) and scheme_of(child) is not None:
            raise MergeError(f"{name!r} is {scheme_of(child).describe(child)}, {parts[0]!r} is not quantized.")
        if not isinstance(child, nn.Linear) or type(child).forward is not nn.Linear.forward:
            raise MergeError(f"{name!r} is a {type(child).__name__}, not an nn.Linear with Linear's own forward.")
        if type(child.weight) is not nn.Parameter and not is_sharded(child.weight):
            raise MergeError(f"{name}.weight is a {type(child.weight).__name__}, not a plain Parameter.")
        linears.append(child)
    try:
        shards = colwise_shards(parts, linears)
    except ValueError as exc:
        raise MergeError(str(exc)) from None
    first = linears[0].weight
    for name, lin in zip(parts, linears):
        if lin.in_features != linears[0].in_features:
            raise MergeError(f"{name} reads {lin.in_features} features, {parts[0]} reads {linears[0].in_features}.")
        if lin.weight.dtype != first.dtype or lin.weight.device != first.device:
            raise MergeError(
                f"{name}.weight is {lin.weight.dtype} on {lin.weight.device}, "
                f"{parts[0]}.weight is {first.dtype} on {first.device}."
            )
        if (lin.bias is None) != (linears[0].bias is None):
            raise MergeError(f"{name} and {parts[0]} differ in having a bias.")
        if lin.bias is not None and lin.bias.dtype != first.dtype:
            raise MergeError(f"{name}.bias is {lin.bias.dtype}, its weight is {first.dtype}.")
    return linears, shards


def _check_quantized(scheme, parts: Sequence[str], children: list) -> list[nn.Module]:
    for name, child in zip(parts, children):
        if not isinstance(child, nn.Module) or scheme_of(child) is not scheme:
            what = scheme_of(child).describe(child) if isinstance(child, nn.Module) and scheme_of(child) else type(child).__name__
            raise MergeError(f"{name!r} is {what}, {parts[0]!r} is {scheme.describe(children[0])}.")
        if child.in_features != children[0].in_features:
            raise MergeError(f"{name} reads {child.in_features} features, {parts[0]} reads {children[0].in_features}.")
        if (child.bias is None) != (children[0].bias is None):
            raise MergeError(f"{name} and {parts[0]} differ in having a bias.")
    try:
        scheme.check(parts, children)
    except SchemeError as exc:
        raise MergeError(f"{scheme.name}: {exc}") from None
    return children


def merge_linears(
    parent: nn.Module,
    into: str,
    parts: Sequence[str],
    *,
    activation: str | None = None,
    activation_module: str | None = None,
) -> nn.Module:
    """Replace ``parent``'s linear children ``parts`` by one merged linear named ``into``; a GLU's
    ``activation`` is applied by ``parent.<activation_module>`` where a module applies it.

    The ``LinearPart`` in each part's place runs the hooks the original had (``share_hooks``), so a
    hook registered before the merge runs as one registered after it (``MergedProjection`` calls a
    hooked part as a module). Tensor-parallel parts keep theirs on the originals: the merged sharded
    matmul stands for the originals' own transforms."""
    linears, shards = _check_mergeable(parent, into, parts)
    scheme = scheme_of(linears[0])
    if scheme is not None:
        return _merge_quantized(parent, into, parts, scheme, linears, activation, activation_module)
    first = linears[0]
    with torch.device("meta"):
        merged = layer("MergedProjection")(
            first.in_features,
            shards.local_sizes() if shards is not None else tuple(lin.out_features for lin in linears),
            bias=first.bias is not None,
            parts=tuple(parts),
            activation=activation,
            dtype=first.weight.dtype,
        )
    merged.shards = shards
    with torch.no_grad():
        for tensor in _TENSORS:
            pieces = [getattr(lin, tensor) for lin in linears]
            if pieces[0] is not None:
                if shards is not None:  # this rank's shards of the parts, concatenated
                    data = shards.merged(torch.cat([p.detach().to_local() for p in pieces]))
                else:
                    data = torch.cat([p.detach() for p in pieces])
                setattr(merged, tensor, nn.Parameter(data, requires_grad=pieces[0].requires_grad))
    views = tuple(LinearPart(merged, i) for i in range(len(parts)))
    kept = tuple(_emptied(lin) for lin in linears)
    for name, lin, view in zip(parts, linears, views):
        if shards is None:
            share_hooks(lin, view)
        setattr(parent, name, view)
        for tensor in _TENSORS:
            if getattr(lin, tensor) is not None:
                setattr(lin, tensor, None)  # the merged module holds the only copy
    setattr(parent, into, merged)
    merged.attach(parent, views, activation_module)
    parent.__dict__.setdefault(_MERGES, {})[into] = _Merge(tuple(parts), merged.split_sizes, tuple(linears), kept)
    _ensure_hooks(parent)
    return merged


def _emptied(lin: nn.Module) -> dict[str, nn.Parameter]:
    """``lin``'s plain Parameters, their memory given up (the merged copy is the only one); a tensor
    subclass (a quantized or sharded weight) is left as it is and not kept."""
    kept = {}
    for tensor in _TENSORS:
        p = lin._parameters.get(tensor)
        if isinstance(p, nn.Parameter) and type(p.data) is torch.Tensor:
            p.data = p.data.new_empty(0)
            kept[tensor] = p
    return kept


def _merge_quantized(parent, into, parts, scheme, modules, activation, activation_module) -> nn.Module:
    """The parts stay in place (their hooks are theirs); their tensors become views of the merged storage."""
    merged = QuantizedProjection(scheme, modules, tuple(parts), activation=activation)
    setattr(parent, into, merged)
    merged.attach(parent, tuple(modules), activation_module)
    parent.__dict__.setdefault(_MERGES, {})[into] = _Merge(tuple(parts), merged.split_sizes, tuple(modules))
    return merged


def unmerge_linears(parent: nn.Module, into: str) -> None:
    """Put back the original linears of a merge, over the merged tensors' memory (no copies)."""
    record = merges_of(parent).pop(into)
    merged = parent._modules[into]
    if isinstance(merged, QuantizedProjection):  # the parts never left; their views keep the memory
        delattr(parent, into)
        if not merges_of(parent):
            _remove_hooks(parent)
            del parent.__dict__[_MERGES]
        return
    for tensor in _TENSORS:
        joined = getattr(merged, tensor)
        if joined is None:
            continue
        pieces = _pieces(merged, joined.detach(), record.sizes, alone=True)
        for i, (lin, piece) in enumerate(zip(record.originals, pieces)):
            original = record.parameters[i].get(tensor) if record.parameters else None
            if original is None:
                setattr(lin, tensor, nn.Parameter(piece, requires_grad=joined.requires_grad))
                continue
            original.data = piece
            original.requires_grad_(joined.requires_grad)
            setattr(lin, tensor, original)
    delattr(parent, into)
    for name, lin in zip(record.parts, record.originals):
        setattr(parent, name, lin)
    if not merges_of(parent):
        _remove_hooks(parent)
        del parent.__dict__[_MERGES]


def shard_merge(parent: nn.Module, into: str, mesh) -> ColwiseShards:
    """Shard a merge that every rank holds whole over the one-dimensional ``mesh``, column-parallel and
    part by part: this rank keeps its ``Shard(0)`` rows of each part (for GQA, its q heads and its k/v
    heads), concatenated in the parts' order, which is exactly the local tensor a merge of the parts'
    column-parallel shards makes. A merge already made of shards is left as it is."""
    record = merges_of(parent)[into]
    merged = parent._modules[into]
    if merged.shards is not None:
        return merged.shards
    if mesh.ndim != 1:
        raise MergeError(f"{into} is sharded over one mesh dimension; this mesh has {mesh.ndim}.")
    for part, size in zip(record.parts, record.sizes):
        if size % mesh.size():
            raise MergeError(
                f"{part} has {size} output features, not a multiple of the {mesh.size()} ranks: its shards are uneven."
            )
    shards = ColwiseShards(mesh, record.sizes)
    with torch.no_grad():
        for tensor in _TENSORS:
            joined = getattr(merged, tensor)
            if joined is not None:
                local = torch.cat([shards.local(piece) for piece in joined.detach().split(record.sizes, dim=0)])
                setattr(merged, tensor, nn.Parameter(shards.merged(local), requires_grad=joined.requires_grad))
    merged.use_shards(shards)
    record.sizes = merged.split_sizes
    return shards


# The hooks are found by identity in the module's own hook tables, not through handles: a copied or
# unpickled module carries the hooks but not handles to its own tables.
def _ours(hook) -> bool:
    return getattr(hook, "hook", hook) in (_split_on_save, _merge_on_load)


def _ensure_hooks(parent: nn.Module) -> None:
    if not any(_ours(h) for h in parent._state_dict_hooks.values()):
        parent.register_state_dict_post_hook(_split_on_save)
    if not any(_ours(h) for h in parent._load_state_dict_pre_hooks.values()):
        parent.register_load_state_dict_pre_hook(_merge_on_load)


def _remove_hooks(parent: nn.Module) -> None:
    for table in (parent._state_dict_hooks, parent._load_state_dict_pre_hooks):
        for key in [k for k, h in table.items() if _ours(h)]:
            del table[key]


def _pieces(merged: nn.Module, joined: torch.Tensor, sizes: tuple[int, ...], alone: bool) -> list[torch.Tensor]:
    """The parts' tensors of a merged tensor: its rows, or under tensor parallelism the DTensor shards
    of the full parts whose local tensors are this rank's rows. With ``alone``, each over a storage
    of its own (``_alone``); else views, which carry autograd back to the merged tensor."""
    shards = merged.shards
    own = _alone if alone else (lambda piece: piece)
    if shards is None:
        return [own(piece) for piece in joined.split(sizes, dim=0)]
    local = joined.to_local().split(sizes, dim=0)
    return [shards.sharded(own(piece), full) for piece, full in zip(local, shards.full_sizes)]


def _alone(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (contiguous rows of a merged tensor) over the same memory but a storage object of
    its own, which starts and ends where the piece does and keeps the merged storage alive.

    Tie detection groups tensors by storage (transformers' ``id_tensor_storage`` in its tests and in
    ``save_pretrained``, safetensors' shared-tensor check): views of one merged tensor would be
    reported as tied weights, which the parts of a merge are not. No copy is made, so writes through
    the piece still reach the merged tensor. Meta tensors have no memory to share and stay views."""
    if piece.device.type == "meta" or not piece.is_contiguous():
        return piece
    start = piece.storage_offset() * piece.element_size()
    storage = piece.untyped_storage()[start : start + piece.nbytes]
    return piece.new_empty(0).set_(storage, 0, piece.shape, piece.stride())


def _split_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for into, record in merges_of(module).items():
        for tensor in _TENSORS:
            key = f"{prefix}{into}.{tensor}"
            if key in state_dict:
                joined = state_dict.pop(key)
                # ``state_dict(keep_vars=True)`` hands out the parameter: its parts then stay views of it,
                # with gradients; a detached state dict's parts have storages of their own.
                alone = type(joined) is not nn.Parameter and not joined.requires_grad
                pieces = _pieces(module._modules[into], joined, record.sizes, alone)
                for part, piece in zip(record.parts, pieces):
                    state_dict[f"{prefix}{part}.{tensor}"] = piece


def _merge_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for into, record in merges_of(module).items():
        for tensor in _TENSORS:
            keys = [f"{prefix}{part}.{tensor}" for part in record.parts]
            # All parts or none: a partial set is left as is, so loading reports the
            # merged key as missing and the parts as unexpected.
            if all(k in state_dict for k in keys):
                shards = module._modules[into].shards
                if shards is None:
                    state_dict[f"{prefix}{into}.{tensor}"] = torch.cat([state_dict.pop(k) for k in keys])
                else:  # full or sharded parts: this rank's rows of each, as the merged DTensor
                    local = torch.cat([shards.local(state_dict.pop(k)) for k in keys])
                    state_dict[f"{prefix}{into}.{tensor}"] = shards.merged(local)


@dataclass(frozen=True)
class Merge:
    """A merge to make on every instance of a class: ``parts`` into ``into``.

    For a GLU's gate and up projections, the activation is either named (``activation``,
    from the source) or read off a child module (``activation_module``) per instance.
    Fusers apply it at run time; emitted modeling files declare it in ``_transfuse_merges``
    and ``merge_declared`` applies it after loading, so both build the same modules.
    """

    into: str
    parts: tuple[str, ...]
    activation: str | None = None
    activation_module: str | None = None

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={getattr(self, name)!r}" for name in ("activation", "activation_module") if getattr(self, name)
        )
        return f"Merge({self.into!r}, {self.parts!r}{extra})"

    def activation_of(self, module: nn.Module) -> str | None:
        if self.activation_module is None:
            return self.activation
        return identify_activation(getattr(module, self.activation_module))

    def check(self, module: nn.Module) -> None:
        """Raise MergeError unless this instance can be merged."""
        _check_mergeable(module, self.into, self.parts)
        if self.activation_module is not None and self.activation_of(module) is None:
            act = getattr(module, self.activation_module)
            raise ActivationError(f"{self.activation_module} ({act!r}) is not exactly one of the fused activations.")

    def apply(self, module: nn.Module) -> nn.Module:
        activation, module_name = self.activation_of(module), self.activation_module
        return merge_linears(module, self.into, self.parts, activation=activation, activation_module=module_name)

    def undo(self, module: nn.Module) -> None:
        unmerge_linears(module, self.into)


def merge_declared(model: nn.Module) -> nn.Module:
    """Make the merges that modules' classes declare in ``_transfuse_merges`` (emitted files do)."""
    for module in model.modules():
        for merge in getattr(type(module), "_transfuse_merges", ()):
            if merge.into not in merges_of(module):
                merge.apply(module)
    return model
