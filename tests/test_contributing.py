"""The recipe in ``CONTRIBUTING.md``: its skeleton fuser, copied as a newcomer would, fuses what it
says and refuses what it cannot prove; and every fuser names the record its ``match`` finds.

The skeleton joins the fusers the way the recipe says (one more entry in ``FUSERS``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import transfuse
import transfuse.fusers as fusers
from transfuse.rewriter.fusion import Fuser

RECIPE = Path(__file__).resolve().parent.parent / "CONTRIBUTING.md"


def _skeleton_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 1, "CONTRIBUTING.md should hold one Python block: the skeleton fuser"
    return blocks[0]


@pytest.fixture
def skeleton(tmp_path, monkeypatch):
    """The skeleton as ``transfuse/fusers/silu.py`` would be, added to ``FUSERS``."""
    path = tmp_path / "silu.py"
    path.write_text(_skeleton_source())
    spec = importlib.util.spec_from_file_location("transfuse.fusers.silu", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(fusers, "FUSERS", (*fusers.FUSERS, module.SiLUFuser()))
    return module


class HandWrittenSiLU(nn.Module):
    """→ fuses."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return x * torch.sigmoid(x)


class SiLUOnlyForSmallInputs(nn.Module):
    """A branch the trace took one way → refused (silu.control-flow)."""

    def forward(self, x):
        if x.dim() > 5:
            return x
        return x * torch.sigmoid(x)


class SiLUUnlessPlain(nn.Module):
    """A branch on its own attribute, which another instance may set otherwise → refused (silu.branch)."""

    def __init__(self):
        super().__init__()
        self.plain = False

    def forward(self, x):
        if self.plain:
            return x
        return x * torch.sigmoid(x)


class ScaledSiLU(nn.Module):
    """More than the formula → not a match."""

    def forward(self, x):
        return x * torch.sigmoid(x) * 2.0


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.fused, self.branchy, self.scaled = HandWrittenSiLU(), SiLUOnlyForSmallInputs(), ScaledSiLU()
        self.flagged = SiLUUnlessPlain()

    def forward(self, x):
        return self.flagged(self.scaled(self.branchy(self.fused(self.proj(x)))))


def test_the_skeleton_is_short():
    assert len(_skeleton_source().splitlines()) <= 60


def test_the_skeleton_fuser_fuses_and_refuses(skeleton):
    torch.manual_seed(0)
    model, x = _Toy(), torch.randn(3, 5, 16)
    original = copy.deepcopy(model)
    transfuse.rewrite(model, fusions=["silu"], example_inputs=(x,))
    assert type(model.fused) is nn.SiLU
    assert [type(m) for m in (model.branchy, model.scaled, model.flagged)] == [
        SiLUOnlyForSmallInputs, ScaledSiLU, SiLUUnlessPlain,
    ]  # fmt: skip
    report = transfuse.report(model)
    assert [(f.kind, f.into) for f in report.fusions] == [("silu", "SiLU")]
    assert sorted(s.tag for s in report.skipped) == ["silu.branch", "silu.control-flow"]
    HandWrittenSiLU.calls = 0
    with torch.no_grad():
        torch.testing.assert_close(model(x), original(x), rtol=1e-6, atol=1e-6)
    assert HandWrittenSiLU.calls == 1  # the original's; the rewritten model never calls it


@pytest.mark.parametrize("fuser", fusers.FUSERS, ids=lambda f: f.kind)
def test_every_fuser_names_the_record_its_match_finds(fuser):
    """``class XFuser(Fuser[XMatch])``: the record is a frozen dataclass (names and flags, no values)."""
    bases = [b for b in type(fuser).__orig_bases__ if issubclass(typing.get_origin(b) or object, Fuser)]
    assert bases, f"{type(fuser).__name__} does not say which record its match finds (Fuser[M])"
    (record,) = typing.get_args(bases[0])
    assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen
