"""Whether a model can take the decode path: the checks ``transfuse.compile`` and the decode steps share.

A model takes the path where its attention can run as transfuse's attention op (SDPA or eager
attention), it decodes with transformers' dynamic cache, whose layers are all key/value layers,
and its forward takes ``position_ids``. ``check`` raises ``CompileError`` saying which of these
fails; otherwise it returns the configs whose attention implementation the path switches.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

from .attention import IMPLEMENTATION

__all__ = [
    "CompileError", "cache_layer_types", "check", "dynamic_cache", "forward_parameters", "latent_cache_growth",
]  # fmt: skip


class CompileError(ValueError):
    """The model cannot take the compile path; the message says why."""



def dynamic_cache() -> type:
    from transformers import DynamicCache

    return DynamicCache


@functools.lru_cache(maxsize=1)
def cache_layer_types() -> tuple[type, ...]:
    from transformers import cache_utils

    return tuple(
        getattr(cache_utils, name) for name in ("DynamicLayer", "DynamicSlidingWindowLayer") if hasattr(cache_utils, name)
    )



def latent_cache_growth(config: Any) -> tuple[int, int] | None:
    """(numbers a token and layer in the model's own cache, in the compile path's) for latent
    attention (a ``kv_lora_rank``: the model caches the compressed latent and the shared rotary
    key, and makes every head's key and value from them), or None. The attention op is handed
    the keys and values the model attends with, so that is what the path's cache holds."""
    def number(key: str) -> int | None:
        try:
            found = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute of a heterogeneous config
            return None
        return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None

    keys = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
    rank, rope, nope, value, heads = (number(key) for key in keys)
    if None in (rank, rope, nope, value, heads):
        return None
    own, path = rank + rope, heads * (nope + rope + value)
    return (own, path) if path > own else None



def check(model: nn.Module, modules: list[nn.Module] | None = None) -> list[Any]:
    """The configs whose attention implementation the compiled calls switch; raises
    ``CompileError`` where the path cannot hold (``modules``: the model's, where the caller has
    them)."""
    from transformers import DynamicCache, PretrainedConfig

    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise CompileError("transfuse.compile takes a transformers model (it has no config)")
    if getattr(config, "is_encoder_decoder", False):
        raise CompileError("transfuse.compile does not take encoder-decoder models (cross-attention has no cache layer of its own)")
    configs: list[Any] = []
    for module in modules if modules is not None else model.modules():
        sub = module.__dict__.get("config")  # (a plain attribute: no ``nn.Module.__getattr__`` miss)
        if isinstance(sub, PretrainedConfig) and all(sub is not c for c in configs):
            configs.append(sub)
    implementations = {c._attn_implementation for c in configs}
    unsupported = implementations - {"sdpa", "eager", None, IMPLEMENTATION}
    if unsupported:
        raise CompileError(
            f"transfuse.compile runs attention itself (SDPA) in place of the model's "
            f"{', '.join(sorted(unsupported))}: load the model with attn_implementation='sdpa'"
        )
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        raise CompileError(f"transfuse.compile: {type(model).__name__} does not decode with transformers' dynamic cache")
    if "position_ids" not in forward_parameters(model):
        raise CompileError(
            f"transfuse.compile: {type(model).__name__}'s forward takes no position_ids, so it works out its "
            "positions from the cache, which the compiled calls do not hand it"
        )
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # noqa: BLE001 - a config DynamicCache cannot build a cache for
        raise CompileError(f"transfuse.compile: transformers builds no dynamic cache for this config ({exc})") from exc
    kinds = cache_layer_types()
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in kinds})
    if odd:
        raise CompileError(
            f"transfuse.compile: the model's cache has layers that are not attention key/value "
            f"layers ({', '.join(odd)}); only attention is kept outside the graph"
        )
    return configs



def forward_parameters(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
