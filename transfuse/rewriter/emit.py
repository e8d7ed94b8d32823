"""Emitted modeling files: a rewritten model as source a person can read, diff and load.

For each modeling file that holds a fused class, the emitted copy is the original file
(libcst: formatting and comments kept) with:

* each rewritten method replaced by its edited version (the same edit the runtime
  rewrite compiled), and each replaced module class given a forward that calls the same
  fused op (an RMSNorm: ``rms_norm``; a mixture-of-experts block: ``moe_block`` with its plan
  as a class attribute), so the emitted model and the runtime rewrite compute the same numbers;
* ``_transfuse_merges = (Merge(...), ...)`` on each class whose children are merged; the
  original ``__init__`` is kept, so checkpoints load with their own keys, and the file's
  ``PreTrainedModel`` base merges them once ``from_pretrained`` (or ``_from_config``) has
  built the model;
* relative imports made absolute (or pointed at a sibling emitted file, as are imports of a name an
  emitted file defines), what it needs from transfuse imported from the runtime beside it
  (``transfuse_runtime.py``, ``emit_runtime``), and a header that says what generated it.

A checkpoint's own code (``auto_map``) is emitted the same way, with the modules of it that those
files import, so that the directory never reads the loader's modules cache (``emit_own_code``).

``emit`` writes those files, the runtime, ``config.json`` with ``auto_map`` pointing at them, and
the weights, in the model's dtype, all or nothing (``emit_dir``: staged beside the output, moved in
at the end, never over the checkpoint it copies or links). The weights are in the model's own
layout wherever transformers would convert a checkpoint on load (MoE experts packed from
per-expert tensors): it converts for its own classes only, and the emitted ones are custom code.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

import libcst as cst
import libcst.matchers as m
from torch import nn

from ..version import __version__
from .apply import REPLACED_ATTR, REWRITTEN_ATTR
from .emit_dir import EmitError, check_destination, link_target, write_directory
from .emit_own_code import absolute_module, is_own_code, own_modules, redirected
from .emit_runtime import RUNTIME_MODULE, runtime_source
from .source import EditContext, MethodRewrite, _identifiers, _parse_file, method_source
from .syntax import comment_line
from .tracer import unwrapped_forward

__all__ = ["EmitError", "EmitResult", "emit", "emitted_replacement", "emitted_sources"]

# Files of a checkpoint directory that emit copies or links besides the weights.
_SKIPPED_FILES = {"config.json"}


@dataclass
class EmitResult:
    out_dir: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class _FileEdits:
    filename: str
    module_name: str
    methods: list[MethodRewrite] = field(default_factory=list)
    declarations: dict[str, tuple] = field(default_factory=dict)  # class name -> Merge objects

    def imports(self, loading_hook: bool) -> dict[str, tuple[str, str]]:
        """What the file's code takes from transfuse: alias -> (module, name)."""
        merged: dict[str, tuple[str, str]] = {}
        for rewrite in self.methods:
            merged.update(rewrite.imports)
        if self.declarations:
            merged.setdefault("Merge", ("transfuse.rewriter.weights", "Merge"))
        if loading_hook:
            merged.setdefault("merge_declared", ("transfuse.rewriter.weights", "merge_declared"))
        return merged


def _class_file(cls: type) -> tuple[str, str]:
    module = sys.modules[cls.__module__]
    return module.__file__, module.__name__


def _uniform(model: nn.Module, cls: type, key) -> bool:
    """Whether every instance of ``cls`` in the model was fused the same way (key(instance))."""
    values = {key(m) for m in model.modules() if type(m) is cls}
    return len(values) == 1 and None not in values


def _emitted_form(rewrite: MethodRewrite | None) -> tuple | None:
    """What an emitted file writes for ``rewrite``: instances traced apart (each with its own
    specialisation: a sliding layer and a full one) whose rewrites are other objects with the same
    method, declarations and imports are fused alike."""
    if rewrite is None:
        return None
    code = cst.Module(body=[rewrite.edited]).code
    written = (repr(rewrite.declarations), repr(sorted(rewrite.imports.items())), repr(rewrite.preceding))
    return (rewrite.defining_class, code, *written)


