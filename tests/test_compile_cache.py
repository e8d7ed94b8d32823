"""The compile cache across processes (``transfuse/compile/cache.py``): its key changes with what
changes compiled code and only with that, a second process with the key reuses the first one's
Inductor output (counted by Inductor's own cache counters, with torch's local cache empty), an
entry cut short is ignored and rebuilt with a warning, and writers never leave a partial entry."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

from transfuse.compile import cache

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

    monkeypatch.setattr(inductor_config, "max_autotune", not inductor_config.max_autotune)
    assert cache.key(_block(tmp_path, "block_h", "relu"), options) != base  # Inductor's configuration
    monkeypatch.undo()
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


def test_a_second_process_reuses_the_first_ones_inductor_output(tmp_path):
    """Each process gets an empty Inductor cache of its own: a hit can only come from the entry."""

    def process(name: str, where: str) -> dict:
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
