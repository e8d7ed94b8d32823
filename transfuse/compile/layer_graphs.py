"""Small-batch CUDA graphs of a model's fused mixture-of-experts layers: the caller's choice.

On a GPU an eager call of a fused MoE layer with a few tokens (a decode step outside a whole-step
graph) costs the host several times its GPU time, and the layer can replay a CUDA graph of itself
instead (``ops.moe_layer``, ``ops.graphs``). A layer does so only where asked:
``transfuse.decode_steps`` and ``transfuse.compile`` ask for every MoE layer of their model
(``enable``); a rewrite alone never does, so its verification runs the layers' code.
"""

from __future__ import annotations

from torch import nn

from ..ops.moe_layer import MoE

__all__ = ["enable"]


def enable(model: nn.Module) -> int:
    """Turn on the small-batch graphs of every fused MoE layer of ``model``; returns how many."""
    layers = [module for module in model.modules() if isinstance(module, MoE)]
    for layer in layers:
        layer.graph_small_batches = True
    return len(layers)
