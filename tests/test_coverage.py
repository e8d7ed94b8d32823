"""The coverage sweep on its fixed CI subset (``benchmarks/coverage.py --ci``): every type that builds
and runs is rewritten, and none gives a wrong answer (logits beyond 1e-5 of their scale, or different
greedy tokens) or crashes inside transfuse; the heuristics that count opportunities find them where
the structure is known."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("coverage_sweep", ROOT / "benchmarks" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_sweep"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(coverage):
    return {t: coverage.run_type(t) for t in coverage.CI_TYPES}


def test_no_wrong_answer_and_no_crash_on_the_ci_subset(coverage, rows):
    summary = coverage.summarise(list(rows.values()))
    assert summary["compared"] >= 25, {t: r["status"] for t, r in rows.items()}
    assert not summary["wrong"], {t: rows[t].get("max_logit_diff") for t in summary["wrong"]}
    assert not summary["crashes"], {t: rows[t].get("error") for t in summary["crashes"]}
    # Types whose tiny configs needed latent attention's head count or a partial rotary width kept.
    repaired = ("deepseek_v32", "axk2", "gptj")
    assert all(rows[t]["status"] == "ok" for t in repaired), {t: rows[t]["status"] for t in repaired}


def test_opportunities_are_counted_by_structure(rows):
    # Two layers each: llama has two attention blocks with q/k/v and two GLU MLPs; mixtral's MLPs are
    # MoE blocks; gpt2's attention is already one projection (nothing to merge).
    # Rotary opportunities are call sites of rotary functions (transfuse.census): one per attention block.
    assert rows["llama"]["opportunities"] == {"rms_norm": 5, "qkv": 2, "gate_up": 2, "moe": 0, "rotary": 2}
    assert rows["mixtral"]["opportunities"]["moe"] == 2 and rows["mixtral"]["opportunities"]["gate_up"] == 0
    assert rows["gpt2"]["opportunities"] == {"rms_norm": 0, "qkv": 0, "gate_up": 0, "moe": 0, "rotary": 0}
    # MLA's low-rank pair (q_a_proj and kv_a_proj_with_mqa read the same hidden states) counts as qkv.
    assert rows["deepseek_v3"]["opportunities"]["qkv"] == 2


def test_the_report_accounts_for_every_opportunity(rows):
    """Every RMSNorm-like, q/k/v-like, gate/up-like and experts-like module the structure suggests, and
    every rotary call site, is fused or refused with a reason in the report: nothing is passed over in
    silence."""
    silent = {t: r["silent"] for t, r in rows.items() if r.get("silent")}
    assert not silent, silent
    assert sum(len(v) for r in rows.values() for v in r.get("where", {}).values()) > 100  # the check saw them


def test_every_opportunity_of_the_common_families_is_fused(rows):
    # bart: q, k, v on the self-attention path of its shared class; deepseek_v3: MLA's low-rank pair;
    # qwen3_next: the gated norms and the input projections of its linear attention.
    for model_type in ("llama", "qwen3", "mixtral", "qwen3_moe", "bart", "deepseek_v3", "qwen3_next"):
        row = rows[model_type]
        # At least every opportunity (bart also merges its cross-attention instances, which the
        # counting forward never calls).
        kinds = ("rms_norm", "qkv", "gate_up", "moe")
        complete = all(row["fused"][kind] >= row["opportunities"][kind] for kind in kinds)
        assert complete, (model_type, row["fused"], row["opportunities"], row["refusals"])
    for model_type in ("llama", "qwen3", "mixtral", "qwen3_moe"):  # every rotary call site, too
        assert rows[model_type]["fused"]["rotary"] == rows[model_type]["opportunities"]["rotary"] > 0


def test_the_table_reports_every_row(coverage, rows):
    summary = coverage.summarise(list(rows.values()))
    text = coverage._markdown(list(rows.values()), summary, "python benchmarks/coverage.py --ci", "versions")
    for model_type in rows:
        assert f"| {model_type} |" in text
    assert "wrong answers: 0; crashes: 0" in text


def test_a_mixture_is_counted_once_and_only_where_the_model_calls_it(coverage):
    """An attention module holding ``experts`` that hold ``*Experts`` children is one structure, not two;
    experts used only through methods other than their forward (``map``/``reduce`` around attention) are
    no block a mixture-of-experts fusion could take the place of; the sorted-rows MLP block is one."""
    import torch
    from torch import nn

    from tests.test_moe_loop_forms import MixtureOfAttention, RoutedSortedRowsMoE

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.attn = MixtureOfAttention()
            self.mlp = RoutedSortedRowsMoE()

        def forward(self, input_ids, use_cache=False):
            h = self.embed(input_ids)
            h = h + self.attn(h)
            return h + self.mlp(h)[0]

    model = TinyLM()
    counts, where = coverage.count_opportunities(model, torch.randint(0, 50, (2, 5)))
    assert counts["moe"] == 1 and where["moe"] == ["mlp"], where


class _SparseAttention(nn.Module):
    def __init__(self, q=None, k=None, v=None):
        super().__init__()
        self.q, self.k, self.v = q or nn.Linear(8, 8), k or nn.Linear(8, 8), v or nn.Linear(8, 8)

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x)


class _FullAttention(_SparseAttention):
    pass


class _SwapsItsAttention(nn.Module):
    """Replaces its attention on the first forward by one of another class holding the same
    projections, as big_bird's model does for short inputs."""

    def __init__(self):
        super().__init__()
        self.attn = _SparseAttention()

    def forward(self, x):
        if type(self.attn) is _SparseAttention:
            self.attn = _FullAttention(self.attn.q, self.attn.k, self.attn.v)
        return self.attn(x)


def test_a_refusal_is_looked_up_under_the_class_the_rewrite_saw(coverage):
    """A module the stock forward replaced is accounted under the class it had when built: a refusal
    of that class covers it; under the class the forward put there, nothing would."""
    from transfuse.rewriter.report import RewriteReport, SkipRecord

    model = _SwapsItsAttention()
    built = {path: type(m).__name__ for path, m in model.named_modules()}
    model(torch.randn(2, 8))
    report = RewriteReport(skipped=[SkipRecord("_SparseAttention", "qkv", "why", "qkv.partial-trace")])
    where = {"qkv": ["attn:k+q+v"]}
    assert coverage.silent_opportunities(model, where, report, (), built) == []
    assert coverage.silent_opportunities(model, where, report, ()) == ["qkv:attn:k+q+v"]
