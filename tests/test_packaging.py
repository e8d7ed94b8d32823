"""The sdist and the wheel: what they carry (the license, the CUDA sources as plain files, and in
the sdist the tests with everything they import), and tests that run from an unpacked sdist."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_SOURCES = {"bindings.cpp", "rms_norm.cu", "act_and_mul.cu", "common.cuh", "dtypes.h"}


def _build(kind: str, out: Path) -> Path:
    code = f"import setuptools.build_meta as b; print(b.build_{kind}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    return _build("sdist", out), _build("wheel", out)


@pytest.mark.slow
def test_the_wheel_carries_the_package_its_cuda_sources_and_the_license(built):
    _, wheel = built
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"transfuse/csrc/{name}" for name in CUDA_SOURCES} <= names
    assert "transfuse/ops/triton/rms_norm.py" in names and "transfuse/integrations/peft.py" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
def test_the_sdist_runs_its_own_tests(built, tmp_path):
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
        archive.extractall(tmp_path, filter="data")
    for needed in ("LICENSE", "constraints-ci.txt", "tests/__init__.py", "tests/conftest.py", "tests/toys.py",
                   "tests/fuzz.py", *(f"transfuse/csrc/{n}" for n in CUDA_SOURCES)):  # fmt: skip
        assert needed in names, needed
    assert not any(os.path.islink(p) for p in tmp_path.rglob("*"))
    root = next(tmp_path.iterdir())
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_tracer.py", "tests/test_rms_norm.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]
    imported = subprocess.run(
        [sys.executable, "-c", "import transfuse.ops.cuda.build as b; print(b.csrc_dir())"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert imported.stdout.strip() == str(root / "transfuse" / "csrc")
