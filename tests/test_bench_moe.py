"""The MoE benchmark script runs end to end (at toy sizes on CPU, ``--smoke``) and writes its results,
with defaults to paste into the tile tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from transfuse.ops.triton import moe_configs

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_smoke_run_writes_json_and_table(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [
        sys.executable,
        "benchmarks/bench_moe.py",
        "--smoke",
        "--tokens",
        "1",
        "5",
        "--no-sweep",
        "--crossover",
        "3",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "bench_moe.json").read_text())
    assert [row["tokens"] for row in results["rows"]] == [1, 5]
    for row in results["rows"]:
        assert row["errors"]["transfuse native"] == 0.0  # the native op is exact against transformers' eager
        assert row["floor_us"] > 0 and "us" in row["results"]["transfuse triton"]
    text = (tmp_path / "bench_moe.md").read_text()
    assert any(line.startswith("| 5 |") for line in text.splitlines()) and done.stdout.rstrip().endswith(text.rstrip())
    assert [(c["tokens"], c["decode"] > 0, c["tiny"] > 0) for c in results["crossover"]] == [(3, True, True)]
    # The suggested defaults are Python that replaces the tables as they are.
    namespace = dict(vars(moe_configs))
    exec(results["suggested_defaults"], namespace)
    assert namespace["CONFIGS"] == moe_configs.CONFIGS and isinstance(namespace["DECODE_MAX_PAIRS"], int)
