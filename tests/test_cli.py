"""The command line: good input and bad. Runs that read the progress output, write files or
time things run as a subprocess (``python -m transfuse``); the one-line errors and the argument
parsing run ``transfuse.cli.main`` in this process (a subprocess costs 5-6 s of imports each)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings

import transfuse
from transfuse import cli


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transfuse", *args], capture_output=True, text=True, timeout=300)


def run_here(*args: str) -> subprocess.CompletedProcess:
    """``main(args)`` in this process, as ``run`` reports it; the global settings ``main``
    makes (warning filters, transformers' verbosity and progress bars, log levels and handlers)
    are put back afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, bars, level = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), cli.log.level
    handlers = logging.root.handlers[:]
    out, err = io.StringIO(), io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse's errors and --help
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        cli.log.setLevel(level)
        logging.root.handlers[:] = handlers
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_version():
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"transfuse {transfuse.__version__}"


def test_explain_a_model_type_prints_the_report():
    result = run("explain", "qwen3")
    assert result.returncode == 0, result.stderr
    assert "Qwen3RMSNorm" in result.stdout and "Qwen3Attention" in result.stdout and "Qwen3MLP" in result.stdout
    assert "17 fusions (add_rms_norm 2, gate_up 2, qkv 2, rms_norm 9, rotary 2)" in result.stdout
    assert "analysed" in result.stderr  # progress goes to stderr


def test_explain_shows_refusals_with_reasons():
    result = run("explain", "cohere", "-q")
    assert result.returncode == 0, result.stderr
    assert "rms_norm.mean-subtracted" in result.stdout
    assert result.stderr == ""


def test_unknown_model_type_is_a_one_line_error():
    result = run_here("explain", "not_a_model_type")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("transfuse: error: 'not_a_model_type' is not")
    assert "Traceback" not in result.stderr


def test_missing_directory_is_a_one_line_error(tmp_path):
    result = run_here("explain", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert "no such directory" in result.stderr and "Traceback" not in result.stderr


def test_directory_without_config_is_a_one_line_error(tmp_path):
    result = run_here("explain", str(tmp_path))
    assert result.returncode == 1
    assert "no config.json" in result.stderr and "Traceback" not in result.stderr


def test_demo_runs_checks_generation_and_times_in_turn():
    result = run("demo", "-q")
    assert result.returncode == 0, result.stderr
    assert "identical before and after" in result.stdout
    assert "original" in result.stdout and "rewritten" in result.stdout
    assert "fastest / median / slowest" in result.stdout
    # A claim of a difference only where the ranges do not overlap.
    assert "no difference measured" in result.stdout or "ranges do not overlap" in result.stdout


def test_diff_is_plain_when_piped_coloured_on_request_and_html_on_request(tmp_path):
    plain = run("diff", "llama", "-q")
    assert plain.returncode == 0, plain.stderr
    assert "+        # transfuse: q_proj, k_proj, v_proj run as one merged projection" in plain.stdout
    assert "\033[" not in plain.stdout
    coloured = run_here("diff", "llama", "-q", "--color", "always", "--html", str(tmp_path / "d.html"))
    assert "\033[32m+" in coloured.stdout
    page = (tmp_path / "d.html").read_text()
    assert page.startswith("<!DOCTYPE html") and "LlamaAttention" in page and "qkv_proj" in page


def test_emit_writes_a_directory_stock_transformers_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "emitted"
    result = run("emit", "llama", "--out", str(out), "-q")
    assert result.returncode == 0, result.stderr
    assert "trust_remote_code=True" in result.stdout
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)
    again = run_here("emit", "llama", "--out", str(out))  # (a one-line error: in this process)
    assert again.returncode == 1
    assert "already exists; pass --force" in again.stderr and "Traceback" not in again.stderr
    assert "force=True" not in again.stderr and "loading" not in again.stderr  # refused before any work
    assert run_here("emit", "llama", "--out", str(out), "--force", "-q").returncode == 0


def test_a_checkpoint_that_is_not_a_causal_lm_is_a_one_line_error(tmp_path):
    from transformers import AutoConfig, T5Model

    T5Model(AutoConfig.for_model("t5", d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)).save_pretrained(tmp_path)
    result = run_here("explain", str(tmp_path))
    assert result.returncode == 1
    assert "is not a causal language model" in result.stderr and "Traceback" not in result.stderr
    assert "is not a causal-LM model type" in run_here("explain", "t5").stderr


