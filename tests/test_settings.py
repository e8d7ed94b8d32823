"""The TRANSFUSE_* switches: documented values only, any other is an error that names the variable
and its values, raised by ``rewrite``, the drop-in loader and the CLI before any work (never
swallowed by verification), and never by import."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import transfuse
from tests.test_cli import run_here
from transfuse import ops, settings
from transfuse.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]

BAD = {
    "TRANSFUSE_FORCE_NATIVE": ("yes", "true"),
    "TRANSFUSE_STEP_GRAPHS": ("maybe", "off"),
    "TRANSFUSE_DECODE_GRAPHS": ("no", "off"),
    "TRANSFUSE_TRITON_FAST_LAUNCH": ("fast", "off"),
    "TRANSFUSE_PROGRESS": ("2", "on"),
    "TRANSFUSE_VERBOSITY": ("loud", "warning"),
    "TRANSFUSE_COMPILE_MODE": ("fast", "library"),
    "TRANSFUSE_OP_PRIORITY": ("rms_norm", "op=provider"),
    "TRANSFUSE_REFERENCE_BYTES": ("abc", "bytes"),
    "TRANSFUSE_CSRC": ("/no/such/directory", "directory"),
}


@pytest.fixture
def env(monkeypatch):
    """monkeypatch's setenv, with the ops' cached provider orders forgotten before and after."""
    ops.refresh()
    yield monkeypatch
    monkeypatch.undo()
    ops.refresh()


@pytest.mark.parametrize("value, native", [("1", True), ("true", True), ("ON", True), (" On ", True), ("0", False), ("false", False), ("FALSE", False), ("off", False), ("", False)])
def test_a_flag_takes_its_documented_values(env, value, native):
    env.setenv("TRANSFUSE_FORCE_NATIVE", value)
    ops.refresh()
    assert (ops.priority("rms_norm") == ("native",)) is native


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_value_stops_rewrite_before_any_work_naming_the_variable_and_its_values(env, name):
    value, allowed = BAD[name]
    model = tiny_model("llama")
    env.setenv(name, value)
    with pytest.raises(ValueError) as caught:
        transfuse.rewrite(model)
    message = str(caught.value)
    assert name in message and repr(value) in message and allowed in message, message
    assert "\n" not in message
    with pytest.raises(ValueError, match="has not been rewritten"):
        transfuse.report(model)


def test_an_unknown_transfuse_variable_is_an_error_naming_the_known_ones(env):
    env.setenv("TRANSFUSE_FORCE_NATVE", "1")
    with pytest.raises(ValueError, match="TRANSFUSE_FORCE_NATVE is not a transfuse setting.*TRANSFUSE_FORCE_NATIVE"):
        settings.validate()


def test_the_drop_in_loader_refuses_a_malformed_priority_before_loading(env, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path)
    loads = []
    load = AutoModelForCausalLM.from_pretrained.__func__
    env.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a) or load(cls, *a, **k)))
    env.setenv("TRANSFUSE_OP_PRIORITY", "rms_norm")
    with pytest.raises(ValueError, match="TRANSFUSE_OP_PRIORITY='rms_norm'"):
        transfuse.from_pretrained(tmp_path)
    assert loads == []


def test_the_cli_refuses_a_bad_value_in_one_line(env):
    env.setenv("TRANSFUSE_VERBOSITY", "loud")
    result = run_here("explain", "llama", "-q")
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("transfuse: error: TRANSFUSE_VERBOSITY='loud'") and "warning" in result.stderr


def test_import_does_not_fail_on_a_bad_value():
    script = "import transfuse.rewriter.checking, transfuse.ops.triton.launch; print('imported')"
    env = {"TRANSFUSE_REFERENCE_BYTES": "abc", "TRANSFUSE_TRITON_FAST_LAUNCH": "fast", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr


def test_a_read_parses_each_value_once(env, monkeypatch):
    from transfuse.ops import graphs

    parsed = []
    switch = settings.SWITCHES["TRANSFUSE_DECODE_GRAPHS"]
    counting = dataclasses.replace(switch, parse=lambda text: parsed.append(text) or switch.parse(text))
    monkeypatch.setitem(settings.SWITCHES, switch.name, counting)
    monkeypatch.setattr(settings, "_PARSED", {})
    env.setenv("TRANSFUSE_DECODE_GRAPHS", "on")
    assert all(graphs.enabled() for _ in range(1000))
    env.setenv("TRANSFUSE_DECODE_GRAPHS", "off")
    assert not any(graphs.enabled() for _ in range(1000))
    assert parsed == ["on", "off"]


def test_every_switch_is_documented_and_read_through_settings_only():
    documented = set(re.findall(r"`(TRANSFUSE_[A-Z_]+)", (ROOT / "docs" / "environment.md").read_text()))
    assert documented == set(settings.SWITCHES)
    for path in (ROOT / "transfuse").rglob("*.py"):
        if path.name == "settings.py":
            continue
        text = path.read_text()
        assert not re.search(r"environ\b[^\n]*TRANSFUSE_|getenv\([^\n]*TRANSFUSE_", text), path
