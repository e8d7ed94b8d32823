"""Run transfuse's GPU tests for the fused MoE and print a table of the outcomes last.

    python benchmarks/run_gpu_tests.py --out DIR

Runs tests/test_moe_gpu.py, the Triton tests of tests/test_moe_ops.py (on the GPU there: both the
decode and the grouped path in every layout, float32 and bf16), the tile tables' shared-memory
fit (tests/test_moe_configs.py) and the layer-to-kernel test of tests/test_moe.py under pytest
(about two minutes on an H200), writing DIR/moe_gpu_tests.xml (JUnit) and
DIR/moe_gpu_tests.log (pytest's output); exits with pytest's status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_moe_gpu.py",
    "tests/test_moe_ops.py",
    "tests/test_moe_configs.py",
    "tests/test_moe.py::test_fused_blocks_run_the_triton_kernels_with_the_same_numbers",
]


def outcomes(xml_path: Path) -> list[tuple[str, str, float, str]]:
    """(test, outcome, seconds, first line of the message) of each test case in a JUnit file."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = (
                    kind,
                    (found.get("message") or "").splitlines()[0][:100] if found.get("message") else "",
                )
        rows.append((case.get("name"), outcome, float(case.get("time") or 0.0), message))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the JUnit XML and the log")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    xml_path, log_path = args.out / "moe_gpu_tests.xml", args.out / "moe_gpu_tests.log"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", *TESTS]
    with open(log_path, "w") as log:
        status = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    print(log_path.read_text()[-3000:])
    if not xml_path.exists():
        print(f"pytest wrote no results (exit status {status}); see {log_path}.")
        return status or 1
    rows = outcomes(xml_path)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'test'.ljust(width)}  outcome  seconds  message")
    for name, outcome, seconds, message in rows:
        print(f"{name.ljust(width)}  {outcome:<7}  {seconds:7.1f}  {message}")
    counts = {k: sum(1 for r in rows if r[1] == k) for k in ("passed", "failure", "error", "skipped")}
    print(f"\n{len(rows)} tests: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    return status


if __name__ == "__main__":
    sys.exit(main())