def test_missing_weights_are_a_one_line_error(tmp_path):
    from transfuse.tiny import tiny_config

    tiny_config("llama").save_pretrained(tmp_path)  # a config, no weights
    result = run_here("explain", str(tmp_path))
    assert result.returncode == 1
    assert "transfuse: error:" in result.stderr and "Traceback" not in result.stderr


def test_fusions_may_come_before_or_after_the_model_and_help_lists_the_kinds():
    for args in (("explain", "--fusions", "qkv", "rms_norm", "llama", "-q"), ("explain", "llama", "--fusions=qkv,rms_norm", "-q")):
        result = run_here(*args)
        assert result.returncode == 0, result.stderr
        assert "7 fusions (qkv 2, rms_norm 5)" in result.stdout
    bad = run_here("explain", "llama", "--fusions", "rmsnorm")
    assert bad.returncode == 2 and "unknown fusion kind 'rmsnorm'" in bad.stderr
    helped = run_here("explain", "--help")
    assert all(kind in helped.stdout for kind in ("rms_norm", "qkv", "gate_up", "moe", "linear_cross_entropy"))


def test_demo_of_an_unknown_or_non_causal_type_is_a_one_line_error():
    for name in ("not_a_model_type", "t5"):
        result = run_here("demo", name)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"transfuse: error: {name!r} is not a causal-LM model type") and "in all)" in line
        assert "(0 in all)" not in line


def _imported(importtime_log: str) -> set[str]:
    """The modules ``python -X importtime`` reported importing."""
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


def test_help_and_version_import_neither_torch_nor_transformers():
    for args in (("--help",), ("--version",), ("explain", "--help")):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "transfuse", *args], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        modules = _imported(result.stderr)
        assert "transfuse.cli" in modules  # the log is read right
        assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers")}, args
    assert "linear_cross_entropy" in result.stdout


def test_the_first_line_comes_before_torch_is_imported_and_a_hub_id_not_cached_says_so(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "transfuse", "explain", "nobody-here/no-such-model"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    lines = result.stderr.splitlines()
    first = lines.index("transfuse: loading nobody-here/no-such-model")
    # importtime writes a module's line as its import ends: the first of torch's modules to end.
    torch_at = next(i for i, line in enumerate(lines) if {m.split(".")[0] for m in _imported(line)} == {"torch"})
    assert first < torch_at
    assert result.returncode == 1
    (error,) = [line for line in lines if line.startswith("transfuse: error:")]
    assert error.startswith("transfuse: error: 'nobody-here/no-such-model' is not in the local Hugging Face cache")
    assert "downloaded nothing" in error and "hf download nobody-here/no-such-model" in error
    assert "connect" not in error and not list(tmp_path.rglob("*.json"))  # nothing was fetched


def test_the_clis_kinds_are_the_fusers():
    from transfuse.fusers import default_kinds, kinds

    assert list(cli.FUSION_KINDS) == kinds()
    assert [k for k in cli.FUSION_KINDS if k not in cli.OPT_IN_KINDS] == default_kinds()


def test_progress_bars_show_on_a_terminal_and_not_on_a_pipe_or_with_quiet(monkeypatch):
    from transformers.utils import logging as hf_logging

    seen = {}

    def spy(args):
        seen[args.quiet, terminal] = hf_logging.is_progress_bar_enabled()
        return 0

    monkeypatch.setattr(cli, "_explain", spy)
    for terminal in (True, False):
        monkeypatch.setattr(cli, "_is_terminal", lambda stream, terminal=terminal: terminal)
        for quiet in ((), ("-q",)):
            hf_logging.enable_progress_bar()
            assert run_here("explain", "llama", *quiet).returncode == 0
    assert seen == {(False, True): True, (True, True): False, (False, False): False, (True, False): False}


def test_a_submodule_is_an_attribute_of_the_package_before_anything_loads():
    """``import transfuse`` loads lazily; ``transfuse.fusers`` (a submodule, not a public name) still
    answers in a fresh process, as ``from transfuse import fusers`` does."""
    code = (
        "import sys, transfuse\n"
        "assert 'torch' not in sys.modules\n"
        "print(transfuse.fusers.default_kinds()[0], transfuse.ops.get_op('rms_norm').name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["rms_norm", "rms_norm"]
