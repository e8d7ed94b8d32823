"""Tiny random models of any ``model_type``, for the CLI and the tests: no download.

One table of small values for configuration keys that many architectures share; a key is
set only where the architecture's default configuration has it and accepts a new value.
Other vocabularies (per-layer input embeddings, hashed n-grams) are cut to the tiny one, and
a hidden size under another name that is some part's hidden size (``hidden_size_global``)
becomes the tiny hidden size.
The same rules shrink every nested configuration (``text_config``, ``vision_config``, an
encoder's or a decoder's, any attribute that is a configuration), recursively.

Where the table alone leaves a configuration inconsistent (a head count that does not divide
the hidden size, a count of some of the layers above the tiny layer count, a layer count that
goes by other names) or its own validation refuses it, rules driven by attribute names repair
the rest, so that the families the table suits keep exactly its values:

* a count of layers under another name (``encoder_layers``) becomes the tiny layer count; a
  count of some of them (``num_kv_shared_layers``) shrinks in proportion, and counts that add
  up to the layer count still do;
* a head count that splits the hidden size (``decoder_attention_heads``) divides the tiny one;
  more heads than hidden units (an SSM's ``num_heads``) keep the default's ratio of heads x
  head size to hidden size; one key/value head per head stays so, and latent attention (a
  ``kv_lora_rank``: every head's key is made from the latent) always has it;
* a rotary width below the head size (``rotary_dim``) above the tiny head size keeps its
  fraction of the head size;
* a width the default keeps equal to a hidden size (its own or another part's, an adapter's)
  becomes the tiny hidden size;
* a count the default keeps below the table's value (one expert per token) stays there;
* a run-length pattern of layers (``attention_types``) is cut to the tiny layer count.

A per-layer list (``layer_types``, ``layers_block_type``) that the configuration does not
derive again from the tiny layer count is cut to it, keeping one layer of each kind it can.
The causal-LM class is built on the configuration it declares, where that is one of the
composite's sub-configurations (a decoder inside an encoder-decoder configuration).

Nothing here names a model family.
"""

from __future__ import annotations

import copy
import math
import re

import torch

__all__ = ["causal_lm_types", "tiny_config", "tiny_model"]

# Small values for common configuration keys. Sizes keep every head, expert and
# rank dimension consistent with one another (hidden 64 = 4 heads x 16).
_TINY_VALUES = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "d_head": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    # mixture of experts
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # low-rank attention
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # hybrid state-space layers
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 8,
    "attn_layer_offset": 1,
    "attn_layer_period": 2,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    # local attention
    "sliding_window": 16,
}

# Counts the table sets that a default may keep lower (an architecture that routes each token
# to one expert only): the default's value is kept where it is smaller.
_AT_MOST_DEFAULT = ("num_experts_per_tok", "moe_k")

# Token ids must stay inside the tiny vocabulary.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Names of layer counts and head counts the table does not set (``encoder_layers``, ``n_head``).
_LAYER_COUNT = re.compile(r"^(?!.*every)(.*_)?(num|n)_(\w+_)?layers?$|^(encoder|decoder)_layers$")
_HEAD_COUNT = re.compile(r"(^|_)(heads|n_head|n_heads)$")
_KV_HEADS = re.compile(r"key_value|kv")
# Head counts whose heads split the hidden size (others, a linear attention's, have widths of their own).
_SPLITS_HIDDEN = re.compile(r"attention_heads$|^(n_head|n_heads|num_heads)$")

# Layer patterns written as runs, ``[[kinds, repeats], ...]`` (expanded by the configuration).
_RUN_LENGTH_LAYER_PATTERNS = ("attention_types",)


def causal_lm_types() -> list[str]:
    """The model types transformers builds a causal LM for, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _get(config, key: str, default=None):
    """``config.key``, also for an attribute that a heterogeneous config keeps per layer."""
    getter = getattr(config, "_getattr_without_heterogeneous_validation", None)
    try:
        return getter(key, default) if getter is not None else getattr(config, key, default)
    except Exception:  # noqa: BLE001 - a property that raises (no such limit for this architecture)
        return default


def _has(config, key: str) -> bool:
    marker = object()
    return _get(config, key, marker) is not marker


def _settable(config, key: str) -> bool:
    """Whether the config accepts a new ``key`` (not falcon's read-only head_dim, nor a setter that raises)."""
    attribute = getattr(type(config), key, None)
    if not isinstance(attribute, property):
        return True
    if attribute.fset is None:
        return False
    try:
        attribute.fset(copy.copy(config), _get(config, key))
    except Exception:  # noqa: BLE001 - the setter refuses any value
        return False
    return True


def _is_config(value) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sub_configs(config) -> dict:
    """The nested configurations of ``config``: its declared sub-configs and any attribute that is one."""
    names = list(getattr(type(config), "sub_configs", None) or {})
    names += [k for k, v in vars(config).items() if _is_config(v) and k not in names]
    return {name: value for name in names if _is_config(value := _get(config, name))}


def _shrink_pattern(values: list, n: int) -> list:
    """``n`` entries of a per-layer list in their order: the first of each kind, then from the start."""
    keep = []
    for index, value in enumerate(values):
        if value not in (values[i] for i in keep) and len(keep) < n:
            keep.append(index)
    for index in range(len(values)):
        if len(keep) >= n:
            break
        if index not in keep:
            keep.append(index)
    return [values[i] for i in sorted(keep)]


def _shrink_runs(runs, n: int) -> list | None:
    """A run-length layer pattern ``[[kinds, repeats], ...]`` cut to ``n`` layers (its first run's kinds),
    or None if ``runs`` is not one."""
    sequence = (list, tuple)
    if not (isinstance(runs, sequence) and runs and all(isinstance(r, sequence) and len(r) == 2 for r in runs)):
        return None
    kinds = runs[0][0]
    if not isinstance(kinds, sequence) or not kinds:
        return None
    if n % len(kinds) == 0:
        return [[list(kinds), n // len(kinds)]]
    return [[list(kinds)[:n], 1]] if len(kinds) >= n else None


def _per_layer_lists(config, layers: int) -> dict:
    """The list attributes of ``config`` with one entry per layer."""
    lists = {}
    for key, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == layers and layers > 1 and not key.startswith("_"):
            lists[key] = value
    return lists


def _table_values(config) -> dict:
    """The table's values for the keys ``config`` has and accepts."""
    values = {k: v for k, v in _TINY_VALUES.items() if _has(config, k) and _settable(config, k)}
    if "qk_rope_head_dim" in values and "head_dim" in values:
        values["head_dim"] = values["qk_rope_head_dim"]  # such configs rotate only the rope part of a head
    for key, value in vars(config).items():
        # Other vocabularies (per-layer input embeddings, hashed n-grams) are no larger than the tiny one.
        if "vocab" in key and key not in values and _int(value) and value > _TINY_VALUES["vocab_size"]:
            if _settable(config, key) and not key.startswith("_"):
                values[key] = _TINY_VALUES["vocab_size"]
    return values


def _counts(config, values: dict):
    """The layer counts and head counts of ``config`` that the table does not set: (key, value, kind)."""
    aliases = {getattr(type(config), "attribute_map", {}).get(key) for key in values}
    for key, value in vars(config).items():
        if key in values or key in aliases or key.startswith("_") or not _int(value) or value <= 0:
            continue
        if not _settable(config, key):
            continue
        if _LAYER_COUNT.search(key):
            yield key, value, "layers"
        elif _HEAD_COUNT.search(key):
            yield key, value, "heads"


def _head_size(config, values: dict | None = None) -> int | None:
    """The attention head size, ``head_dim`` or else the hidden size over the head count: of the
    default ``config``, or with the table's ``values`` where given (the default's ``head_dim`` does
    not carry over to them)."""
    def get(key: str):
        return _get(config, key) if values is None else values.get(key, None if key == "head_dim" else _get(config, key))

    size, hidden, heads = get("head_dim"), get("hidden_size"), get("num_attention_heads")
    if _int(size) and size > 0:
        return size
    return hidden // heads if _int(hidden) and _int(heads) and heads > 0 and hidden % heads == 0 else None


def _partial_rotary(config, values: dict) -> tuple[str, int] | None:
    """(key, tiny value) of a rotary width the default keeps below its head size (``rotary_dim``:
    the first dimensions of each head rotate), kept at the same fraction of the tiny head size."""
    value, head, tiny_head = _get(config, "rotary_dim"), _head_size(config), _head_size(config, values)
    if "rotary_dim" in values or not (_int(value) and head and tiny_head) or not 0 < value < head:
        return None
    if value <= tiny_head:
        return None
    return "rotary_dim", max(2, 2 * round(value * tiny_head / head / 2))


def _latent_attention(config, values: dict) -> bool:
    """Whether ``config`` is latent attention (a ``kv_lora_rank``) whose default has a key/value head per
    head and the table fewer: its keys are made for every head from the latent, so a smaller key/value
    head count would make transformers repeat them."""
    heads, kv_heads = _get(config, "num_attention_heads"), _get(config, "num_key_value_heads")
    return (
        _int(_get(config, "kv_lora_rank")) and _int(heads) and heads == kv_heads
        and values.get("num_key_value_heads", heads) != values.get("num_attention_heads", heads)
    )


def _needs_repair(config, values: dict) -> bool:
    """Whether the table alone leaves ``config`` inconsistent: a head count that does not divide the tiny
    hidden size, a count of some of the layers above the tiny layer count, a layer count the table
    cannot set (it goes by other names), a rotary width above the tiny head size, latent attention with
    fewer key/value heads than heads."""
    layers, tiny_hidden = _get(config, "num_hidden_layers"), values.get("hidden_size")
    if _has(config, "num_hidden_layers") and "num_hidden_layers" not in values:
        return True
    if _partial_rotary(config, values) is not None or _latent_attention(config, values):
        return True
    for key, value, kind in _counts(config, values):
        splits = kind == "heads" and _SPLITS_HIDDEN.search(key) and "head_dim" not in values
        if splits and tiny_hidden and value <= tiny_hidden and tiny_hidden % value:
            return True
        if kind == "layers" and _int(layers) and _TINY_VALUES["num_hidden_layers"] < value < layers:
            return True
    return False


def _repairs(config, values: dict, widths: set) -> dict:
    """Values that make the rest of ``config`` consistent with the table (the rules in the module docstring)."""
    repaired = {}
    heads, kv_heads = _get(config, "num_attention_heads"), _get(config, "num_key_value_heads")
    if "num_key_value_heads" in values and "num_attention_heads" in values and _int(heads) and heads == kv_heads:
        repaired["num_key_value_heads"] = values["num_attention_heads"]  # one key/value head per head, as the default
    for key in _AT_MOST_DEFAULT:
        if key in values and _int(default := _get(config, key)) and 0 < default < values[key]:
            repaired[key] = default
    if (rotary := _partial_rotary(config, values)) is not None:
        repaired[rotary[0]] = rotary[1]
    layers, tiny_layers = _get(config, "num_hidden_layers"), _TINY_VALUES["num_hidden_layers"]
    hidden, head_dim = _get(config, "hidden_size"), _get(config, "head_dim")
    tiny_hidden = values.get("hidden_size", _TINY_VALUES["hidden_size"])
    counts = list(_counts(config, values))
    parts = {key: value for key, value, kind in counts if kind == "layers" and _int(layers) and value < layers}
    repaired.update(_shrink_parts(parts, layers, tiny_layers))
    for key, value, kind in counts:
        if kind == "layers" and key not in parts and value > tiny_layers:
            repaired[key] = tiny_layers  # the layer count under another name (an encoder's, a decoder's)
        elif kind == "heads" and value > tiny_hidden and _int(hidden) and _int(head_dim) and "head_dim" in values:
            # More heads than hidden units: heads of an expanded width (an SSM's); keep heads x head size
            # against the hidden size as the default has it.
            repaired[key] = max(1, round(value * head_dim / hidden * tiny_hidden / values["head_dim"]))
        elif kind == "heads" and _SPLITS_HIDDEN.search(key) and "head_dim" not in values and tiny_hidden % value:
            repaired[key] = _TINY_VALUES["num_key_value_heads" if _KV_HEADS.search(key) else "num_attention_heads"]
    for key, value in vars(config).items():
        # A width the default keeps equal to a hidden size (its own, or another part's of a composite model)
        # is that hidden size under another name.
        if key not in values and re.search(r"dim|size", key) and value in widths and _int(value) and value > 0:
            if "hidden_size" in values and not key.startswith("_") and _settable(config, key):
                repaired[key] = values["hidden_size"]
    for key in _RUN_LENGTH_LAYER_PATTERNS:
        if _has(config, key) and (runs := _shrink_runs(_get(config, key), tiny_layers)) is not None:
            repaired[key] = runs
    return repaired


def _shrink_parts(parts: dict, layers: int, tiny_layers: int) -> dict:
    """Counts of some of the ``layers`` shrunk in proportion to ``tiny_layers``; counts that add up to the
    layer count still add up to it (largest remainders)."""
    if not parts or max(parts.values()) <= tiny_layers:
        return {}
    quotas = {key: value * tiny_layers / layers for key, value in parts.items()}
    shrunk = {key: math.floor(q) for key, q in quotas.items()}
    if sum(parts.values()) == layers:
        by_remainder = sorted(quotas, key=lambda key: shrunk[key] - quotas[key])
        for key in by_remainder[: tiny_layers - sum(shrunk.values())]:
            shrunk[key] += 1
    return shrunk


def _hidden_sizes(config) -> set:
    """The hidden sizes of ``config`` and of every configuration nested in it."""
    sizes = {size} if _int(size := _get(config, "hidden_size")) else set()
    for sub in _sub_configs(config).values():
        sizes |= _hidden_sizes(sub)
    return sizes


def _stale(config, lists: dict) -> dict:
    """The per-layer ``lists`` of the default that ``config`` keeps at a length other than its layer count."""
    layers = _get(config, "num_hidden_layers")
    return {key: value for key, value in lists.items() if len(_get(config, key) or ()) not in (0, layers)}


def _build(default, overrides: dict, widths: set | None = None):
    """A small configuration of ``default``'s class. The table first (sub-configurations shrunk the same
    way); where that leaves the configuration inconsistent or its own validation refuses it, the repairs
    too; where it keeps a per-layer list at the default's length (it does not derive it again from the tiny
    layer count), the lists cut to the tiny layer count."""
    cls, overrides = type(default), dict(overrides)
    widths = _hidden_sizes(default) if widths is None else widths
    values = _table_values(default)
    for key, value in vars(default).items():
        # A hidden size under another name (another part's, ``hidden_size_global``) is the tiny one.
        if "hidden_size" in key and key not in values and _int(value) and value in widths and value > 0:
            if "hidden_size" in values and not key.startswith("_") and _settable(default, key):
                values[key] = values["hidden_size"]
    for key, sub in _sub_configs(default).items():
        given = overrides.pop(key, None)
        values[key] = given if _is_config(given) else _build(sub, given or {}, widths)
    layers, tiny_layers = _get(default, "num_hidden_layers"), _TINY_VALUES["num_hidden_layers"]
    lists = _per_layer_lists(default, layers) if _int(layers) and layers > tiny_layers else {}
    lists = {k: v for k, v in lists.items() if k not in values and k not in overrides and _settable(default, k)}
    if not _needs_repair(default, values):
        try:
            config = cls(**{**values, **overrides})
        except Exception:  # noqa: BLE001 - its validation refused the table alone: repaired below
            pass
        else:
            if not _stale(config, lists):
                return config
    values.update(_repairs(default, values, widths))
    values.update(overrides)
    try:
        config = cls(**values)
    except Exception:  # noqa: BLE001 - it refused the default's per-layer lists: cut them too
        if not lists:
            raise
    else:
        lists = _stale(config, lists)
        if not lists:
            return config
    return cls(**values, **{k: _shrink_pattern(list(v), tiny_layers) for k, v in lists.items()})


def tiny_config(model_type: str, **overrides):
    """A small configuration of ``model_type``: two layers, hidden size 64, a few experts."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        causal = causal_lm_types()
        raise ValueError(
            f"Unknown model type {model_type!r}. Causal-LM types include: "
            f"{', '.join(causal[:12])}, ... ({len(causal)} in all)."
        )
    config = _build(CONFIG_MAPPING[model_type](), overrides)
    _clamp_token_ids(config)
    return config


def _clamp_token_ids(config) -> None:
    vocab = _get(config, "vocab_size")
    for key in _TOKEN_ID_KEYS:
        token = _get(config, key)
        if vocab and isinstance(token, int) and token >= vocab:
            setattr(config, key, vocab - 1)
        elif vocab and isinstance(token, list):
            setattr(config, key, [min(t, vocab - 1) for t in token])
    for sub in _sub_configs(config).values():
        _clamp_token_ids(sub)


def _declared_sub_config(config):
    """The sub-configuration that the causal-LM class of ``config``'s type declares as its configuration,
    where it declares one of them rather than ``config``'s class (a composite's decoder); else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    wanted = getattr(model_class, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return None
    found = [sub for sub in _sub_configs(config).values() if isinstance(sub, wanted)]
    return (model_class, found[0]) if len(found) == 1 else None


def tiny_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised causal LM of ``model_type`` built from ``tiny_config``, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    declared = _declared_sub_config(config)
    if declared is not None:
        model_class, sub = declared
        model = model_class._from_config(sub, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
