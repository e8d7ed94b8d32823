"""transformers' tensor parallelism: a plan entry for the merged projections a rewrite makes.

transformers' ``tp_plan`` shards ``q_proj``, ``k_proj``, ``v_proj`` (and ``gate_proj``, ``up_proj``)
column-wise, each by its own rows. A model loaded that way and rewritten afterwards merges each
rank's shards (``transfuse.ops.sharding``). A model rewritten first holds ``qkv_proj`` whole, and
the plan has no entry for it: transformers' packed styles (``packed_colwise``) split the
concatenated rows in equal strides, which for GQA (fewer k/v heads than q heads) would give a rank
some other rank's heads.

After a rewrite, ``plan_merged_projections`` adds to the model's ``tp_plan`` one entry per merged
projection whose parts the plan shards ``colwise``, with the style ``MERGED_COLWISE``: each rank keeps
its rows of each part (its q heads, then its k/v heads; its gate rows, then its up rows),
concatenated in the parts' order, which is the local tensor a merge of the parts' shards has. So
either order (distribute then rewrite, rewrite then distribute) gives every rank the same weights.
The parts' own entries stay (they name ``LinearPart`` views, which hold no parameter), and so do
the row-parallel entries. The style is registered with transformers when a rewritten model has a
plan (transformers' own registry of styles); it needs transformers' DTensor plan styles
(``transformers.distributed.tensor_parallel``, 5.17 has them): without them the plan is left as it was.
"""

from __future__ import annotations

from torch import nn

from ..ops.layers import MergedProjection
from ..rewriter.weights import merges_of, shard_merge

__all__ = ["MERGED_COLWISE", "plan_merged_projections"]

MERGED_COLWISE = "transfuse_merged_colwise"
_PART_STYLE = "colwise"  # the parts' style a merged entry stands for: replicated input, output Shard(-1)


def plan_merged_projections(model: nn.Module) -> None:
    """Name each merged projection of ``model`` whose parts its ``tp_plan`` shards column-wise in that
    plan, with ``MERGED_COLWISE`` (registered with transformers here). No plan: nothing changes."""
    plan = model.__dict__.get("_tp_plan")
    if not plan or not _register():
        return
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard as generic

    added = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for into, record in merges_of(module).items():
            if all(plan.get(generic(prefix + part)) == _PART_STYLE for part in record.parts):
                added[generic(prefix + into)] = MERGED_COLWISE
    if added:
        model._tp_plan = {**plan, **added}


def _register() -> bool:
    """Register ``MERGED_COLWISE`` with transformers' parallel styles; False where this transformers
    has no DTensor plan styles to extend."""
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
    except ImportError:
        return False
    if MERGED_COLWISE not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(MERGED_COLWISE, _style_class(TensorParallelLayer)())
    return True


def _style_class(base: type) -> type:
    class MergedColwiseParallel(base):
        """Column-parallel by parts for a merged projection: each rank keeps its rows of every part,
        so GQA's q and k/v keep their own heads."""

        def shard_param(self, module, param, mesh):
            """Nothing per parameter: ``install_forward`` shards the weight and bias together, by parts."""

        def install_forward(self, module, mesh):
            """Shard the merged projection by parts (``rewriter.weights.shard_merge``). Its forward already
            computes this rank's rows and sums the input's gradient over the ranks: it is not wrapped."""
            owner = module._owner() if isinstance(module, MergedProjection) and module._owner is not None else None
            if owner is None:
                raise ValueError(f"{MERGED_COLWISE} shards transfuse's merged projections, not a {type(module).__name__}.")
            into = next(name for name in merges_of(owner) if owner._modules[name] is module)
            shard_merge(owner, into, mesh)
            return module

    return MergedColwiseParallel
