"""Tiny random models of any ``model_type``, for the CLI and the tests: no download.

One table of small values for configuration keys that many architectures share;
a key is set only where the architecture's default configuration has it. Nothing
here names a model family.
"""

from __future__ import annotations

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

# Token ids must stay inside the tiny vocabulary.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def causal_lm_types() -> list[str]:
    """The model types transformers builds a causal LM for, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _read_only(cls: type, key: str) -> bool:
    """Whether ``key`` is a property of the config class that cannot be set (falcon's head_dim)."""
    attribute = getattr(cls, key, None)
    return isinstance(attribute, property) and attribute.fset is None


def tiny_config(model_type: str, **overrides):
    """A small configuration of ``model_type``: two layers, hidden size 64, a few experts."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        causal = causal_lm_types()
        raise ValueError(
            f"Unknown model type {model_type!r}. Causal-LM types include: "
            f"{', '.join(causal[:12])}, ... ({len(causal)} in all)."
        )
    default = CONFIG_MAPPING[model_type]()
    values = {k: v for k, v in _TINY_VALUES.items() if hasattr(default, k) and not _read_only(type(default), k)}
    if "qk_rope_head_dim" in values and "head_dim" in values:
        values["head_dim"] = values["qk_rope_head_dim"]  # such configs rotate only the rope part of a head
    values.update(overrides)
    config = AutoConfig.for_model(model_type, **values)
    vocab = getattr(config, "vocab_size", None)
    for key in _TOKEN_ID_KEYS:
        token = getattr(config, key, None)
        if vocab and isinstance(token, int) and token >= vocab:
            setattr(config, key, vocab - 1)
        elif vocab and isinstance(token, list):
            setattr(config, key, [min(t, vocab - 1) for t in token])
    return config


def tiny_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised causal LM of ``model_type`` built from ``tiny_config``, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
