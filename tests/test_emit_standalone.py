"""Emitted directories stand alone: they load and run with torch and transformers only, and use
transfuse's kernels where a matching transfuse is installed. A checkpoint's own code (``auto_map``)
is emitted into the directory, rewritten like any other modeling file.

The runs without transfuse are real: ``standalone_loader.py`` loads the directories in another
process, where ``import transfuse`` fails as it does where the package is not installed, with an
empty modules cache of its own (``HF_MODULES_CACHE``), so nothing of the loader's cache or of the
checkpoint's code outside the directory can be used."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import transfuse
from transfuse import ops
from transfuse.ops import MergedProjection
from transfuse.rewriter.emit import emit
from transfuse.tiny import tiny_model

# gptj: rotary_one (one tensor, sin before cos, interleaved pairs, half-width tables); cohere: rotary
# of interleaved pairs in float32.
FAMILIES = ["llama", "qwen3_moe", "mixtral", "gptj", "cohere"]
REMOTE = ["remote own code", "remote subclass"]
LOADER = Path(__file__).with_name("standalone_loader.py")


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the logits' scale (DESIGN's rule: at most 1e-5 in fp32)."""
    return ((got - want).abs().max() / want.abs().max()).item()


# ---- a checkpoint with its own code ------------------------------------------------------------


def _own_code_checkpoint(directory: Path) -> Path:
    """A llama whose modeling file is its own: transformers' modeling_llama.py as a checkpoint ships
    such a file (imports of transformers made absolute, the configuration its own, imported relatively)."""
    import transformers.models.llama.modeling_llama as llama

    source = Path(llama.__file__).read_text()
    source = re.sub(r"^from \.\.\.(\S*) import", r"from transformers.\1 import", source, flags=re.M)
    source = source.replace("from .configuration_llama import LlamaConfig", "from .configuration_tiny import TinyConfig as LlamaConfig")
    files = {
        "configuration_tiny.py": "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_own'\n",
        "modeling_tiny.py": source,
    }
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.LlamaForCausalLM"}
    return _with_code(directory, files, auto_map, "tiny_own")


def _subclass_checkpoint(directory: Path) -> Path:
    """A checkpoint whose model class subclasses transformers' own (``from transformers import ...``)."""
    files = {
        "configuration_remote.py": "from transformers import LlamaConfig\n\n\nclass RemoteConfig(LlamaConfig):\n    model_type = 'remote_sub'\n",
        "modeling_remote.py": "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n\n\n"
        "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n",
    }
    auto_map = {"AutoConfig": "configuration_remote.RemoteConfig", "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}
    return _with_code(directory, files, auto_map, "remote_sub")


def _with_code(directory: Path, files: dict[str, str], auto_map: dict[str, str], model_type: str) -> Path:
    tiny_model("llama").save_pretrained(directory)
    for name, text in files.items():
        (directory / name).write_text(text)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type=model_type, auto_map=auto_map, architectures=[auto_map["AutoModelForCausalLM"].split(".")[1]])
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---- emitted directories, and one run of them without transfuse ----------------------------------


def _rewritten(name: str, root: Path):
    """The rewritten model and the checkpoint it was loaded from (None: built from a config). The
    fusions are not verified: what is checked here is that the emitted directory computes what the
    rewritten model computes, and verification would triple the time."""
    if name in FAMILIES:
        return transfuse.rewrite(tiny_model(name).eval(), verify=False), None
    make = _own_code_checkpoint if name == "remote own code" else _subclass_checkpoint
    checkpoint = make(root / name.replace(" ", "_"))
    return transfuse.from_pretrained(checkpoint, trust_remote_code=True, verify=False).eval(), checkpoint


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """name -> (directory, ids file, the rewritten model's logits, its merged projections, emit's result)."""
    root = tmp_path_factory.mktemp("standalone")
    found = {}
    for name in FAMILIES + REMOTE:
        model, checkpoint = _rewritten(name, root)
        ids = _ids(model.config.vocab_size)
        torch.save(ids, root / f"{name}.ids.pt")
        out = root / f"{name.replace(' ', '_')}_emitted"
        result = emit(model, out, checkpoint_dir=str(checkpoint) if checkpoint else None)
        merged = sum(isinstance(m, MergedProjection) for m in model.modules())
        found[name] = (out, root / f"{name}.ids.pt", _logits(model, ids), merged, result)
    return found