def _collect(model: nn.Module, notes: list[str]) -> dict[str, _FileEdits]:
    files: dict[str, _FileEdits] = {}

    def edits_for(cls: type) -> _FileEdits:
        filename, module_name = _class_file(cls)
        return files.setdefault(filename, _FileEdits(filename, module_name))

    rewrites = {type(mod): mod.__dict__[REWRITTEN_ATTR] for mod in model.modules() if REWRITTEN_ATTR in mod.__dict__}
    for cls, rewrite in rewrites.items():
        if not _uniform(model, cls, lambda mod: _emitted_form(mod.__dict__.get(REWRITTEN_ATTR))):
            notes.append(f"{cls.__name__} is emitted unchanged: not all its instances were fused alike.")
            continue
        target = edits_for(rewrite.defining_class)
        target.methods.append(rewrite)
        edits_for(cls).declarations[cls.__name__] = rewrite.declarations
    for cls, (fuser, found) in model.__dict__.get(REPLACED_ATTR, {}).items():
        if any(type(mod) is cls for mod in model.modules()):
            notes.append(f"{cls.__name__} is emitted unchanged: some of its instances were not replaced.")
            continue
        rewrite = emitted_replacement(cls, fuser, found)
        if rewrite is None:
            notes.append(f"{cls.__name__} is emitted unchanged: its {fuser.kind} fusion has no emitted form for it.")
            continue
        edits_for(cls).methods.append(rewrite)
    edits_for(type(model))  # the model's own file carries the loading hook
    return files


def emitted_replacement(cls: type, fuser, found) -> MethodRewrite | None:
    """The forward an emitted file gives a class whose instances the rewrite replaced (calling the
    same fused op), as a rewrite of its source; None where the fusion has no emitted form."""
    source = method_source(unwrapped_forward(cls)) if found is not None else None
    if source is None:
        return None
    context = EditContext(cls, source, _identifiers(source.node))
    forward = fuser.emitted_forward(found, context)
    if forward is None:
        return None
    return MethodRewrite(cls, source, forward, context.imports, (fuser.kind,), preceding=tuple(context.class_statements))


class _FileTransformer(cst.CSTTransformer):
    """Method replacements, merge declarations, the loading hook, and import fixes for one file."""

    def __init__(self, edits: _FileEdits, parsed, emitted_modules: dict[str, str], base_classes: set[str]):
        # Methods are found by name and line in this parse of the file (not by node identity,
        # which a re-parse would change).
        self.methods = {id(parsed.functions[(r.original.node.name.value, r.original.line())]): r.replacement for r in edits.methods}
        self.edits = edits
        self.emitted_modules = emitted_modules  # absolute module name -> emitted file stem
        self.base_classes = base_classes

    def leave_FunctionDef(self, original_node, updated_node):
        return self.methods.get(id(original_node), updated_node)

    def leave_ClassDef(self, original_node, updated_node):
        name = original_node.name.value
        body = list(updated_node.body.body)
        declarations = self.edits.declarations.get(name)
        if declarations:
            merges = ", ".join(repr(d) for d in declarations)
            line = cst.parse_statement(f"_transfuse_merges = ({merges},)").with_changes(
                leading_lines=[comment_line("transfuse: children merged once the model is built (see merge_declared)")]
            )
            at = 1 if body and m.matches(body[0], m.SimpleStatementLine([m.Expr(m.SimpleString())])) else 0
            if at < len(body) and not body[at].leading_lines:
                body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            body.insert(at, line)
        if name in self.base_classes:
            body.extend(_loading_hooks())
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def leave_ImportFrom(self, original_node, updated_node):
        if original_node.relative:
            absolute = absolute_module(self.edits.module_name, original_node)
        elif original_node.module is not None:
            absolute = cst.Module(body=[]).code_for_node(original_node.module)
        else:
            return updated_node
        sibling = self.emitted_modules.get(absolute)
        if sibling is not None:
            return updated_node.with_changes(relative=[cst.Dot()], module=cst.Name(sibling))
        if original_node.relative and is_own_code(absolute):
            if original_node.module is None:  # ``from . import x``: siblings, emitted beside it
                return updated_node
            raise EmitError(
                f"{self.edits.module_name} imports {absolute}, which was never loaded, so it cannot be emitted "
                "beside it; load the model so that its code imports it, then emit."
            )
        if original_node.relative:
            return updated_node.with_changes(relative=[], module=cst.parse_expression(absolute))
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        # ``from x import A`` where an emitted file defines A: from that file (a subclass of A emitted fused).
        if len(updated_node.body) != 1 or not m.matches(updated_node.body[0], m.ImportFrom(relative=[])):
            return updated_node
        absolute = cst.Module(body=[]).code_for_node(updated_node.body[0].module)
        lines = redirected(updated_node, absolute, self.emitted_modules)
        return updated_node if lines is None else cst.FlattenSentinel(lines)


