"""Resolving the MODEL argument of the CLI: a local checkpoint, a GGUF file, a cached hub id, or a model_type."""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["ModelError", "is_gguf", "load_gguf", "load_gguf_tokenizer", "load_model", "resolve_checkpoint", "tiny_causal_lm"]


class ModelError(Exception):
    """A MODEL argument that cannot be loaded; the message is one line meant for the user."""


def _is_model_type(name: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return name in CONFIG_MAPPING


def is_gguf(spec: str) -> bool:
    return spec.endswith(".gguf")


def load_gguf(path: str, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a GGUF file, dequantised into an ordinary transformers model: one that
    ``save_pretrained`` writes as safetensors (transformers refuses that for a model loaded from
    GGUF, which stays marked as quantised). Needs the ``gguf`` package."""
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file.")
    directory, name = os.path.split(os.path.abspath(path))
    try:
        quantised = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
        tokenizer = load_gguf_tokenizer(path)
    except ImportError as exc:
        raise ModelError(f"reading GGUF files needs the gguf package (pip install gguf): {exc}") from None
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load {path} as a GGUF causal LM: {first}") from None
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(quantised.state_dict())
    return model.eval(), tokenizer


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def resolve_checkpoint(spec: str) -> str | None:
    """The local directory of a checkpoint MODEL (a directory, or a hub id in the cache); None for a
    model_type or a GGUF file (whose weights are written from the dequantised model)."""
    if is_gguf(spec):
        return None
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(spec, local_files_only=True)
        except Exception as exc:  # huggingface_hub raises several types for a missing cache entry
            raise ModelError(f"{spec!r} is not in the local Hugging Face cache ({type(exc).__name__}).") from None
    return None


def load_model(spec: str, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM from a checkpoint directory, a hub id in the local cache, or a model_type (tiny, random)."""
    from transformers import AutoModelForCausalLM

    if is_gguf(spec):
        return load_gguf(spec, dtype=dtype)[0]
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ModelError(f"{spec} is a directory but has no config.json; it is not a transformers checkpoint.")
        return _from_pretrained(AutoModelForCausalLM, spec, dtype, local_files_only=True)
    if _is_model_type(spec):
        return tiny_causal_lm(spec, dtype=dtype)
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise ModelError(f"{spec}: no such directory.")
    if spec.count("/") == 1:
        return _from_pretrained(AutoModelForCausalLM, spec, dtype, local_files_only=True)
    raise ModelError(
        f"{spec!r} is not a directory, a hub id (owner/name) or a known model type; "
        "try a model type such as 'llama' for a tiny random model."
    )


def tiny_causal_lm(model_type: str, **kwargs) -> nn.Module:
    """``tiny_model(model_type)``, with the CLI's error when it is not a causal-LM type."""
    from .tiny import causal_lm_types, tiny_model

    if model_type not in causal_lm_types():
        known = causal_lm_types()
        hint = "" if _is_model_type(model_type) else " (not a model type of this transformers)"
        raise ModelError(
            f"{model_type!r} is not a causal-LM model type{hint}; causal-LM types include "
            f"{', '.join(known[:10])}, ... ({len(known)} in all)."
        )
    try:
        return tiny_model(model_type, **kwargs)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"a tiny {model_type!r} model cannot be built: {first}") from None


def _from_pretrained(auto, spec: str, dtype: torch.dtype, **kwargs) -> nn.Module:
    try:
        return auto.from_pretrained(spec, dtype=dtype, **kwargs).eval()
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load {spec!r} from local files: {first}") from None
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"{spec!r} is not a causal language model: {first}") from None
