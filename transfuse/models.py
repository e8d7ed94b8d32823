"""Resolving the MODEL argument of the CLI: a local checkpoint, a GGUF file, a cached hub id, or a model_type.

A checkpoint loads as ``from_pretrained`` loads it, in its own dtype, with transformers' load
report (missing, unexpected and mismatched weights) shown even where its other warnings are
silenced. What cannot be loaded is a ``ModelError``, one line that names the file and the problem
(``checkpoint_errors``): a bad file, a refused configuration, a weight of another shape, and,
unless allowed, weights the checkpoint lacks. A checkpoint's own code runs only when trusted:
otherwise transformers is never asked (it would prompt on a terminal and run it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import struct
from typing import Iterator

import torch
from torch import nn

from .checkpoint_errors import config_problem, first_line, gguf_problem, loading_problem, remote_code_classes, safetensors_problem

try:  # what configuration classes raise when their validators refuse them, where huggingface_hub has it
    from huggingface_hub.errors import StrictDataclassError as _ConfigValidationError
except ImportError:
    _ConfigValidationError = ValueError

__all__ = ["ModelError", "not_in_cache", "is_gguf", "load_gguf", "load_gguf_tokenizer", "load_model", "resolve_checkpoint", "tiny_causal_lm"]


class ModelError(Exception):
    """A MODEL argument that cannot be loaded; the message is one line meant for the user."""


def _is_model_type(name: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return name in CONFIG_MAPPING


def is_gguf(spec: str) -> bool:
    return spec.endswith(".gguf")


def load_gguf(path: str, *, dtype: torch.dtype = torch.float32, allow_missing_weights: bool = False, tokenizer: bool = True):
    """(model, tokenizer) of a GGUF file, dequantised into an ordinary transformers model: one that
    ``save_pretrained`` writes as safetensors (transformers refuses that for a model loaded from
    GGUF, which stays marked as quantised). Needs the ``gguf`` package. ``tokenizer=False``: the
    model alone, with None (building the tokenizer reads the whole file's vocabulary once more)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(path):
        raise ModelError(f"{path}: no such file.")
    directory, name = os.path.split(os.path.abspath(path))
    try:
        with _load_report_shown(), gguf_parsed_once():
            quantised, info = AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=name, dtype=dtype, ignore_mismatched_sizes=True, output_loading_info=True
            )
            loaded_tokenizer = load_gguf_tokenizer(path) if tokenizer else None
    except ImportError as exc:
        raise ModelError(f"reading GGUF files needs the gguf package (pip install gguf): {exc}") from None
    except (OSError, ValueError, struct.error) as exc:  # struct.error: a header cut short
        raise ModelError(gguf_problem(path, exc)) from None
    _check_loaded(path, None, info, allow_missing_weights)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(quantised.state_dict())
    return model.eval(), loaded_tokenizer


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside: each GGUF file is parsed once, and gguf's tensor-name map of an architecture built
    once. transformers parses the file's header and metadata (the whole vocabulary included) for the
    configuration, again for the weights and again for the tokenizer, and builds the name map once
    per module of the model: most of a small model's load (SmolLM2-135M: about 15 of 30 s). The
    readers are read-only views of the file; the ``gguf`` module's names are restored on the way out."""
    try:
        import gguf
    except ImportError:  # (the load says what is missing)
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str | os.PathLike, mode: str = "r"):
        key = (os.path.abspath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


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
        except Exception:  # huggingface_hub raises several types for a missing cache entry
            raise ModelError(not_in_cache(spec)) from None
    return None


def not_in_cache(spec: str, missing: str = "is not") -> str:
    """What is true of a hub id that is not (or not wholly) in the local cache: transfuse reads local
    files only, so nothing was downloaded, and how to download it."""
    subject = f"{spec!r}" if missing == "is not" else f"a file of {spec!r}"
    return (
        f"{subject} {missing} in the local Hugging Face cache; transfuse reads local files only and "
        f"downloaded nothing. Download it first with `hf download {spec}` (or `huggingface-cli download "
        f"{spec}`), or pass a local directory."
    )


def _local_files_problem(spec: str, exc: OSError) -> str:
    """A load from local files only that failed. transformers words a file missing from the cache as
    a failure to connect; no connection was tried, so that is said as what it is."""
    text = first_line(exc)
    if not os.path.isdir(spec) and "connect" in text.lower():
        return not_in_cache(spec, missing="is missing")
    return f"cannot load {spec!r} from local files: {text}"


def load_model(
    spec: str, *, dtype: torch.dtype | str = "auto", trust_remote_code: bool = False, allow_missing_weights: bool = False
) -> nn.Module:
    """A causal LM from a checkpoint directory, a hub id in the local cache (in the checkpoint's
    dtype by default, as ``from_pretrained`` loads it), a GGUF file (dequantised: float32 by
    default), or a model_type (tiny, random: float32 by default)."""
    if is_gguf(spec):
        chosen = torch.float32 if dtype == "auto" else dtype
        return load_gguf(spec, dtype=chosen, allow_missing_weights=allow_missing_weights, tokenizer=False)[0]
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ModelError(f"{spec} is a directory but has no config.json; it is not a transformers checkpoint.")
        return _from_pretrained(spec, spec, dtype, trust_remote_code, allow_missing_weights)
    if _is_model_type(spec):
        return tiny_causal_lm(spec, dtype=torch.float32 if dtype == "auto" else dtype)
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise ModelError(f"{spec}: no such directory.")
    if spec.count("/") == 1:
        return _from_pretrained(spec, resolve_checkpoint(spec), dtype, trust_remote_code, allow_missing_weights)
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


def _from_pretrained(spec: str, directory: str, dtype, trust_remote_code: bool, allow_missing: bool) -> nn.Module:
    """``spec`` (whose files are in ``directory``) as ``AutoModelForCausalLM.from_pretrained`` loads it."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    config = _config(spec, directory, trust_remote_code)
    try:
        with _load_report_shown():
            model, info = AutoModelForCausalLM.from_pretrained(
                spec,
                config=config,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                local_files_only=True,
                ignore_mismatched_sizes=True,  # reported below, with the file and the shapes
                output_loading_info=True,
            )
    except SafetensorError as exc:
        raise ModelError(safetensors_problem(directory, exc)) from None
    except OSError as exc:
        raise ModelError(_local_files_problem(spec, exc)) from None
    except ValueError as exc:
        raise ModelError(f"cannot load {spec!r}: {first_line(exc)}") from None
    _check_loaded(spec, directory, info, allow_missing)
    return model.eval()


def _config(spec: str, directory: str, trust_remote_code: bool):
    """The checkpoint's configuration, refused where it needs untrusted code, is invalid, or is
    not a causal LM's."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot be read as JSON ({first_line(exc)}).") from None
    remote = remote_code_classes(raw) if isinstance(raw, dict) else []
    if remote and not trust_remote_code:
        raise ModelError(
            f"{spec} needs its own code to load ({', '.join(remote)}, in config.json's auto_map); "
            "pass --trust-remote-code to run it."
        )
    try:
        config = AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code, local_files_only=True)
    except _ConfigValidationError as exc:
        raise ModelError(config_problem(path, exc)) from None
    except OSError as exc:
        raise ModelError(_local_files_problem(spec, exc) if not os.path.isdir(spec) else f"{path}: {first_line(exc)}") from None
    except ValueError as exc:
        raise ModelError(f"{path}: {first_line(exc)}") from None
    causal = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING.keys() or "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if not causal:
        raise ModelError(f"{spec!r} is not a causal language model: transformers has no causal-LM class for {type(config).__name__}.")
    return config


def _check_loaded(spec: str, directory: str | None, info: dict, allow_missing: bool) -> None:
    problem = loading_problem(spec, directory, info, allow_missing)
    if problem is not None:
        raise ModelError(problem)


@contextlib.contextmanager
def _load_report_shown() -> Iterator[None]:
    """transformers' load report is a warning of its ``modeling_utils`` logger: let it through
    while loading, even where transformers' verbosity silences warnings (as the CLI's does)."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
