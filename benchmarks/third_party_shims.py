"""What an older transformers modeling file needs to import on transformers 5: the names it imports,
found where they live now, or else in its own release's copy of the module.

``third_party_corpus.py`` rewrites every import a corpus file makes from outside its model's package
(``from ...modeling_utils import PreTrainedModel``) into ``corpus_import(...)``. A name is taken, in
order, from:

1. ``SUBSTITUTES``: the few names whose transformers 5 form would change what the old file does or
   fails to import (docstring decorators, which only edit docstrings, become identities);
   a model's own modules (``transformers.models.*``) and the names of ``OLD_FIRST`` come from the old
   release;
2. the installed transformers' module of the same path;
3. the old release's own copy of that module (``modeling_attn_mask_utils``, removed in transformers 5,
   comes from the wheel the file came from), extracted and rewritten the same way;
4. else a stand-in class of that name that raises when it is built or called (``OnnxConfig``, whose
   package no longer imports: configuration files subclass it, models never use it).

No name is special to a model: the rule is the same for every file.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["SUBSTITUTES", "corpus_import", "old_config_defaults", "old_module"]


def old_config_defaults(release: str) -> dict:
    """What the old release's ``PretrainedConfig`` set on every configuration (and the old files
    read), less the generation settings transformers 5 keeps apart (only those whose default is None)."""
    from transformers import GenerationConfig

    old = old_module(release, "transformers.configuration_utils")
    generation = GenerationConfig()
    defaults = vars(old.PretrainedConfig()) if old is not None else {}
    return {
        k: v for k, v in defaults.items() if not k.startswith("_") and (v is None or not hasattr(generation, k))
    }


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

# Names whose transformers 5 value lacks what the old files look up in it: the old release's.
OLD_FIRST = {
    "ROPE_INIT_FUNCTIONS",  # transformers 5 computes the default rotary frequencies elsewhere: no "default"
}

# release package (corpus_v4_36_2) -> a callable that extracts an old module (dotted, under
# ``transformers``) and returns its name in the corpus, or None; set by third_party_corpus.
OLD_MODULES: dict = {}


def old_module(release: str, module: str):
    """The old release's copy of ``module`` (``transformers.modeling_attn_mask_utils``), imported;
    None where it has none or it does not import."""
    name = OLD_MODULES[release](module)
    if not name:
        return None
    if module.startswith("transformers.models."):
        return importlib.import_module(name)  # a model's own code: its errors are the entry's
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - an old helper module that needs what transformers 5 removed
        return None


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
    if name in OLD_FIRST:
        return _from_old(release, module, name)
    try:
        current = importlib.import_module(module)
    except ImportError:
        current = None
    try:
        return getattr(current, name)
    except Exception:  # noqa: BLE001 - absent, or a lazy attribute whose own import fails now
        pass
    if current is not None:
        try:  # a submodule imported by name (``from ...utils import logging``)
            return importlib.import_module(f"{module}.{name}")
        except ImportError:
            pass
    return _from_old(release, module, name)


def _from_old(release: str, module: str, name: str):
    old = old_module(release, module)
    if old is not None:
        try:
            return getattr(old, name)
        except Exception:  # noqa: BLE001 - absent, or a lazy attribute whose own import fails now
            pass
    if OLD_MODULES[release](f"{module}.{name}"):  # ``from . import modeling_x``
        return old_module(release, f"{module}.{name}")
    return _stand_in(module, name)


def _stand_in(module: str, name: str) -> type:
    message = f"{module}.{name} is in neither transformers {_version()} nor the old release"

    class Missing:
        def __init__(self, *args, **kwargs):
            raise ImportError(message)

        def __init_subclass__(cls, **kwargs):  # a subclass is fine until built
            super().__init_subclass__()

    Missing.__name__ = Missing.__qualname__ = name
    return Missing


def _version() -> str:
    transformers = sys.modules.get("transformers")
    return getattr(transformers, "__version__", "?")
