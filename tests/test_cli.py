"""The command line, run as a subprocess: good input and bad."""

from __future__ import annotations

import subprocess
import sys

import transfuse


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transfuse", *args], capture_output=True, text=True, timeout=300)


def test_version():
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"transfuse {transfuse.__version__}"


def test_explain_a_model_type_prints_the_report():
    result = run("explain", "qwen3")
    assert result.returncode == 0, result.stderr
    assert "Qwen3RMSNorm" in result.stdout and "Qwen3Attention" in result.stdout and "Qwen3MLP" in result.stdout
    assert "13 fusions (gate_up 2, qkv 2, rms_norm 9)" in result.stdout
    assert "analysed" in result.stderr  # progress goes to stderr


def test_explain_shows_refusals_with_reasons():
    result = run("explain", "cohere", "-q")
    assert result.returncode == 0, result.stderr
    assert "rms_norm.mean-subtracted" in result.stdout
    assert result.stderr == ""


def test_unknown_model_type_is_a_one_line_error():
    result = run("explain", "not_a_model_type")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("transfuse: error: 'not_a_model_type' is not")
    assert "Traceback" not in result.stderr


def test_missing_directory_is_a_one_line_error(tmp_path):
    result = run("explain", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert "no such directory" in result.stderr and "Traceback" not in result.stderr


def test_directory_without_config_is_a_one_line_error(tmp_path):
    result = run("explain", str(tmp_path))
    assert result.returncode == 1
    assert "no config.json" in result.stderr and "Traceback" not in result.stderr
