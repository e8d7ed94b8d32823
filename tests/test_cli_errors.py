"""The command line on bad checkpoints: each is one line on stderr that names the file and the
problem (exit 1); transformers' load report is shown as stock prints it; missing weights are an
error unless allowed; a checkpoint's own code runs only with ``--trust-remote-code``.

The CLI runs in this process (``transfuse.cli.main``); transformers' load report goes through its
logging handler, which writes to the process's stderr, so the output is read with ``capfd``."""

from __future__ import annotations

import json
import logging
import os
import struct
import warnings

import pytest
import torch

from transfuse import cli
from transfuse.tiny import tiny_config, tiny_model

UP = "model.layers.0.mlp.up_proj.weight"


def run_cli(capfd, *args: str):
    """(exit code, stdout, stderr) of ``main(args)``; the global settings ``main`` makes (warning
    filters, transformers' verbosity and progress bars, log levels and handlers) are put back."""
    from transformers.utils import logging as hf_logging

    verbosity, bars, level = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), cli.log.level
    handlers = logging.root.handlers[:]
    capfd.readouterr()
    try:
        with warnings.catch_warnings():
            code = cli.main(list(args))
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        cli.log.setLevel(level)
        logging.root.handlers[:] = handlers
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny llama checkpoint and its state dict."""
    path = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(path)
    from safetensors.torch import load_file

    return path, load_file(path / "model.safetensors")


def _copy(checkpoint, target, state=None):
    from safetensors.torch import save_file

    path, original = checkpoint
    target.mkdir()
    (target / "config.json").write_text((path / "config.json").read_text())
    save_file(original if state is None else state, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _rewrite_bytes(path, edit):
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))


def _truncated(ckpt, tmp_path):
    out = _copy(ckpt, tmp_path / "ck")
    _rewrite_bytes(out / "model.safetensors", lambda d: d[: len(d) // 2])
    return out, "model.safetensors"


def _corrupt_header(ckpt, tmp_path):
    out = _copy(ckpt, tmp_path / "ck")
    _rewrite_bytes(out / "model.safetensors", lambda d: d[:8] + b"x" * 32 + d[40:])
    return out, "model.safetensors"


def _huge_header_length(ckpt, tmp_path):
    out = _copy(ckpt, tmp_path / "ck")
    _rewrite_bytes(out / "model.safetensors", lambda d: struct.pack("<Q", 2**62) + d[8:])
    return out, "model.safetensors"


def _heads_not_dividing(ckpt, tmp_path):
    out = _copy(ckpt, tmp_path / "ck")
    config = json.loads((out / "config.json").read_text())
    config["num_attention_heads"] = 5  # hidden size 64
    (out / "config.json").write_text(json.dumps(config))
    return out, "config.json"


def _wrong_shape(ckpt, tmp_path):
    state = dict(ckpt[1])
    state[UP] = torch.zeros(state[UP].shape[0] + 1, state[UP].shape[1])
    return _copy(ckpt, tmp_path / "ck", state), "model.safetensors"


BAD = {
    "truncated safetensors": (_truncated, "truncated or corrupt"),
    "corrupt safetensors header": (_corrupt_header, "truncated or corrupt"),
    "header length 2^62": (_huge_header_length, "truncated or corrupt"),
    "heads not dividing the hidden size": (_heads_not_dividing, "is not a multiple of the number of attention heads"),
    "wrong weight shape": (_wrong_shape, f"{UP} has shape (129, 64) in the checkpoint; the model's is (128, 64)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_one_line_naming_the_file_and_the_problem(case, llama_checkpoint, tmp_path, capfd):
    make, problem = BAD[case]
    directory, name = make(llama_checkpoint, tmp_path)
    code, out, err = run_cli(capfd, "explain", str(directory), "-q")
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    ours = [line for line in lines if line.startswith("transfuse: error:")]
    assert ours == [lines[-1]], err  # transformers' load report (a mismatch) may come first
    assert os.path.join(str(directory), name) in lines[-1] and problem in lines[-1], lines[-1]
    if case != "wrong weight shape":
        assert len(lines) == 1, err


def test_a_truncated_gguf_is_one_line_naming_the_file(smollm2_gguf, tmp_path, capfd):
    for size in (10, 5000):
        path = tmp_path / f"cut{size}.gguf"
        with open(smollm2_gguf, "rb") as f:
            path.write_bytes(f.read(size))
        code, out, err = run_cli(capfd, "explain", str(path), "-q")
        assert code == 1 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"transfuse: error: {path}: ") and "truncated or corrupt" in err, err


def test_the_load_report_is_shown_and_missing_weights_are_an_error_unless_allowed(llama_checkpoint, tmp_path, capfd):
    state = dict(llama_checkpoint[1])
    del state[UP]
    missing = _copy(llama_checkpoint, tmp_path / "missing", state)
    code, out, err = run_cli(capfd, "explain", str(missing), "-q")
    assert code == 1 and "Traceback" not in err, err
    assert "LOAD REPORT" in err and f"{UP} | MISSING" in err  # transformers' own report, as stock prints it
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"transfuse: error: {missing}") and UP in last and "--allow-missing-weights" in last, last
    code, out, err = run_cli(capfd, "explain", str(missing), "-q", "--allow-missing-weights")
    assert code == 0 and "LOAD REPORT" in err and "MISSING" in err, err
    assert "fusions" in out

    state = {**llama_checkpoint[1], "model.layers.0.mlp.extra.weight": torch.ones(3)}
    unexpected = _copy(llama_checkpoint, tmp_path / "unexpected", state)
    code, out, err = run_cli(capfd, "explain", str(unexpected), "-q")
    assert code == 0 and "model.layers.0.mlp.extra.weight | UNEXPECTED" in err, err


def _remote_code_checkpoint(llama_checkpoint, directory, marker):
    """A checkpoint whose config and model classes are its own code (a llama under another
    name); importing that code writes ``marker``."""
    _copy(llama_checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(
        model_type="remote_llama",
        architectures=["RemoteForCausalLM"],
        auto_map={"AutoConfig": "configuration_remote.RemoteConfig", "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"},
    )
    (directory / "config.json").write_text(json.dumps(config))
    ran = f"open({str(marker)!r}, 'w').close()\n"
    (directory / "configuration_remote.py").write_text(
        f"from transformers import LlamaConfig\n{ran}\n\nclass RemoteConfig(LlamaConfig):\n    model_type = 'remote_llama'\n"
    )
    (directory / "modeling_remote.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteConfig\n"
        f"{ran}\n\nclass RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n"
    )
    return directory


def test_a_checkpoints_own_code_runs_only_with_trust_remote_code(llama_checkpoint, tmp_path, capfd, monkeypatch):
    import io

    marker = tmp_path / "the code ran"
    directory = _remote_code_checkpoint(llama_checkpoint, tmp_path / "remote", marker)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # an answer to any prompt
    code, out, err = run_cli(capfd, "explain", str(directory), "-q")
    assert code == 1 and not marker.exists(), (out, err)
    assert "Do you wish to run the custom code" not in out + err  # no prompt
    assert len(err.strip().splitlines()) == 1 and str(directory) in err and "--trust-remote-code" in err, err
    assert "not a causal language model" not in err
    code, out, err = run_cli(capfd, "explain", str(directory), "-q", "--trust-remote-code")
    assert code == 0 and marker.exists(), err
    assert "RemoteForCausalLM" in out and "fusions" in out
