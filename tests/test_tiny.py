"""The tiny-config builder (``transfuse.tiny``): every nested configuration shrinks by the same rules,
per-layer lists and counts follow the tiny layer count, head counts divide the hidden size, and the
families that share the plain table keep exactly its values. Models are built on the meta device
(shapes only), so these tests are quick."""

from __future__ import annotations

import pytest
import torch

from transfuse.tiny import tiny_config, tiny_model


def _needs(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    try:
        CONFIG_MAPPING[model_type]()
    except Exception as exc:  # noqa: BLE001 - transformers 5.17's musicgen: its own default is refused
        pytest.skip(f"this transformers cannot build {model_type}'s default configuration ({type(exc).__name__})")


def _meta_model(model_type: str, **overrides):
    with torch.device("meta"):
        return tiny_model(model_type, **overrides)


def _parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_a_plain_family_takes_the_table():
    config = tiny_config("llama")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (2, 16, 256)


@pytest.mark.parametrize("model_type", ["gemma3", "llama4", "qwen3_5", "fuyu", "mllama", "emu3"])
def test_every_nested_configuration_is_shrunk(model_type):
    """Composite configurations kept full-size sub-models (gemma3's 2.7B parameters)."""
    _needs(model_type)
    config = tiny_config(model_type)
    text = config.get_text_config()
    assert text.hidden_size == 64 and text.num_hidden_layers == 2 and text.vocab_size == 256
    assert _parameters(_meta_model(model_type)) < 50_000_000


def test_a_sub_configuration_override_is_merged_into_the_tiny_one():
    _needs("gemma3")
    config = tiny_config("gemma3", text_config=dict(hidden_size=32, num_attention_heads=2, head_dim=16))
    assert config.text_config.hidden_size == 32 and config.text_config.num_attention_heads == 2
    assert config.text_config.num_hidden_layers == 2 and config.text_config.vocab_size == 256
    assert config.vision_config.hidden_size == 64


def test_a_heterogeneous_configuration_builds():
    """Per-layer attributes (a full-attention layer's own head size) raise on the global config."""
    _needs("gemma4_text")
    config = tiny_config("gemma4_text")
    assert config.num_hidden_layers == 2 and config.is_heterogeneous
    assert _parameters(_meta_model("gemma4_text")) < 50_000_000


def test_head_counts_divide_the_hidden_size():
    _needs("whisper")
    config = tiny_config("whisper")
    for key in ("encoder_attention_heads", "decoder_attention_heads"):
        assert config.d_model % getattr(config, key) == 0, key
    assert config.decoder_layers == 2 and config.encoder_layers == 2


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "deepseek_v3"])
def test_latent_attention_keeps_a_key_value_head_per_head(model_type):
    """Latent attention makes every head's key from the latent: fewer key/value heads than heads
    would make transformers' attention repeat them (DeepSeek-V3.2's indexer mask then fails)."""
    _needs(model_type)
    config = tiny_config(model_type)
    assert config.num_key_value_heads == config.num_attention_heads == 4
    assert config.hidden_size == 64 and config.kv_lora_rank == 16
    model = tiny_model(model_type)
    ids = torch.randint(0, 256, (2, 8))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=padded).logits[0]).all()


@pytest.mark.parametrize("model_type", ["gptj", "codegen"])
def test_a_partial_rotary_width_keeps_its_fraction_of_the_head(model_type):
    """GPT-J rotates the first 64 of its 256-wide heads: a quarter of the tiny 16-wide heads."""
    _needs(model_type)
    config = tiny_config(model_type)
    assert config.n_embd // config.n_head == 16 and config.rotary_dim == 4
    with torch.no_grad():
        tiny_model(model_type)(torch.randint(0, 256, (2, 8)))
    assert tiny_config("llama").to_diff_dict().get("rotary_dim") is None


def test_an_expanded_width_keeps_its_heads_ratio():
    """An SSM's heads x head size equals its expanded width (hidden x expand), as the default has it."""
    _needs("mamba2")
    config = tiny_config("mamba2")
    assert config.num_heads * config.head_dim == config.hidden_size * config.expand


def test_a_per_layer_list_the_config_does_not_derive_is_cut_to_the_layer_count():
    _needs("zamba2")
    config = tiny_config("zamba2")
    assert len(config.layers_block_type) == config.num_hidden_layers == 2
    assert set(config.layers_block_type) == {"linear_attention", "hybrid"}  # one layer of each kind


def test_a_run_length_layer_pattern_is_cut_to_the_layer_count():
    _needs("gpt_neo")
    config = tiny_config("gpt_neo")
    assert len(config.attention_layers) == config.num_layers == 2


def test_counts_of_some_layers_shrink_with_the_layer_count():
    _needs("gemma3n_text")
    assert tiny_config("gemma3n_text").num_kv_shared_layers < 2
    _needs("dory")
    config = tiny_config("dory")
    assert config.n_input_layers + config.n_recurrent_layers + config.n_output_layers == config.num_hidden_layers


def test_a_layer_count_that_cannot_be_set_goes_by_its_other_names():
    _needs("prophetnet")
    config = tiny_config("prophetnet")
    assert config.num_encoder_layers == config.num_decoder_layers == 2


def test_the_causal_lm_is_built_on_the_sub_configuration_it_declares():
    _needs("musicgen")
    model = _meta_model("musicgen")
    assert type(model).__name__ == "MusicgenForCausalLM" and model.config.hidden_size == 64


def test_a_hidden_size_under_another_name_follows_the_part_it_names():
    _needs("blt")
    config = tiny_config("blt")
    assert config.encoder_config.hidden_size_global == config.global_config.hidden_size == 64
