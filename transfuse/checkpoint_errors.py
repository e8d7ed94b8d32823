"""What is wrong with a checkpoint that does not load, said in one line that names the file.

The CLI shows these instead of transformers' tracebacks: a safetensors file that is truncated or
corrupt (found by opening each one), a configuration its class refuses, a weight whose shape is
not the model's, weights the checkpoint lacks, a GGUF file that cannot be read, and a
checkpoint that needs its own code. Each function returns the message; the caller raises.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

__all__ = [
    "config_problem",
    "first_line",
    "gguf_problem",
    "loading_problem",
    "remote_code_classes",
    "safetensors_problem",
]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _safetensors_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))


def safetensors_problem(directory: str, exc: BaseException) -> str:
    """The first safetensors file of ``directory`` that cannot be opened, and why (``exc``, the
    error loading raised, where every file opens)."""
    from safetensors import SafetensorError, safe_open

    for path in _safetensors_files(directory):
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:
            return f"{path}: the safetensors file is truncated or corrupt ({first_line(error)})."
    return f"{directory}: its weights cannot be read ({first_line(exc)})."


def config_problem(path: str, exc: BaseException) -> str:
    """``exc`` from reading the configuration at ``path``: its validators' own sentence where they
    gave one (the innermost line of a validation error)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    detail = lines[-1] if lines else type(exc).__name__
    for prefix in ("ValueError: ", "TypeError: "):
        detail = detail.removeprefix(prefix)
    return f"{path}: the configuration is invalid: {detail}"


def gguf_problem(path: str, exc: BaseException) -> str:
    return f"{path}: cannot read it as a GGUF causal LM; the file is truncated or corrupt, or not GGUF ({first_line(exc)})."


def remote_code_classes(config: dict) -> list[str]:
    """The classes of a config.json's ``auto_map`` that transformers would take from the
    checkpoint's own code: those of a model type it has no classes of its own for."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto_map = config.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        return []
    model_type = config.get("model_type")
    wanted = []
    for auto, known in (("AutoConfig", CONFIG_MAPPING_NAMES), ("AutoModelForCausalLM", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        if auto in auto_map and model_type not in known:
            wanted.append(str(auto_map[auto]))
    return wanted


def _file_holding(directory: str, key: str) -> str:
    """The safetensors file of ``directory`` that holds tensor ``key`` (the directory if none does)."""
    from safetensors import safe_open

    for path in _safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            if key in f.keys():
                return path
    return directory


def _mismatch(entry) -> tuple[str, str]:
    """(key, what differs) of one ``mismatched_keys`` entry: (key, checkpoint shape, model shape),
    or the key alone."""
    if isinstance(entry, tuple) and len(entry) == 3:
        key, theirs, ours = entry
        return key, f"has shape {tuple(theirs)} in the checkpoint; the model's is {tuple(ours)}"
    return str(entry), "has another shape in the checkpoint than in the model"


def loading_problem(spec: str, directory: str | None, info: dict, allow_missing: bool) -> str | None:
    """What transformers' loading info (``output_loading_info=True``) shows to be wrong: a weight
    whose shape differs, or, unless ``allow_missing``, weights the checkpoint lacks (which would
    start random). None where nothing is."""
    mismatched = sorted(info.get("mismatched_keys") or (), key=str)
    if mismatched:
        key, what = _mismatch(mismatched[0])
        where = _file_holding(directory, key) if directory else spec
        more = f" ({len(mismatched) - 1} more weights differ too)" if len(mismatched) > 1 else ""
        return f"{where}: {key} {what}{more}."
    missing = sorted(info.get("missing_keys") or ())
    if missing and not allow_missing:
        return (
            f"{spec}: the checkpoint has no weights for {len(missing)} of the model's tensors "
            f"({_some(missing)}), which would start random; pass --allow-missing-weights to load it anyway."
        )
    return None


def _some(names: Iterable[str], shown: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
