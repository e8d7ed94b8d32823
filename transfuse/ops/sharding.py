"""Merged projections of tensor-parallel shards (transformers' ``tp_plan``, DTensor parameters).

Under column parallelism each rank holds rows ``Shard(0)`` of every projection's weight: for
q, k and v, its own heads of each. Concatenating the local shards of q, k and v gives this
rank's part of a merged projection, split by the local sizes; one local matmul then computes
exactly the local outputs the three sharded projections computed (GQA included: each part is
sharded by its own heads, which a single ``Shard(0)`` of the concatenated full weight is not).

``ColwiseShards`` records the mesh and the parts' full sizes. The merged weight is a DTensor
over the same mesh whose local tensor is that concatenation, so optimisers and gradient
clipping see it as the sharded parameter it is; its global layout (every rank's q, k, v in
rank order) is never materialised: checkpoints go through the parts, each a DTensor
``Shard(0)`` view of its rows of the local tensor, which transformers gathers into the
original full tensors when it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["ColwiseShards", "ExpertShards", "colwise_shards", "expert_shards", "is_sharded", "local_tensor"]


def is_sharded(tensor) -> bool:
    """Whether ``tensor`` is a DTensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return False
    return isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's local tensor of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


@dataclass(frozen=True, eq=False)
class ColwiseShards:
    """The sharding of a merged projection made of column-parallel parts.

    mesh: the parts' one-dimensional device mesh.
    full_sizes: each part's full output width (its ``out_features``).
    """

    mesh: object
    full_sizes: tuple[int, ...]

    @property
    def ranks(self) -> int:
        return self.mesh.size()

    def local_sizes(self) -> tuple[int, ...]:
        return tuple(size // self.ranks for size in self.full_sizes)

    def local(self, tensor: Tensor) -> Tensor:
        """This rank's rows of a part or merged tensor (a DTensor, or a full tensor to slice)."""
        if is_sharded(tensor):
            return tensor.to_local()
        from torch.distributed.tensor import Shard, distribute_tensor

        # src_data_rank=None: every rank holds the full tensor and keeps its rows, no communication.
        return distribute_tensor(tensor, self.mesh, [Shard(0)], src_data_rank=None).to_local()

    def sharded(self, local: Tensor, full_rows: int) -> Tensor:
        """A DTensor ``Shard(0)`` of ``full_rows`` rows whose local tensor is ``local`` (shared, not copied)."""
        from torch.distributed.tensor import DTensor, Shard

        shape = (full_rows, *local.shape[1:])
        return DTensor.from_local(
            local, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=_contiguous_stride(shape)
        )

    def merged(self, local: Tensor) -> Tensor:
        return self.sharded(local, sum(self.full_sizes))

    def input(self, x: Tensor) -> Tensor:
        """The replicated input as a local tensor whose gradient is summed over the ranks (each rank's
        matmul gives only its rows' share of it), as transformers' column-parallel layers do."""
        if is_sharded(x):
            from torch.distributed.tensor import Partial, Replicate

            return x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        if torch.is_grad_enabled() and x.requires_grad:
            return _SumGradient.apply(x, self.mesh.get_group())
        return x


def colwise_shards(names: Sequence[str], linears: Sequence[torch.nn.Module]) -> ColwiseShards | None:
    """The sharding of ``linears`` if all are column-parallel over one mesh, None if none is
    sharded; raises ValueError (with the reason) for any other mix."""
    sharded = [is_sharded(lin.weight) for lin in linears]
    if not any(sharded):
        return None
    from torch.distributed.tensor import Shard

    mesh = None
    for name, lin, is_dt in zip(names, linears, sharded):
        if not is_dt:
            raise ValueError(f"{name}.weight is a plain tensor while other parts are DTensors.")
        for tensor_name in ("weight", "bias"):
            tensor = getattr(lin, tensor_name)
            if tensor is None:
                continue
            if not is_sharded(tensor) or tuple(tensor.placements) != (Shard(0),) or tensor.device_mesh.ndim != 1:
                placements = getattr(tensor, "placements", "a plain tensor")
                raise ValueError(
                    f"{name}.{tensor_name} is sharded as {placements}: only column-parallel parts (Shard(0) over "
                    "one mesh dimension, tp_plan 'colwise') merge."
                )
            if mesh is None:
                mesh = tensor.device_mesh
            elif tensor.device_mesh != mesh:
                raise ValueError(f"{name}.{tensor_name} is on another device mesh than {names[0]}.weight.")
        if lin.weight.shape[0] % mesh.size():
            raise ValueError(
                f"{name} has {lin.weight.shape[0]} output features, not a multiple of the {mesh.size()} ranks: its "
                "shards are uneven."
            )
    return ColwiseShards(mesh, tuple(int(lin.weight.shape[0]) for lin in linears))


@dataclass(frozen=True, eq=False)
class ExpertShards:
    """The experts of a mixture-of-experts layer shared out over the ranks of one mesh dimension, every
    rank holding the same tokens: whole experts per rank (expert parallelism: the expert tensors
    ``Shard(0)``), or every expert's intermediate features split over the ranks (tensor parallelism:
    ``w13`` by its gate and up features, ``w2`` by its input features).

    A fused mixture-of-experts layer then routes every token on every rank, computes with its grouped
    kernels what this rank holds (with whole experts, the routes to other ranks' experts masked:
    weight 0, a local id in range) and sums the ranks' outputs: no token moves.
    """

    mesh: object
    experts: int  # the global number of experts
    whole_experts: bool = True

    @property
    def local_experts(self) -> int:
        return self.experts // self.mesh.size() if self.whole_experts else self.experts

    def local_routes(self, rows: Tensor, weights: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, weights, local ids) for what this rank holds. In training, the rows' and the weights'
        gradients are summed over the ranks: each rank's backward reaches only its share."""
        group = self.mesh.get_group()
        if torch.is_grad_enabled():
            if rows.requires_grad:
                rows = _SumGradient.apply(rows, group)
            if weights.requires_grad:
                weights = _SumGradient.apply(weights, group)
        if not self.whole_experts:
            return rows, weights, ids
        first = self.mesh.get_local_rank() * self.local_experts
        local = ids - first
        off = (local < 0) | (local >= self.local_experts)
        return rows, weights.masked_fill(off, 0), local.masked_fill(off, 0)

    def combine(self, out: Tensor) -> Tensor:
        """The sum of the ranks' partial outputs, on every rank (its backward: the identity, every rank
        holding the same loss)."""
        return _SumForward.apply(out, self.mesh.get_group())


def expert_shards(
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None,
    b2: Tensor | None,
    *,
    interleaved: bool,
    w13_transposed: bool,
    w2_transposed: bool,
    shared_batch: bool | None,
) -> ExpertShards | None:
    """How a layer's packed expert tensors are shared out over the ranks (``ExpertShards``), None if
    none is a DTensor; raises ValueError (with the reason) for a sharding the layer cannot compute.

    Whole experts need the ranks of the expert group to hold the same tokens (``shared_batch``: None
    when the caller cannot tell). Features split over the ranks (a tensor-parallel plan's experts) need
    ``w13`` sharded by its gate and up features as the layout keeps them (each half by its rows, or
    for interleaved features whole pairs) and ``w2`` by its input features, and no expert biases."""
    present = [t for t in (w13, w2, b13, b2) if t is not None]
    if not any(is_sharded(t) for t in present):
        return None
    mesh = None
    for tensor in present:
        if not is_sharded(tensor) or tensor.device_mesh.ndim != 1:
            placements = getattr(tensor, "placements", "a plain tensor")
            raise ValueError(f"an expert tensor is {placements}, not sharded over one mesh dimension like the others.")
        if mesh is None:
            mesh = tensor.device_mesh
        elif tensor.device_mesh != mesh:
            raise ValueError("the expert tensors are on different device meshes.")
    ranks, experts = mesh.size(), int(w13.shape[0])
    if all(_placement(t) == ("shard", 0, 1) for t in present):
        if experts % ranks:
            raise ValueError(f"{experts} experts do not split evenly over {ranks} ranks.")
        if not shared_batch:
            raise ValueError(
                "the ranks of the expert-parallel group may hold different tokens (expert parallelism over "
                "data-parallel ranks), which need the tokens moved between ranks; the fused layer computes the "
                "all-reduce form only (ep_size equal to tp_size)."
                if shared_batch is not None
                else "the expert-parallel configuration is unknown (no distributed_config on the model's configuration)."
            )
        return ExpertShards(mesh, experts)
    d13, d2 = (2 if w13_transposed else 1), (1 if w2_transposed else 2)
    want13 = ("shard", d13, 1) if interleaved else ("shard", d13, 2)
    if _placement(w13) == want13 and _placement(w2) == ("shard", d2, 1) and b13 is None and b2 is None:
        features = int(w2.shape[d2])
        if features % ranks:
            raise ValueError(f"{features} intermediate features do not split evenly over {ranks} ranks.")
        return ExpertShards(mesh, experts, whole_experts=False)
    raise ValueError(
        f"the expert tensors are sharded as {tuple(w13.placements)} and {tuple(w2.placements)}"
        f"{' with biases' if b13 is not None or b2 is not None else ''}: the fused layer computes whole experts per "
        "rank (Shard(0)) or, without expert biases, every expert's intermediate features split over the ranks."
    )


def _placement(tensor: Tensor) -> tuple[str, int, int] | None:
    """A DTensor's one placement as (kind, dimension, strides): ``Shard(d)`` is ("shard", d, 1), a
    shard of each of k equal blocks of dimension d (``_StridedShard``) ("shard", d, k)."""
    (placement,) = tensor.placements
    dim = getattr(placement, "dim", None)
    if dim is None or placement.is_replicate() or placement.is_partial():  # a _StridedShard is no is_shard()
        return None
    return ("shard", dim % tensor.ndim, int(getattr(placement, "split_factor", 1)))


class _SumForward(torch.autograd.Function):
    """The sum over the process group forward; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradient(torch.autograd.Function):
    """The identity forward; the backward sums the gradient over the process group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))
