"""What an older transformers modeling file needs to import on transformers 5: the names it imports,
found where they live now, or else in its own release's copy of the module.

``third_party_corpus.py`` rewrites every import a corpus file makes from outside its model's package
(``from ...modeling_utils import PreTrainedModel``) into ``corpus_import(...)``. A name is taken, in
order, from:

1. ``SUBSTITUTES``: the few names whose transformers 5 form would change what the old file does or
   fails to import (docstring decorators, which only edit docstrings, become identities);
   a model's own modules (``transformers.models.*``) and the names of ``OLD_FIRST`` come from the old
   release;
2. ``ADAPTED``: two base classes whose transformers 5 form lacks what the old files' subclasses
   rely on are given as a subclass of the installed class that supplies it (see ``_adapt_model``
   and ``_adapt_output``);
3. the installed transformers' module of the same path;
4. the old release's own copy of that module (``modeling_attn_mask_utils``, removed in transformers 5,
   comes from the wheel the file came from), extracted and rewritten the same way;
5. else a stand-in class of that name that raises when it is built or called (``OnnxConfig``, whose
   package no longer imports: configuration files subclass it, models never use it).

No name is special to a model: the rule is the same for every file.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

import torch

__all__ = ["ADAPTED", "SUBSTITUTES", "corpus_import", "old_config_defaults", "old_module"]


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

# Mask helpers of the old release's ``ModuleUtilsMixin`` (transformers 4.x), which the old files'
# models call on themselves and transformers 5 removed; written here after the 4.45 definitions.
# The old release's other methods transformers 5 lacks (memory hooks, FLOP estimates,
# BetterTransformer, ``_tie_or_clone_weights``) are not supplied: no corpus model calls them while it
# is built and run, and one that did would fail with the AttributeError its row shows.


def _invert_attention_mask(self, mask):
    """A 2-D or 3-D mask of ones (attend) and zeros (masked) as an additive mask of ``self.dtype``."""
    mask = mask[:, None, :, :] if mask.dim() == 3 else mask[:, None, None, :]
    mask = mask.to(dtype=self.dtype)
    return (1.0 - mask) * torch.finfo(self.dtype).min


def _create_extended_attention_mask_for_decoder(input_shape, attention_mask, device=None):
    """The causal mask times the padding mask, ``[batch, 1, seq, past + seq]`` (ones for the past)."""
    device = attention_mask.device if device is None else device
    batch_size, seq_length = input_shape
    seq_ids = torch.arange(seq_length, device=device)
    causal = (seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]).to(attention_mask.dtype)
    prefix = attention_mask.shape[1] - causal.shape[1]
    if prefix > 0:
        ones = torch.ones((batch_size, seq_length, prefix), device=device, dtype=causal.dtype)
        causal = torch.cat([ones, causal], dim=-1)
    return causal[:, None, :, :] * attention_mask[:, None, None, :]


def _get_extended_attention_mask(self, attention_mask, input_shape, device=None, dtype=None):
    """The additive mask of ``attention_mask`` (causal too where the config is a decoder's)."""
    dtype = self.dtype if dtype is None else dtype
    if attention_mask.dim() == 3:
        extended = attention_mask[:, None, :, :]
    elif attention_mask.dim() == 2 and self.config.is_decoder:
        extended = _create_extended_attention_mask_for_decoder(input_shape, attention_mask, device)
    elif attention_mask.dim() == 2:
        extended = attention_mask[:, None, None, :]
    else:
        raise ValueError(f"Wrong shape for input_ids (shape {input_shape}) or attention_mask (shape {attention_mask.shape})")
    extended = extended.to(dtype=dtype)
    return (1.0 - extended) * torch.finfo(dtype).min


def _get_head_mask(self, head_mask, num_hidden_layers, is_attention_chunked=False):
    """One ``None`` per layer, or the head mask as ``[layers, batch, heads, seq, seq]`` of ``self.dtype``."""
    if head_mask is None:
        return [None] * num_hidden_layers
    head_mask = self._convert_head_mask_to_5d(head_mask, num_hidden_layers)
    return head_mask.unsqueeze(-1) if is_attention_chunked is True else head_mask


def _convert_head_mask_to_5d(self, head_mask, num_hidden_layers):
    if head_mask.dim() == 1:  # one mask for every layer
        head_mask = head_mask[None, None, :, None, None].expand(num_hidden_layers, -1, -1, -1, -1)
    elif head_mask.dim() == 2:  # one per layer
        head_mask = head_mask[:, None, :, None, None]
    if head_mask.dim() != 5:
        raise ValueError(f"head_mask.dim != 5, instead {head_mask.dim()}")
    return head_mask.to(dtype=self.dtype)


OLD_MODEL_METHODS = {
    "invert_attention_mask": _invert_attention_mask,
    "create_extended_attention_mask_for_decoder": staticmethod(_create_extended_attention_mask_for_decoder),
    "get_extended_attention_mask": _get_extended_attention_mask,
    "get_head_mask": _get_head_mask,
    "_convert_head_mask_to_5d": _convert_head_mask_to_5d,
}


def _init_weights(self):
    """The old release's ``init_weights``, which old ``__init__``s call where newer ones call
    ``post_init`` (in the old release ``post_init`` was ``init_weights`` and a gradient-checkpointing
    flag): before ``post_init`` has run, ``post_init``; after, the installed ``init_weights``."""
    if "all_tied_weights_keys" not in vars(self):
        return self.post_init()
    return super(_ADAPTED_CLASSES["PreTrainedModel"], self).init_weights()


def _old_tie_weights(method):
    """An old ``tie_weights(self)`` that transformers 5 calls with ``missing_keys`` and
    ``recompute_mapping``: called as the old release called it, without them."""

    @functools.wraps(method)
    def tie_weights(self, missing_keys=None, recompute_mapping=True):
        return method(self)

    return tie_weights


def _takes(method, name: str) -> bool:
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _adapt_model(installed: type) -> type:
    """``PreTrainedModel`` as the old files' models expect it: the installed class, with the old
    release's mask helpers (``OLD_MODEL_METHODS``) where the installed one lacks them, its
    ``init_weights`` (see ``_init_weights``), and a subclass's own ``tie_weights`` written for the old
    signature accepting the new arguments."""

    def __init_subclass__(cls, **kwargs):
        super(adapted, cls).__init_subclass__(**kwargs)
        tie = cls.__dict__.get("tie_weights")
        if tie is not None and not _takes(tie, "recompute_mapping"):
            cls.tie_weights = _old_tie_weights(tie)

    methods = {k: v for k, v in OLD_MODEL_METHODS.items() if not hasattr(installed, k)}
    namespace = {**methods, "init_weights": _init_weights, "__init_subclass__": classmethod(__init_subclass__)}
    adapted = type(installed.__name__, (installed,), {"__module__": __name__, **namespace})
    return adapted


def _adapt_output(installed: type) -> type:
    """``ModelOutput`` as the old files' outputs expect it. transformers 5 renames the keyword
    arguments ``past_key_values`` and ``cache_params`` to ``cache`` in every output's ``__init__`` (its
    metaclass wraps the dataclass's) and reads those names as ``cache``; an old output class that
    declares a field of either name gets ``cache`` passed and fails. Here such a field is declared as
    ``cache``, in its place, before the dataclass is made: the old names still read it."""

    def __init_subclass__(cls, **kwargs):
        super(adapted, cls).__init_subclass__(**kwargs)
        annotations = cls.__dict__.get("__annotations__", {})
        old = [name for name in ("past_key_values", "cache_params") if name in annotations]
        if not old or "cache" in annotations:
            return
        renamed = {("cache" if k == old[0] else k): v for k, v in annotations.items()}
        annotations.clear()
        annotations.update(renamed)
        if old[0] in cls.__dict__:  # the field's default, where the property of ``installed`` is seen again
            setattr(cls, "cache", cls.__dict__[old[0]])
            delattr(cls, old[0])

    adapted = type(installed.__name__, (installed,), {"__module__": __name__, "__init_subclass__": classmethod(__init_subclass__)})
    return adapted


# Name -> a function making the old files' form of the installed class of that name.
ADAPTED = {"PreTrainedModel": _adapt_model, "ModelOutput": _adapt_output}
_ADAPTED_CLASSES: dict[str, type] = {}


def _adapted(name: str, installed):
    """The adapted form of ``installed`` (made once per name; other values as they are)."""
    if name not in ADAPTED or not isinstance(installed, type):
        return installed
    if name not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[name] = ADAPTED[name](installed)
    return _ADAPTED_CLASSES[name]


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
        return _adapted(name, getattr(current, name))
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
