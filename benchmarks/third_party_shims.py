"""What an older transformers modeling file needs to import on transformers 5: the names it imports,
found where they live now, or else in its own release's copy of the module.

``third_party_corpus.py`` rewrites every import a corpus file makes from outside its model's package
(``from ...modeling_utils import PreTrainedModel``) into ``corpus_import(...)``. A name is taken, in
order, from:

1. ``SUBSTITUTES``: the few names whose transformers 5 form would change what the old file does or
   fails to import (docstring decorators, which only edit docstrings, become identities);
   a model's own modules (``transformers.models.*``) always come from the old release;
2. the installed transformers' module of the same path;
3. the old release's own copy of that module (``modeling_attn_mask_utils``, removed in transformers 5,
   comes from the wheel the file came from), extracted and rewritten the same way.

No name is special to a model: the rule is the same for every file.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["SUBSTITUTES", "corpus_import", "old_module"]


def _identity_decorator(*args, **kwargs):
    return lambda function: function


def _is_torch_fx_available() -> bool:
    return True


# Names whose transformers 5 form would fail or behave differently in old files.
SUBSTITUTES = {
    "add_start_docstrings": _identity_decorator,
    "add_start_docstrings_to_model_forward": _identity_decorator,
    "replace_return_docstrings": _identity_decorator,
    "add_code_sample_docstrings": _identity_decorator,
    "is_torch_fx_available": _is_torch_fx_available,
}

# release package (corpus_v4_36_2) -> a callable that extracts an old module (dotted, under
# ``transformers``) and returns its name in the corpus, or None; set by third_party_corpus.
OLD_MODULES: dict = {}


def old_module(release: str, module: str):
    """The old release's copy of ``module`` (``transformers.modeling_attn_mask_utils``), imported."""
    name = OLD_MODULES[release](module)
    return importlib.import_module(name) if name else None


def corpus_import(caller: str, module: str, names: list[str]) -> tuple:
    """``names`` of ``module`` (absolute, as in the old release) for the corpus module ``caller``."""
    release = caller.split(".")[0]
    found = []
    for name in names:
        found.append(_one(release, module, name))
    return tuple(found)


def _one(release: str, module: str, name: str):
    if name in SUBSTITUTES:
        return SUBSTITUTES[name]
    if module.startswith("transformers.models.") and not module.startswith("transformers.models.auto"):
        return _from_old(release, module, name)  # a model's own code: always the old release's
    try:
        current = importlib.import_module(module)
    except ImportError:
        current = None
    if current is not None and hasattr(current, name):
        return getattr(current, name)
    if current is not None:
        try:  # a submodule imported by name (``from ...utils import logging``)
            return importlib.import_module(f"{module}.{name}")
        except ImportError:
            pass
    return _from_old(release, module, name)


def _from_old(release: str, module: str, name: str):
    old = old_module(release, module)
    if old is not None and hasattr(old, name):
        return getattr(old, name)
    if old is None and OLD_MODULES[release](f"{module}.{name}"):  # ``from . import modeling_x``
        return old_module(release, f"{module}.{name}")
    raise ImportError(f"cannot import {name!r} from {module!r}: neither transformers {_version()} nor the old release has it")


def _version() -> str:
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "__version__", "?")