@pytest.fixture(scope="module")
def without_transfuse(emitted, tmp_path_factory):
    """What ``standalone_loader.py`` saw of each directory, in a process where transfuse cannot be
    imported, with a modules cache of its own."""
    root = tmp_path_factory.mktemp("runs")
    jobs = [{"dir": str(d), "ids": str(ids), "out": str(root / f"{i}.pt")} for i, (d, ids, *_) in enumerate(emitted.values())]
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_MODULES_CACHE": str(root / "modules"), "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, str(LOADER), str(root / "jobs.json"), "--block-transfuse"],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.listdir(root / "modules"), "the loader's own modules cache was not used"
    return {name: torch.load(job["out"]) for name, job in zip(emitted, jobs)}


@pytest.mark.parametrize("name", FAMILIES + REMOTE)
def test_an_emitted_directory_runs_with_torch_and_transformers_alone(name, emitted, without_transfuse):
    directory, _, logits, merged, _ = emitted[name]
    seen = without_transfuse[name]
    assert _close(seen["logits"], logits) <= 1e-5
    assert seen["merged"] == merged > 0  # fused as the rewritten model is, not stock modules
    assert not [m for m in seen["modules"] if m.startswith("transformers.models.") and ".modeling_" in m], seen["modules"]
    assert len(seen["log"]) == 1 and "transfuse is not installed" in seen["log"][0], seen["log"]
    assert "transfuse_runtime.py" in os.listdir(directory)


def test_the_emitted_modeling_files_import_transfuse_nowhere(emitted):
    """Only the runtime names transfuse, in a guarded import that transformers' ``check_imports``
    does not count as a requirement."""
    from transformers.dynamic_module_utils import get_imports

    for directory, *_ in emitted.values():
        for path in directory.glob("*.py"):
            assert "transfuse" not in get_imports(path), path
            if path.name != "transfuse_runtime.py":
                assert not re.search(r"^\s*(from|import) transfuse", path.read_text(), flags=re.M), path


@pytest.mark.parametrize("name", REMOTE)
def test_a_checkpoints_own_code_is_emitted_rewritten_and_said(name, emitted):
    directory, *_, result = emitted[name]
    texts = {p.name: p.read_text() for p in directory.glob("*.py")}
    assert not any("transformers_modules" in text for text in texts.values())
    config = json.loads((directory / "config.json").read_text())
    config_file, config_class = config["auto_map"]["AutoConfig"].split(".")
    assert f"class {config_class}(" in texts[f"{config_file}.py"]
    notes = " ".join(result.notes)
    assert "own code" in notes and config_file in notes, result.notes
    if name == "remote subclass":  # the stock classes it subclasses are emitted, fused, beside it
        assert "from .modeling_llama import LlamaForCausalLM" in texts["modeling_remote.py"]
        assert "_transfuse_merges" in texts["modeling_llama.py"]
    else:
        assert "_transfuse_merges" in texts["modeling_tiny.py"]
        assert "from .configuration_tiny import TinyConfig as LlamaConfig" in texts["modeling_tiny.py"]


# ---- with transfuse installed ------------------------------------------------------------------


def _load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


def _runtime_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.endswith("transfuse_runtime")]