def _loading_hooks() -> list[cst.BaseStatement]:
    code = '''
@classmethod
def from_pretrained(cls, *args, **kwargs):
    # transfuse: load the checkpoint as it is, then merge the projections classes declare
    return merge_declared(super().from_pretrained(*args, **kwargs))

@classmethod
def _from_config(cls, config, **kwargs):
    return merge_declared(super()._from_config(config, **kwargs))
'''
    hooks = list(cst.parse_module(code).body)
    return [h.with_changes(leading_lines=[cst.EmptyLine(indent=False)]) for h in hooks]


def _pretrained_bases(module_name: str) -> set[str]:
    """Classes of the module that derive directly from transformers' PreTrainedModel."""
    from transformers import PreTrainedModel

    module = sys.modules[module_name]
    return {
        name
        for name, value in vars(module).items()
        if isinstance(value, type) and value.__module__ == module_name and PreTrainedModel in value.__bases__
    }


def _header(edits: _FileEdits) -> list[cst.EmptyLine]:
    import transformers

    origin = "the checkpoint's own code" if is_own_code(edits.module_name) else edits.module_name
    lines = [
        f"This file was generated by transfuse {__version__} from {origin}",
        f"({os.path.basename(edits.filename)}, transformers {transformers.__version__}). It is that file with fused layers,",
        f"which {RUNTIME_MODULE}.py beside it defines: do not edit it; regenerate it with `transfuse emit`.",
    ]
    return [comment_line(line) for line in lines] + [cst.EmptyLine()]


def _with_imports(module: cst.Module, imports: dict[str, tuple[str, str]]) -> cst.Module:
    """The module importing ``imports`` (alias -> (transfuse module, name)) from the runtime beside it."""
    if not imports:
        return module
    names = sorted(name if alias == name else f"{name} as {alias}" for alias, (_, name) in imports.items())
    statements = [cst.parse_statement(f"from .{RUNTIME_MODULE} import {', '.join(names)}")]
    body = list(module.body)
    last_import = max(
        (i for i, s in enumerate(body) if m.matches(s, m.SimpleStatementLine([m.Import() | m.ImportFrom()]))),
        default=-1,
    )
    body[last_import + 1 : last_import + 1] = statements
    return module.with_changes(body=body)


def _stem(filename: str) -> str:
    return os.path.splitext(os.path.basename(filename))[0]


def _same_text(a: str, b: str) -> bool:
    with open(a, "rb") as first, open(b, "rb") as second:
        return first.read() == second.read()


def emitted_sources(model: nn.Module) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The emitted files' text by file name (the runtime's included), config.json's ``auto_map``, and
    notes."""
    notes: list[str] = []
    files = _collect(model, notes)
    config_module = type(model.config).__module__
    stems = {e.module_name: _stem(e.filename) for e in files.values()}
    for name in own_modules(list(stems), config_module):
        filename = sys.modules[name].__file__
        # transformers may load one file of a checkpoint's code twice, under two hashes (the
        # configuration alone, and with the modeling file): one file, emitted once.
        twin = next((e for e in files.values() if _stem(e.filename) == _stem(filename) and _same_text(e.filename, filename)), None)
        if twin is None or not is_own_code(twin.module_name):
            files[filename] = _FileEdits(filename, name)
        stems[name] = _stem(filename)
    if len(set(map(_stem, files))) != len(files) or RUNTIME_MODULE in stems.values():
        raise EmitError(f"Two files to emit share a name ({sorted(map(_stem, files))}); cannot emit them side by side.")
    texts, roots = {}, set()
    for edits in files.values():
        parsed = _parse_file(edits.filename)
        if parsed is None:
            raise EmitError(f"The source of {edits.module_name} ({edits.filename}) cannot be read.")
        bases = _pretrained_bases(edits.module_name)
        tree = parsed.module.visit(_FileTransformer(edits, parsed, stems, bases))
        imports = edits.imports(loading_hook=bool(bases))
        roots |= set(imports.values())
        tree = _with_imports(tree, imports)
        tree = tree.with_changes(header=_header(edits) + list(tree.header))
        texts[f"{stems[edits.module_name]}.py"] = tree.code
    texts[f"{RUNTIME_MODULE}.py"] = runtime_source(roots)
    auto_map = {"AutoModelForCausalLM": f"{stems[type(model).__module__]}.{type(model).__name__}"}
    if is_own_code(config_module):
        auto_map = {"AutoConfig": f"{stems[config_module]}.{type(model.config).__name__}", **auto_map}
    own_files = [f"{stems[e.module_name]}.py" for e in files.values() if is_own_code(e.module_name)]
    if own_files:
        notes.append(
            f"the checkpoint's own code is emitted into the directory, rewritten where fused: {', '.join(own_files)} "
            f"(config.json's auto_map names {', '.join(auto_map.values())} there); loading it reads nothing from the modules cache."
        )
    return texts, auto_map, notes


# Weight files of a checkpoint directory (not copied where emit saves the weights itself).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")


def _converted_on_load(model: nn.Module) -> bool:
    """Whether transformers converts this model's checkpoints when it loads them (Mixtral's per-expert
    weights into packed tensors, say). It applies no such conversion to custom code, which an
    emitted model is, so those weights must be written in the model's own layout."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers before the conversion mappings
        return False
    return bool(get_model_conversion_mapping(model, add_legacy=False))


