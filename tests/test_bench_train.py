"""The training benchmark runs end to end at toy sizes on the CPU (``--smoke``): variants taking turns
over rounds, the host breakdown, and the files it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_takes_turns_over_rounds_and_writes_the_host_breakdown(tmp_path):
    command = [
        sys.executable, "benchmarks/bench_train.py", "--smoke", "--models", "qwen3_moe",
        "--variants", "transformers", "transfuse", "--steps", "1", "--rounds", "2", "--host", "transfuse",
        "--gc", "freeze", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "bench_train.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["transformers", "transfuse"]
    for row in results:
        assert len(row["round_ms"]) == 2 and row["step_ms"] > 0 and row["loss"] == results[0]["loss"]
    host = (tmp_path / "host_qwen3_moe_transfuse.txt").read_text()
    for section in ("Host time to issue", "each module class", "each dispatched op", "cProfile"):
        assert section in host, section
    assert "rounds: " in (tmp_path / "bench_train.md").read_text()


def test_rounds_merge_to_their_median():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_train

    rows = [{"variant": "v", "step_ms": ms, "adamw_step_ms": 2 * ms, "tokens_per_s": 1000 / ms} for ms in (3.0, 1.0, 2.0)]
    merged = bench_train._merge_rounds(rows)
    assert merged["step_ms"] == 2.0 and merged["adamw_step_ms"] == 4.0 and merged["round_ms"] == [3.0, 1.0, 2.0]
    assert bench_train._merge_rounds([{"variant": "v", "error": "x"}]) == {"variant": "v", "error": "x"}
