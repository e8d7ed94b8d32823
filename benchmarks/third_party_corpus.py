"""A corpus of modeling code nobody here wrote: every causal-LM modeling file of two older
transformers releases, loaded as remote code against the installed transformers.

    python benchmarks/third_party_corpus.py --cache DIR            # fetch, extract, list the entries
    python benchmarks/third_party_corpus.py --cache DIR --load llama@4.36.2   # build one tiny model

The rule, fixed before any file is read: for each release in ``RELEASES``, every
``transformers/models/<type>/modeling_<name>.py`` of its wheel (not the TensorFlow or Flax ones)
that defines a class whose name ends with ``ForCausalLM`` is an entry, one per such class. The wheel
is fetched with ``pip download --no-deps`` into the cache directory, never installed; nothing it
holds is committed. ``EXCLUDED`` lists what the rule's scan finds but is not a model.

Loading changes the files in one way only: every import from the rest of transformers
(``from ...modeling_utils import PreTrainedModel``, ``from .configuration_llama import LlamaConfig``)
becomes a call of ``third_party_shims.corpus_import``, which takes another model's module from the
same old release and any other name from the installed transformers (``PreTrainedModel`` and
``ModelOutput`` as subclasses that give the old files' models and outputs what transformers 5
removed), else from the old release's own copy of that module (see that file). Two class attributes transformers 5 reads differently are
reset: ``_tied_weights_keys`` as a list, cleared on the model classes (the weights are not tied),
and ``rope_scaling`` on the config classes, a plain attribute again (None: no scaling); a model
class gains ``GenerationMixin`` as a base, as transformers 5 gives remote code loaded through an
auto class. Attributes the old release's ``PretrainedConfig`` set on every configuration (``pad_token_id``,
``is_decoder``) are given its defaults where transformers 5's configuration lacks them.

A tiny configuration is the config class's defaults with the sizes of ``TINY`` set wherever the
class has that attribute or its ``__init__`` takes that argument (a size kept under another name,
``vocab_size`` behind a property) (hidden size 64, 2 layers, vocabulary 128, 4 experts).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RELEASES = ("4.36.2", "4.45.2")
DEFAULT_CACHE = Path.home() / ".cache" / "transfuse-third-party-corpus"

# Found by the rule's scan, but not a model.
EXCLUDED = {
    "auto": "the auto classes: a registry of the other types, not a model",
}

# Sizes set wherever the config class has the attribute.
TINY = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim_model": 64, "embed_dim": 64, "word_embed_proj_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "dim_head": 16, "kv_channels": 16,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "decoder_ffn_dim": 128, "dim_ff": 128,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "rotary_dim": 8, "attention_hidden_size": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
    "rope_scaling": None, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
    "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 8, "state_size": 8, "lru_width": 64,
    "attention_window_size": 16, "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    "prompt_length": 4, "num_codebooks": 1,
}  # fmt: skip
# A tiny model bigger than this kept a full-size dimension the overrides do not name.
MAX_PARAMETERS = 20_000_000


@dataclass(frozen=True)
class Entry:
    """One ``*ForCausalLM`` class of one release's modeling file."""

    release: str
    model_type: str  # the directory under transformers/models
    module: str  # modeling_<name>
    cls: str

    @property
    def name(self) -> str:
        suffix = "" if self.cls == _main_class(self) else f":{self.cls}"
        return f"{self.model_type}{suffix}@{self.release}"


def _main_class(entry: Entry) -> str:
    return _MAIN.get((entry.release, entry.module), entry.cls)


_MAIN: dict[tuple[str, str], str] = {}  # (release, module) -> its first ForCausalLM class


# Words of the idioms the coverage counts, for ordering a run (never for choosing entries).
IDIOMS = ("rsqrt", "rotate_half", "experts", "gate_proj", "up_proj", "q_proj", "apply_rotary")


def by_idioms(cache: Path, found: list[Entry]) -> list[Entry]:
    """``found``, those whose modeling file names the idioms most often first (then by name)."""
    counts = {}
    for release in RELEASES:
        with zipfile.ZipFile(wheel(cache, release)) as archive:
            for entry in (e for e in found if e.release == release):
                text = archive.read(f"transformers/models/{entry.model_type}/{entry.module}.py").decode()
                counts[entry] = sum(text.count(word) > 0 for word in IDIOMS)
    return sorted(found, key=lambda e: (-counts[e], e.name))


def package(release: str) -> str:
    return "corpus_v" + release.replace(".", "_")


