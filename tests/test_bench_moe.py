"""The MoE benchmark script runs end to end (at toy sizes on CPU, ``--smoke``) and writes its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    table = (tmp_path / "bench_moe.md").read_text()
    assert table.splitlines()[-1].startswith("| 5 |") and done.stdout.rstrip().endswith(table.splitlines()[-1])
