"""transfuse: rewrite Hugging Face transformers models into fused, platform-dispatched kernels.

    import transfuse
    model = transfuse.rewrite(model)      # in place; returns the same object
    print(transfuse.report(model))        # what was fused, what was refused and why

    model = transfuse.AutoModelForCausalLM.from_pretrained(path_or_id, dtype=torch.bfloat16)
    model = transfuse.compile(model)      # inference: attention outside the graph, CUDA graphs

    transfuse.decode_steps(model)         # a rewritten model's generate: decode steps as CUDA graphs

``import transfuse`` imports neither torch nor transformers: the names above are loaded together at
the first use of any of them (``load``), so that ``transfuse --help`` answers at once.
"""

from __future__ import annotations

from typing import Any

from .version import __version__

__all__ = [
    "AutoModelForCausalLM",
    "ExampleInputsError",
    "FusionRecord",
    "RewriteError",
    "RewriteReport",
    "SkipRecord",
    "__version__",
    "compile",
    "decode_steps",
    "diff",
    "from_pretrained",
    "is_rewritten",
    "report",
    "rewrite",
]

_LOADED = False


def load() -> None:
    """Import the package's public names (and torch and transformers with them), and register the
    integrations' hooks; the first use of any public name does this."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from importlib import import_module

    import_module(".integrations", __name__)  # registers the integrations' hooks; imports none of their libraries
    api = import_module(".api", __name__)
    auto = import_module(".auto", __name__)
    compiled = import_module(".compile", __name__)  # a callable module: transfuse.compile(model)
    records = import_module(".rewriter.report", __name__)
    globals().update(
        compile=compiled,
        decode_steps=compiled.decode_steps,
        AutoModelForCausalLM=auto.AutoModelForCausalLM,
        from_pretrained=auto.from_pretrained,
        **{name: getattr(api, name) for name in ("ExampleInputsError", "RewriteError", "diff", "is_rewritten", "report", "rewrite")},
        **{name: getattr(records, name) for name in ("FusionRecord", "RewriteReport", "SkipRecord")},
    )


def __getattr__(name: str) -> Any:
    if name in __all__ and not _LOADED:
        load()
        return globals()[name]
    if not name.startswith("_"):  # a submodule not imported yet: ``transfuse.fusers.default_kinds()``
        from importlib import import_module, util

        if util.find_spec(f"{__name__}.{name}") is not None:  # (as ``from transfuse import fusers`` does)
            return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'transfuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
