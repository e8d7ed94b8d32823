"""Run the kernel tests on a CUDA GPU and leave everything needed to debug a failure in one directory.

    python tests/run_on_gpu.py --out DIR
    python tests/run_on_gpu.py --out DIR --files tests/test_rotary_ops.py -k "not fp16"   # a subset

1. builds the CUDA extension verbosely (``python -m transfuse.ops.cuda``) into DIR/cuda_build.log;
2. runs the ops tests (``tests/test_kernels.py``: every Triton and CUDA provider against native;
   ``test_triton_launch.py``; ``test_moe_ops.py``; ``test_decode_graphs.py``;
   ``test_ops_dispatch.py``; ``test_ops_compile.py``; ``test_rotary_ops.py``; ``test_fail_closed.py``: verification of wrong and
   honest kernels in three dtypes) with pytest, its output in DIR/pytest.log
   and a JUnit report in DIR/pytest.xml;
3. prints a short table last: per test file, passed / failed / skipped, then the failures.

Exit status: pytest's (0 when everything passed).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_FILES = [
    "tests/test_kernels.py",
    "tests/test_triton_launch.py",
    "tests/test_ops_dispatch.py",
    "tests/test_ops_compile.py",
    "tests/test_moe_ops.py",
    "tests/test_decode_graphs.py",
    "tests/test_fail_closed.py",
    "tests/test_kernels_backward.py",
    "tests/test_rotary_ops.py",
]


def _run(command: list[str], log: Path) -> tuple[int, float]:
    start = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.run(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT).returncode
    return code, time.perf_counter() - start


def _outcomes(report: Path) -> tuple[Counter, list[str]]:
    """(counts per (file, outcome), failure lines) from a JUnit report."""
    counts: Counter = Counter()
    failures = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            outcome = "failed"
            message = (problem.get("message") or "").splitlines()
            failures.append(f"{name}: {message[0][:200] if message else ''}")
        else:
            outcome = "skipped" if case.find("skipped") is not None else "passed"
        counts[(case.get("classname", "").rsplit(".", 1)[-1], outcome)] += 1
    return counts, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--files", nargs="+", default=TEST_FILES, help="a subset of the test files (default: all)")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression, to run a subset of the tests")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    missing = [name for name in ("pytest", "libcst") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"{', '.join(missing)} not installed for {sys.executable}: install or carry it first.")
        return 2

    build_code, build_s = _run([sys.executable, "-m", "transfuse.ops.cuda"], args.out / "cuda_build.log")
    print(f"cuda extension build: exit {build_code} in {build_s:.0f} s (log: {args.out / 'cuda_build.log'})", flush=True)

    report = args.out / "pytest.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", f"--junitxml={report}"]
    if args.keyword:
        command += ["-k", args.keyword]
    # The whole list is about 1250 cases (about 45 minutes on an H200): with little time on the
    # GPU, run a subset (``--files`` or ``-k``).
    test_code, test_s = _run(command + ["--durations=15", *args.files], args.out / "pytest.log")
    print(f"pytest: exit {test_code} in {test_s:.0f} s (log: {args.out / 'pytest.log'})\n")
    if not report.exists():
        print((args.out / "pytest.log").read_text()[-4000:])
        return test_code or 1
    counts, failures = _outcomes(report)
    print(f"{'test module':<22}{'passed':>8}{'failed':>8}{'skipped':>9}")
    for module in sorted({module for module, _ in counts}):
        row = [counts[(module, outcome)] for outcome in ("passed", "failed", "skipped")]
        print(f"{module:<22}{row[0]:>8}{row[1]:>8}{row[2]:>9}")
    for line in failures[:25]:
        print(f"FAILED {line}")
    return test_code


if __name__ == "__main__":
    sys.exit(main())
