"""The compile cache across processes (``transfuse/compile/cache.py``): its key changes with what
changes compiled code and only with that, a second process with the key reuses the first one's
Inductor output (counted by Inductor's own cache counters, with torch's local cache empty), an
entry cut short is ignored and rebuilt with a warning, and writers never leave a partial entry."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

from transfuse.compile import cache, precompiled

pytestmark = pytest.mark.skipif(not cache.supported(), reason="this torch has no portable cache artifacts")

BLOCK = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.{act}(self.proj(x))
'''


def _block(tmp_path, name: str, act: str) -> nn.Module:
    path = tmp_path / f"{name}.py"
    path.write_text(BLOCK.format(act=act))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.Block()


def test_the_key_changes_with_source_dtype_options_and_versions_and_nothing_else(tmp_path, monkeypatch):
    options = {"inductor": True, "dynamic": None}
    base = cache.key(_block(tmp_path, "block_a", "relu"), options)
    assert cache.key(_block(tmp_path, "block_a2", "relu"), options) == base  # the same source, rebuilt
    assert cache.key(_block(tmp_path, "block_b", "tanh"), options) != base  # changed source
    assert cache.key(_block(tmp_path, "block_c", "relu").to(torch.bfloat16), options) != base  # dtype
    assert cache.key(_block(tmp_path, "block_d", "relu"), {**options, "dynamic": False}) != base  # options
    wider = _block(tmp_path, "block_e", "relu")
    wider.proj = nn.Linear(8, 16)
    assert cache.key(wider, options) != base  # structure and shapes
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert cache.key(_block(tmp_path, "block_f", "relu"), options) != base  # torch's version
    monkeypatch.undo()
    monkeypatch.setattr(cache, "__version__", "0.0.0-other")
    assert cache.key(_block(tmp_path, "block_g", "relu"), options) != base  # transfuse's version
    monkeypatch.undo()
    import torch._inductor.config as inductor_config

    # (torch's own patch: monkeypatch's undo deletes an attribute the module's __dict__ lacks, which
    # hides an Inductor setting from the rest of the process)
    with inductor_config.patch(max_autotune=not inductor_config.max_autotune):
        assert cache.key(_block(tmp_path, "block_h", "relu"), options) != base  # Inductor's configuration
    assert not inductor_config._config["max_autotune"].hide
    from transfuse.ops import dispatch

    dispatch.set_priority(["native"], "rms_norm")
    try:
        assert cache.key(_block(tmp_path, "block_i", "relu"), options) != base  # the dispatch state
    finally:
        dispatch.set_priority(None, "rms_norm")
    assert cache.key(_block(tmp_path, "block_j", "relu"), options) == base


def test_a_corrupt_entry_is_ignored_with_a_warning_removed_and_another_key_misses(tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    entry = cache.CompileCache(tmp_path, "0" * 64)
    assert not entry.load() and counters["transfuse_cache"]["miss"] == 1  # no entry: a miss
    whole = cache._wrap([b"payload of artifacts", b"another"])
    assert cache._unwrap(whole) == [b"payload of artifacts", b"another"]
    entry.path.write_bytes(whole[:-3])  # cut short
    with pytest.warns(UserWarning, match="ignored the compile cache entry .* cut short or corrupt"):
        assert not entry.load()
    assert counters["transfuse_cache"]["corrupt"] == 1 and not entry.path.exists()
    entry.path.write_bytes(cache._wrap([b"not torch's artifacts"]))  # whole, but torch cannot read it
    with pytest.warns(UserWarning, match="ignored the compile cache entry"):
        assert not entry.load()
    assert counters["transfuse_cache"]["corrupt"] == 2 and counters["transfuse_cache"]["hit"] == 0


def test_writers_at_once_leave_a_whole_entry(tmp_path):
    payloads = [bytes([i]) * (1 << 20) for i in range(1, 5)]
    entries = [cache.CompileCache(tmp_path, "1" * 64) for _ in payloads]
    seen = []

    def write(entry, payload):
        entry.recorded_chunks = [(payload, frozenset({("inductor", payload[:1].hex())}))]
        for _ in range(5):
            entry._unsaved = True
            entry.save()
            seen.append(cache._unwrap(entry.path.read_bytes()))

    threads = [threading.Thread(target=write, args=pair) for pair in zip(entries, payloads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 20 and all(chunks in [[p] for p in payloads] for chunks in seen)  # whole, never mixed
    assert [p.name for p in tmp_path.iterdir()] == [f"{'1' * 64}.bin"]  # no temporary file left


PROCESS = textwrap.dedent('''
    import json, sys, torch
    from torch._dynamo.utils import counters
    from transfuse.compile import cache

    entry = cache.CompileCache(sys.argv[1], "2" * 64)
    entry.load()
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="inductor")
    x = torch.randn(16)
    with entry.recording():
        assert torch.allclose(f(x), torch.sin(x) * 2 + 1, atol=1e-6)
    g = torch.compile(lambda x: torch.cos(x) - 1, backend="inductor")  # not recorded: not the entry's
    assert torch.allclose(g(x), torch.cos(x) - 1, atol=1e-6)
    entry.save()
    print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
                      "transfuse": dict(counters["transfuse_cache"])}))
''')


def _isa_probes(directory) -> None:
    """An Inductor cache directory holding only the builds that pick the CPU's vector instruction set
    (Inductor compiles and loads a probe per instruction set into a fresh directory before its first
    kernel): no graph, no kernel."""
    probe = "from torch._inductor import cpu_vec_isa; cpu_vec_isa.pick_vec_isa()"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(directory)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(directory.rglob("fxgraph")) and not list(directory.rglob("aotautograd"))


def test_a_second_process_reuses_the_first_ones_inductor_output(tmp_path):
    """Each process gets an Inductor cache of its own, empty of graphs and kernels (it holds the
    instruction-set probes, built once for both): a hit can only come from the entry."""
    probes = tmp_path / "inductor-probes"
    _isa_probes(probes)

    def process(name: str, where: str) -> dict:
        shutil.copytree(probes, tmp_path / f"inductor-{name}")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
        result = subprocess.run([sys.executable, "-c", PROCESS, where], capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    entries = str(tmp_path / "entries")
    first = process("first", entries)
    assert first["misses"] == 2 and first["hits"] == 0 and first["transfuse"] == {"miss": 1, "saved": 1}
    second = process("second", entries)
    # The recorded graph from the entry; the other graph, never in it, compiled again.
    assert second["hits"] == 1 and second["misses"] == 1 and second["transfuse"] == {"hit": 1}  # nothing new: not written


# --- Dynamo's output kept across processes (``transfuse/compile/precompiled.py``) -----------------

KEPT = textwrap.dedent('''
    import json, sys, torch
    import transfuse
    from torch._dynamo.utils import counters
    from transfuse.compile import backend
    from transfuse.tiny import tiny_model

    # Inductor's probe of the CPU's vector instruction sets (a test library built and loaded in a
    # child Python), counted.
    from torch._inductor import cpu_vec_isa
    steps = {"isa_probes": 0}
    probe = cpu_vec_isa.VecISA.check_build

    def counted_probe(*args, **kwargs):
        steps["isa_probes"] += 1
        return probe(*args, **kwargs)

    cpu_vec_isa.VecISA.check_build = counted_probe

    # How many kept functions are loaded after each call of the model.
    from transfuse.compile import precompiled
    loaded_by_call = []
    call = precompiled.Precompiled.__call__

    def recorded_call(self, *args, **kwargs):
        output = call(self, *args, **kwargs)
        loaded_by_call.append(self.loaded)
        return output

    precompiled.Precompiled.__call__ = recorded_call

    cache_dir = False if sys.argv[1] == "off" else sys.argv[1]
    model = transfuse.rewrite(tiny_model("llama"))
    transfuse.compile(model, cache_dir=cache_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                do_sample=False)
        logits = model(ids[:, :7], attention_mask=torch.ones_like(ids[:, :7])).logits
    kept = model._transfuse_compiled.precompiled
    result = {
        "tokens": tokens.tolist(), "logits": logits.flatten().tolist(),
        "graphs": backend.stats()["graphs"], "frames": counters["stats"]["unique_graphs"],
        "kept": kept.counts if kept is not None else None, "loaded": kept.loaded if kept is not None else 0,
        "transfuse": dict(counters["transfuse_cache"]), **steps, "loaded_by_call": loaded_by_call,
    }
    # Dropped, the model is freed, weights and all (the cache entry, written at exit, holds none of it).
    import gc, weakref
    weights = [weakref.ref(p) for p in model.parameters()]
    del model, kept
    gc.collect()
    result["alive_weights"] = sum(w() is not None for w in weights)
    print(json.dumps(result))
''')


def _run(script: str, *argv: str) -> dict:
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not precompiled.supported(), reason="this torch keeps no Dynamo output across processes")
def test_a_second_process_runs_the_kept_calls_without_dynamo_and_matches_the_uncached_compiled_model(tmp_path):
    entries = str(tmp_path / "entries")
    first = _run(KEPT, entries)
    assert first["kept"]["compiled"] >= 2 and first["loaded"] == 0  # a prompt and a decode step at least
    assert first["alive_weights"] == 0
    assert len(list((tmp_path / "entries").glob("*.dynamo"))) == 1  # written at exit
    second = _run(KEPT, entries)
    # Every call served by a loaded function: no frame traced by Dynamo, no graph given to the backend.
    assert second["loaded"] == first["kept"]["compiled"] and second["kept"]["compiled"] == 0
    assert second["kept"]["fallback"] == 0 and second["kept"]["kept"] == first["kept"]["kept"] + first["kept"]["compiled"]
    assert second["graphs"] == 0 and second["frames"] == 0 and second["transfuse"].get("dynamo_hit") == 1
    # Inductor's instruction-set probe, taken where the code was built, is left out where it is only
    # loaded: the entry names the set.
    assert first["isa_probes"] >= 1 and second["isa_probes"] == 0
    # The prompt's call loads its function only; the decode step's is loaded at the first step.
    assert second["loaded_by_call"][0] == 1 and second["loaded_by_call"][1] == 2
    uncached = _run(KEPT, "off")  # the compiled model with no cache: torch.compile's own entry
    assert uncached["kept"] is None and uncached["graphs"] >= 2
    assert second["tokens"] == uncached["tokens"] == first["tokens"]
    assert second["alive_weights"] == uncached["alive_weights"] == 0
    assert torch.allclose(torch.tensor(second["logits"]), torch.tensor(uncached["logits"]), rtol=1e-5, atol=1e-5)
    assert max(map(abs, second["logits"])) > 0  # (a real output, not zeros)


_MODELS: list[nn.Module] = []  # the models of ``_kept`` (a kept entry holds its model weakly)


def _kept(tmp_path, **options) -> "precompiled.Precompiled":
    options = {"dynamic": None, "trust_modules": False, "cuda_graphs": False, **options}
    _MODELS.append(nn.Linear(4, 4))
    return precompiled.Precompiled(_MODELS[-1], options, lambda model, **kw: "fallback", tmp_path / "k.dynamo", lambda: set())


def test_a_corrupt_kept_entry_is_ignored_with_a_warning_and_removed(tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    kept = _kept(tmp_path)
    kept.path.write_bytes(cache._wrap([b"whole but not a function"], precompiled._MAGIC)[:-4])  # cut short
    with pytest.warns(UserWarning, match="ignored the kept compiled calls .* cut short or corrupt"):
        assert kept.read() == 0
    assert not kept.path.exists() and counters["transfuse_cache"]["dynamo_corrupt"] == 1
    kept = _kept(tmp_path)
    kept.path.write_bytes(cache._wrap([b"whole but not a function"], precompiled._MAGIC))  # whole, unloadable
    with pytest.warns(UserWarning, match="ignored the kept compiled calls .* cannot be loaded"):
        assert kept.read() == 0
    assert not kept.path.exists() and counters["transfuse_cache"]["dynamo_corrupt"] == 2
    assert kept.functions == [] and counters["transfuse_cache"]["dynamo_hit"] == 0


def test_a_call_that_cannot_be_kept_goes_to_torch_compile_with_a_warning(tmp_path, monkeypatch):
    kept = _kept(tmp_path)
    if precompiled._parts() is None:
        pytest.skip("this torch keeps no Dynamo output across processes")

    def refuse(*args, **kwargs):
        raise RuntimeError("a graph break")

    monkeypatch.setitem(precompiled._parts(), "compile", refuse)
    with pytest.warns(UserWarning, match="go through torch.compile: RuntimeError: a graph break"):
        assert kept(input=torch.ones(4)) == "fallback"
    assert kept(input=torch.ones(4)) == "fallback"  # refused once: not tried again
    assert kept.counts == {"kept": 0, "compiled": 0, "fallback": 2} and not kept.save()


def test_without_torch_precompile_the_compiled_model_keeps_torch_compile_and_the_artifacts(tmp_path, monkeypatch):
    import transfuse
    from transfuse.tiny import tiny_model

    monkeypatch.setattr(precompiled, "_parts", lambda: None)
    assert not precompiled.supported()
    model = transfuse.compile(tiny_model("llama"), cache_dir=tmp_path)
    assert model._transfuse_compiled.precompiled is None and model._transfuse_compiled.cache_entry is not None


def test_a_torch_older_than_2_13_is_not_asked_to_keep_calls(tmp_path, monkeypatch):
    """torch 2.11 refused every kept function after tracing the call for it: such a torch is not
    asked, and the compiled model has no kept calls (its artifacts are still kept)."""
    import transfuse
    from transfuse.tiny import tiny_model

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert precompiled._torch_parts() is None
    monkeypatch.setattr(precompiled, "_parts", precompiled._torch_parts)
    model = transfuse.compile(tiny_model("llama"), cache_dir=tmp_path)
    assert model._transfuse_compiled.precompiled is None and model._transfuse_compiled.cache_entry is not None


def test_the_kept_calls_are_named_by_the_key(tmp_path):
    entry = cache.CompileCache(tmp_path, "3" * 64)
    assert entry.precompiled_path == tmp_path / f"{'3' * 64}.dynamo" and entry.path == tmp_path / f"{'3' * 64}.bin"


def test_loading_kept_cpu_code_skips_inductors_probe_only_where_the_entry_names_the_set_picked_here():
    from torch._inductor import config, cpu_vec_isa

    listed = cpu_vec_isa.valid_vec_isa_list
    listed.cache_clear()
    with config.patch({"cpp.vec_isa_ok": True}):
        here = str(cpu_vec_isa.pick_vec_isa())  # the set Inductor picks here without probing
    listed.cache_clear()

    def inside(recorded: str | None) -> tuple:
        with precompiled._vec_isa_known(recorded):
            return config.cpp.vec_isa_ok

    assert inside(here) is True
    assert listed.cache_info().currsize == 0  # (the unprobed list dropped again)
    assert inside("another") is None  # another set: Inductor probes
    assert listed.cache_info().currsize == 0
    assert inside(None) is None  # no CPU code recorded: Inductor's way
    assert config.cpp.vec_isa_ok is None
    listed()  # a list probed already: left as it is
    assert inside(here) is None and listed.cache_info().currsize == 1


def test_kept_functions_load_when_a_call_needs_them_and_one_that_cannot_is_left_out_of_the_entry(tmp_path, monkeypatch):
    class Kept:  # a kept function serving the calls whose ``which`` is its name
        def __init__(self, name: str):
            self.name = name

        def guard_check(self, model, which):
            return which == self.name

        def fn(self, model, which):
            return f"served by {self.name}"

    loads = []

    def deserialize(parts, chunk):
        loads.append(chunk)
        if chunk == b"broken":
            raise pickle.UnpicklingError("truncated")
        return Kept(chunk.decode())

    monkeypatch.setattr(precompiled, "_deserialize", deserialize)
    kept = _kept(tmp_path)
    kept.path.write_bytes(cache._wrap([b"prompt", b"broken", b"step"], precompiled._MAGIC))
    assert kept.read() == 3 and kept.loaded == 1 and loads == [b"prompt"]
    assert kept(which="prompt") == "served by prompt" and loads == [b"prompt"]
    with pytest.warns(UserWarning, match="ignored a kept compiled call .* UnpicklingError: truncated"):
        assert kept(which="step") == "served by step"
    assert loads == [b"prompt", b"broken", b"step"] and kept.loaded == 2 and kept.pending == []
    assert kept.store.kept == [b"prompt", b"step"] and kept.store.unsaved  # written again without it
    assert kept(which="step") == "served by step" and kept.counts["kept"] == 3 and len(loads) == 3