def _save_weights(model: nn.Module, staging: str) -> None:
    """``save_pretrained`` in the model's own layout: the keys of its state_dict, which the emitted
    classes load without conversion (the original format would be converted back only for the stock
    classes)."""
    import inspect

    own_layout = {"save_original_format": False}
    parameters = inspect.signature(model.save_pretrained).parameters
    model.save_pretrained(staging, **{k: v for k, v in own_layout.items() if k in parameters})


def _copy_checkpoint_files(
    source_dir: str, out: str, staging: str, link: bool, skip: Iterable[str], weights: bool = True
) -> list[str]:
    written = []
    for name in sorted(os.listdir(source_dir)):
        path = os.path.join(source_dir, name)
        if name in skip or (not weights and name.endswith(_WEIGHT_SUFFIXES)) or name.endswith(".py") or not os.path.isfile(path):
            continue
        target = os.path.join(staging, name)
        if link:
            os.symlink(link_target(path, out), target)
        else:
            shutil.copy2(path, target)
        written.append(name)
    return written


def emit(
    model: nn.Module,
    out_dir: str,
    *,
    checkpoint_dir: str | None = None,
    force: bool = False,
    link: bool = False,
    also: Callable[[str], list[str]] | None = None,
) -> EmitResult:
    """Write the rewritten ``model`` as a loadable directory (see the module docstring).

    checkpoint_dir: the directory the model was loaded from; its weights and tokenizer files
        are copied (or symbolically linked with ``link``). Without it the model's own weights
        are saved (with their original keys). The output may not be, hold or lie inside it.
    also: writes more files into the directory being made (given as its argument) and returns
        their names.
    """
    out_dir = os.path.abspath(out_dir)
    notes = check_destination(out_dir, force=force, source=checkpoint_dir)
    texts, auto_map, source_notes = emitted_sources(model)
    result = EmitResult(out_dir, notes=notes + source_notes)

    def fill(staging: str) -> None:
        _write_files(model, staging, texts, auto_map, checkpoint_dir, link, result)
        if also is not None:
            result.files += also(staging)

    write_directory(out_dir, fill, force=force)
    return result


def _write_files(model, staging, texts, auto_map, checkpoint_dir, link, result: EmitResult) -> None:
    result.files += list(texts)
    converted = _converted_on_load(model)
    if checkpoint_dir is not None:
        skipped = _SKIPPED_FILES | set(texts)
        result.files += _copy_checkpoint_files(checkpoint_dir, result.out_dir, staging, link, skipped, weights=not converted)
        if converted:
            result.notes.append(
                f"the weights are saved in the model's own layout, not copied: transformers converts "
                f"{type(model).__name__} checkpoints on load, and does not for custom code."
            )
    if checkpoint_dir is None or converted:
        _save_weights(model, staging)
        result.files += [n for n in sorted(os.listdir(staging)) if n not in result.files and n != "config.json"]
    _save_config(model, staging, auto_map)
    result.files.append("config.json")
    # Last: saving the model or config of a checkpoint's own code copies that code from the modules
    # cache (transformers' ``custom_object_save``); the emitted files take its place.
    for name, text in texts.items():
        with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
            f.write(text)


def _save_config(model: nn.Module, staging: str, auto_map: dict[str, str]) -> None:
    """The model's config (its dtype the model's) with ``auto_map`` pointing at the emitted classes."""
    config = model.config
    previous = getattr(config, "auto_map", None)
    config.auto_map = dict(auto_map)
    try:
        config.save_pretrained(staging)
    finally:
        if previous is None:
            del config.auto_map
        else:
            config.auto_map = previous
