"""Resolving the MODEL argument of the CLI: a local checkpoint, a cached hub id, or a model_type."""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["ModelError", "load_model", "resolve_checkpoint"]


class ModelError(Exception):
    """A MODEL argument that cannot be loaded; the message is one line meant for the user."""


def _is_model_type(name: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return name in CONFIG_MAPPING


def resolve_checkpoint(spec: str) -> str | None:
    """The local directory of a checkpoint MODEL (a directory, or a hub id in the cache); None for a model_type."""
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

    from .tiny import tiny_model

    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ModelError(f"{spec} is a directory but has no config.json; it is not a transformers checkpoint.")
        return _from_pretrained(AutoModelForCausalLM, spec, dtype, local_files_only=True)
    if _is_model_type(spec):
        try:
            return tiny_model(spec, dtype=dtype)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0]
            raise ModelError(f"model type {spec!r} is not a causal language model in transformers ({first})") from None
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise ModelError(f"{spec}: no such directory.")
    if spec.count("/") == 1:
        return _from_pretrained(AutoModelForCausalLM, spec, dtype, local_files_only=True)
    raise ModelError(
        f"{spec!r} is not a directory, a hub id (owner/name) or a known model type; "
        "try a model type such as 'llama' for a tiny random model."
    )


def _from_pretrained(auto, spec: str, dtype: torch.dtype, **kwargs) -> nn.Module:
    try:
        return auto.from_pretrained(spec, dtype=dtype, **kwargs).eval()
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load {spec!r} from local files: {first}") from None
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"{spec!r} is not a causal language model: {first}") from None