def test_with_transfuse_installed_the_emitted_model_calls_its_dispatched_ops(emitted, caplog):
    directory, ids, logits, merged, _ = emitted["llama"]
    caplog.set_level(logging.INFO)
    loaded = _load(directory)
    assert sum(isinstance(m, MergedProjection) for m in loaded.modules()) == merged  # transfuse's own layers
    with ops.trace() as calls:
        got = _logits(loaded, torch.load(ids))
    assert {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary"} <= {c.op for c in calls}
    assert torch.equal(got, logits)
    lines = _runtime_lines(caplog)
    assert len(lines) == 1 and f"transfuse {transfuse.__version__}" in lines[0] and "kernels" in lines[0], lines


@pytest.mark.parametrize("name, op", [("gptj", "rotary_one"), ("cohere", "rotary")])
def test_with_transfuse_installed_an_emitted_rotary_layout_calls_its_op(name, op, emitted):
    directory, ids, logits, _, _ = emitted[name]
    text = (directory / f"modeling_{name}.py").read_text()
    assert f"{op}(" in text and "interleaved=True" in text and "original=apply_rotary_pos_emb" in text
    loaded = _load(directory)
    with ops.trace() as calls:
        got = _logits(loaded, torch.load(ids))
    assert op in {c.op for c in calls}
    assert torch.equal(got, logits)


def test_a_transfuse_of_another_version_is_not_used(emitted, tmp_path, caplog, monkeypatch):
    directory, ids, logits, merged, _ = emitted["llama"]
    # A copy under another name: transformers imports it as other modules, so the runtime runs again.
    shutil.copytree(directory, tmp_path / "other_version")
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(transfuse, "__version__", "7.3.0")
    loaded = _load(tmp_path / "other_version")
    assert not any(isinstance(m, MergedProjection) for m in loaded.modules())  # the runtime's own
    assert sum(type(m).__name__ == "MergedProjection" for m in loaded.modules()) == merged
    with ops.trace() as calls:
        got = _logits(loaded, torch.load(ids))
    assert calls == []
    assert _close(got, logits) <= 1e-5
    warned = [r for r in caplog.records if r.name.endswith("transfuse_runtime") and r.levelno == logging.WARNING]
    assert len(_runtime_lines(caplog)) == 1 and len(warned) == 1, _runtime_lines(caplog)
    assert "7.3.0" in warned[0].getMessage() and transfuse.__version__ in warned[0].getMessage()


# ---- the runtime is generated from ops/ ------------------------------------------------------


def _requirable() -> set[tuple[str, str]]:
    """Every (module, name) a fuser's edit can import into an emitted file: its ``context.require``
    calls, the plan and spec classes written as literals, and the loading helpers."""
    import transfuse.fusers as fusers
    from transfuse.ops import moe, moe_layer

    found = {("transfuse.rewriter.weights", "Merge"), ("transfuse.rewriter.weights", "merge_declared")}
    for path in Path(fusers.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "require":
                if all(isinstance(a, ast.Constant) for a in node.args):  # else a plan's class, below
                    found.add(tuple(a.value for a in node.args))
    for module in (moe, moe_layer):
        found |= {(module.__name__, n) for n in module.__all__ if n[0].isupper() and hasattr(getattr(module, n), "__dataclass_fields__")}
    return found


def test_the_runtime_is_extracted_from_the_ops_modules_with_a_header(monkeypatch):
    import inspect

    from transfuse.ops.rms_norm import rms_norm_native
    from transfuse.rewriter.emit_runtime import runtime_source

    roots = _requirable()
    assert len(roots) > 20
    text = runtime_source(roots)
    assert text.startswith("# This file was generated by transfuse")
    assert inspect.getsource(rms_norm_native) in text  # the ops' own text, not a copy kept elsewhere
    assert "RMS_NORM = rms_norm_native" in text  # an op is its native definition here
    runtime = types.ModuleType("transfuse_runtime_under_test")  # dataclasses look their module up
    monkeypatch.setitem(sys.modules, runtime.__name__, runtime)
    exec(compile(text, "transfuse_runtime.py", "exec"), vars(runtime))
    assert {name for _, name in roots} <= set(vars(runtime))
    tree = ast.parse(text)
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    transfuse_imports = [n for n in imports if any(a.name.startswith("transfuse") for a in n.names) or (getattr(n, "module", "") or "").startswith("transfuse")]
    assert not transfuse_imports  # transfuse is looked up by name, only where the runtime asks whether it is installed
    assert text.count('import_module("transfuse")') == 1
    assert "torch.ops.transfuse" not in text and "custom_op" not in text