def wheel(cache: Path, release: str) -> Path:
    """The release's wheel in ``cache/wheels``, downloaded (not installed) when missing."""
    found = sorted((cache / "wheels").glob(f"transformers-{release}-*.whl"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", f"transformers=={release}", "-d", str(cache / "wheels")]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return sorted((cache / "wheels").glob(f"transformers-{release}-*.whl"))[0]


_CLASS = re.compile(r"^class (\w+ForCausalLM)\(", re.M)
_MODELING = re.compile(r"^transformers/models/([^/]+)/(modeling_(?!tf_|flax_)[^/]+)\.py$")


def entries(cache: Path) -> tuple[list[Entry], dict[str, str]]:
    """Every entry of every release, and what the scan found but excluded (name -> reason)."""
    found, excluded = [], {}
    for release in RELEASES:
        with zipfile.ZipFile(wheel(cache, release)) as archive:
            for path in sorted(archive.namelist()):
                match = _MODELING.match(path)
                if not match:
                    continue
                classes = _CLASS.findall(archive.read(path).decode())
                if not classes:
                    continue
                model_type, module = match.groups()
                if model_type in EXCLUDED:
                    excluded[f"{model_type}@{release}"] = EXCLUDED[model_type]
                    continue
                _MAIN[(release, module)] = classes[0]
                found += [Entry(release, model_type, module, cls) for cls in classes]
    return found, excluded


def _absolute(original: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = original.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def rewrite_imports(source: str, original: str, is_package: bool = False) -> str:
    """``source`` (the module ``original`` of an old release) with each import from transformers
    turned into a ``corpus_import`` call that binds the same names."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = _absolute(original, node, is_package)
        if not module.startswith("transformers") or any(a.name == "*" for a in node.names):
            continue
        if lines[node.lineno - 1][: node.col_offset].strip():  # shares its line with other code
            continue
        targets = ", ".join(a.asname or a.name for a in node.names)
        names = [a.name for a in node.names]
        indent = " " * node.col_offset
        call = f"{indent}{targets}, = __import__('third_party_shims').corpus_import(__name__, {module!r}, {names!r})\n"
        edits.append((node.lineno, node.end_lineno, call))
    for start, end, call in sorted(edits, reverse=True):
        lines[start - 1 : end] = [call]
    return "".join(lines)


def _extractor(cache: Path, release: str):
    """A function that writes a module of the old release (dotted, under ``transformers``) into the
    corpus and returns its name there (None: no such module file)."""
    root = cache / "src"
    archive = zipfile.ZipFile(wheel(cache, release))
    names = set(archive.namelist())

    def extract(module: str) -> str | None:
        path = module.replace(".", "/")
        is_package = f"{path}/__init__.py" in names
        path = f"{path}/__init__.py" if is_package else f"{path}.py"
        if path not in names:
            return None
        rest = module.split(".")[1:]
        target = [package(release)] + (rest[1:] if rest[:1] == ["models"] else ["_old"] + rest)
        out = root.joinpath(*target, "__init__.py") if is_package else root.joinpath(*target[:-1], target[-1] + ".py")
        if not out.exists() or (is_package and out.stat().st_size == 0):
            for depth in range(1, len(target) + is_package):
                init = root.joinpath(*target[:depth], "__init__.py")
                init.parent.mkdir(parents=True, exist_ok=True)
                init.touch()
            out.write_text(rewrite_imports(archive.read(path).decode(), module, is_package))
        return ".".join(target)

    return extract


def prepare(cache: Path) -> None:
    """Make the corpus importable: ``cache/src`` and this directory on ``sys.path``, each release's
    extractor registered with the shims."""
    import third_party_shims

    for path in (str(HERE), str(cache / "src")):
        if path not in sys.path:
            sys.path.insert(0, path)
    (cache / "src").mkdir(parents=True, exist_ok=True)
    for release in RELEASES:
        third_party_shims.OLD_MODULES.setdefault(package(release), _extractor(cache, release))


def _model_module(entry: Entry):
    import third_party_shims

    module = f"transformers.models.{entry.model_type}.{entry.module}"
    name = third_party_shims.OLD_MODULES[package(entry.release)](module)
    return importlib.import_module(name)


def tiny_config(config_class, release: str):
    """The config class's defaults with ``TINY``'s sizes where it has those attributes or takes those arguments."""
    import third_party_shims

    # transformers 5 reads ``rope_scaling`` as ``rope_parameters``, a dict even when none was given;
    # the old files take None for "no scaling": a plain attribute again.
    config_class.rope_scaling = None
    # What the old configurations had from their base class (read in their own __init__, too).
    for key, value in third_party_shims.old_config_defaults(package(release)).items():
        if not hasattr(config_class, key):
            setattr(config_class, key, value)
    defaults = config_class()
    known = set(vars(defaults)) | set(getattr(config_class, "attribute_map", {}) or {})
    known |= set(inspect.signature(config_class.__init__).parameters)
    return config_class(**{k: v for k, v in TINY.items() if k in known})


def load(entry: Entry, seed: int = 0):
    """The entry's model, built from a tiny configuration with random weights, float32, eval mode."""
    import torch

    module = _model_module(entry)
    cls = getattr(module, entry.cls)
    for value in vars(module).values():  # transformers 5 reads this attribute as a mapping
        if isinstance(value, type) and isinstance(getattr(value, "_tied_weights_keys", None), list):
            value._tied_weights_keys = None
    cls = _generating(cls)
    config = tiny_config(cls.config_class, entry.release)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny configuration still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(seed)
    return cls(config).float().eval()


def _generating(cls: type) -> type:
    """``cls`` with ``GenerationMixin`` among its bases, as transformers 5 gives remote code loaded through
    an auto class (its ``PreTrainedModel`` no longer does)."""
    from transformers import GenerationMixin

    if issubclass(cls, GenerationMixin):
        return cls
    return type(cls.__name__, (cls, GenerationMixin), {"__module__": cls.__module__, "__doc__": cls.__doc__})


def by_name(cache: Path, name: str) -> Entry:
    found, _ = entries(cache)
    for entry in found:
        if entry.name == name:
            return entry
    raise SystemExit(f"no entry {name!r}; `--cache {cache}` lists them")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--load", help="build one entry (type@release, or type:Class@release)")
    args = parser.parse_args()
    prepare(args.cache)
    if args.load:
        model = load(by_name(args.cache, args.load))
        print(type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters")
        return 0
    found, excluded = entries(args.cache)
    for entry in found:
        print(entry.name)
    for name, reason in excluded.items():
        print(f"excluded {name}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
