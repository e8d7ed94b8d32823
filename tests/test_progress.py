"""Progress in transformers' conventions: bars after a delay, silenced by transformers' switches
or TRANSFUSE_PROGRESS=0; notes silenced by transformers' verbosity or TRANSFUSE_VERBOSITY."""

from __future__ import annotations

import logging

import pytest

import transfuse
from transfuse import progress
from transfuse.tiny import tiny_model


@pytest.fixture
def immediate_bars(monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(progress, "BAR_DELAY_S", 0.0)
    hf_logging.enable_progress_bar()
    yield hf_logging
    hf_logging.enable_progress_bar()


def test_a_rewrite_shows_bars_and_the_usual_switches_hide_them(immediate_bars, capsys, monkeypatch):
    transfuse.rewrite(tiny_model("llama"))
    shown = capsys.readouterr().err
    assert "transfuse: analysing" in shown and "transfuse: checking" in shown
    immediate_bars.disable_progress_bar()
    transfuse.rewrite(tiny_model("llama"))
    assert "transfuse:" not in capsys.readouterr().err
    immediate_bars.enable_progress_bar()
    monkeypatch.setenv("TRANSFUSE_PROGRESS", "0")
    transfuse.rewrite(tiny_model("llama"))
    assert "transfuse:" not in capsys.readouterr().err


def test_quick_work_shows_no_bar(capsys):
    list(progress.bar(range(3), total=3, desc="transfuse: quick"))
    assert "quick" not in capsys.readouterr().err


def test_a_long_first_item_shows_the_bar_while_it_runs_without_an_estimate(immediate_bars, capsys, monkeypatch):
    """The first check on a fresh GPU machine waits half a minute on Triton's compiler: the bar is
    drawn while that item runs (not only after it), with no estimate of the time left (which the
    first items' times would make read hours)."""
    import time

    monkeypatch.setattr(progress, "TICK_S", 0.02)
    during = []

    def items():
        time.sleep(0.3)
        during.append(capsys.readouterr().err)  # what was shown before the first item ended
        yield from range(3)

    assert list(progress.bar(items(), total=3, desc="transfuse: slow")) == [0, 1, 2]
    after = capsys.readouterr().err
    assert "transfuse: slow" in during[0] and "0/3" in during[0]
    assert during[0].count("transfuse: slow") >= 2  # redrawn while the item ran
    shown = during[0] + after
    assert "<" not in shown and "it/s" not in shown and "s/it" not in shown


def test_notes_follow_transformers_verbosity_and_the_environment(caplog, monkeypatch):
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    try:
        with caplog.at_level(logging.INFO, logger="transfuse"):
            hf_logging.set_verbosity_warning()
            progress.note("shown")
            hf_logging.set_verbosity_error()
            progress.note("hidden")
            monkeypatch.setenv("TRANSFUSE_VERBOSITY", "info")
            progress.note("shown again", logging.INFO)
    finally:
        hf_logging.set_verbosity(previous)
    assert [r.getMessage() for r in caplog.records] == ["shown", "shown again"]
