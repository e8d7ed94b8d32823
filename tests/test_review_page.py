"""The review page (``transfuse diff MODEL --html FILE``): every change shown, with the real file's
line numbers, in both views; replaced classes and the report's fusions and refusals on it."""

from __future__ import annotations

import html
import inspect
import re
from html.parser import HTMLParser

import torch
from torch import nn

import transfuse
from tests import toys
from transfuse.rewriter.apply import rewrites_of
from transfuse.presentation.diffview import highlighted_lines, review_page
from transfuse.tiny import tiny_model


class _Rows(HTMLParser):
    """The page's diff rows per section and table kind: (class of the row or cell, cells' text)."""

    def __init__(self):
        super().__init__()
        self.section = None
        self.table = None
        self.rows: dict[tuple[str, str], list[tuple[list[str], list[str]]]] = {}
        self._row = None
        self._cell = None
        self.ids: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.section = attrs["id"]
            self.ids.append(attrs["id"])
        elif tag == "table" and "diff" in attrs.get("class", ""):
            self.table = attrs["class"].split()[1]
        elif tag == "tr" and self.table:
            self._row = ([attrs.get("class", "")], [])
        elif tag == "td" and self._row is not None:
            self._row[0].append(attrs.get("class", ""))
            self._cell = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row[1].append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.setdefault((self.section, self.table), []).append(self._row)
            self._row = None
        elif tag == "table":
            self.table = None


def _parse(page: str) -> _Rows:
    parser = _Rows()
    parser.feed(page)
    return parser


def test_highlighting_keeps_every_character_and_marks_python():
    source = inspect.getsource(toys.WqWkWvAttention) + 's = "<b>&"  # a comment\nf"{x!r} {y}"\n'
    lines = highlighted_lines(source)
    assert [html.unescape(re.sub(r"<[^>]+>", "", line)) for line in lines] == source.splitlines()
    joined = "\n".join(lines)
    assert '<span class="k">def</span>' in joined and '<span class="k">self</span>' in joined
    assert '<span class="c"># a comment</span>' in joined and "&lt;b&gt;&amp;" in joined
    assert highlighted_lines('def f():\n    """<open') == ["def f():", '    &quot;&quot;&quot;&lt;open']  # untokenizable


def test_rewritten_lines_carry_the_real_files_numbers_in_both_views():
    model = transfuse.rewrite(tiny_model("llama"))
    page = review_page(model, "llama")
    rows = _parse(page)
    (rewrite,) = [r for r in rewrites_of(model) if r.cls.__name__ == "LlamaAttention"]
    old, new = rewrite.original.file.text.splitlines(), rewrite.edited_file_text().splitlines()
    anchor = "LlamaAttention-forward"
    unified = [cells for kind, cells in rows.rows[(anchor, "unified")] if kind[0] != "hunk"]
    removed = [(int(c[0]), c[3]) for c in unified if c[2] == "-"]
    added = [(int(c[1]), c[3]) for c in unified if c[2] == "+"]
    assert removed and added
    assert all(old[n - 1] == text for n, text in removed)
    assert all(new[n - 1] == text for n, text in added)
    assert any("self.qkv_proj(" in text for _, text in added)
    assert any("self.q_proj(" in text for _, text in removed)
    # the side-by-side view shows the same removals and additions, in the same places
    split = [(kind, cells) for kind, cells in rows.rows[(anchor, "split")] if kind[0] != "hunk"]
    left = [(int(c[0]), c[1]) for kind, c in split if "del" in kind[1]]
    right = [(int(c[2]), c[3]) for kind, c in split if "add" in kind[3]]
    assert left == removed and right == added
    assert "transformers/models/llama/modeling_llama.py" in page and "site-packages" not in page


def test_every_rewrite_and_replacement_has_a_section_in_the_contents():
    model = transfuse.rewrite(tiny_model("qwen3_moe"))
    page = review_page(model, "qwen3_moe")
    rows = _parse(page)
    report = transfuse.report(model)
    expected = {f"{r.cls.__name__}-{r.method_name}" for r in rewrites_of(model)}
    assert expected <= set(rows.ids)
    for anchor in rows.ids:
        assert f'href="#{anchor}"' in page
    # the MoE block is shown as its emitted form: the plan on the class, the forward calling moe_block
    added = [c[3] for kind, c in rows.rows[("Qwen3MoeSparseMoeBlock-forward", "unified")] if kind[0] == "add"]
    assert any("_transfuse_moe = MoEPlan(" in line for line in added)
    assert any("return moe_block(self, hidden_states, self._transfuse_moe, top_k=self.gate.top_k)" in line for line in added)
    assert f"<b>{len(report.fusions)} fusions</b>" in page
    for kind in {f.kind for f in report.fusions}:
        assert f"<td>{kind}</td>" in page


class _HalfFused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fused = toys.Wrapper(toys.WqWkWvAttention())
        self.refused = toys.Wrapper(toys.ProjectionUsedTwice())

    def forward(self, x):
        return self.fused(x) + self.refused(x)


def test_refusals_are_listed_with_their_tags_and_a_model_with_nothing_to_show_says_so():
    torch.manual_seed(0)
    model = _HalfFused()
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    report = transfuse.report(model)
    assert report.fusions and report.skipped
    page = review_page(model, "toy")
    refused = page.split("<h3>Refused</h3>")[1].split("</table>")[0]
    for skip in report.skipped:
        assert f'<span class="tag">{skip.tag}</span>' in refused and html.escape(skip.reason) in refused
    nothing = review_page(transfuse.rewrite(tiny_model("llama"), fusions=[]), "llama")
    assert "No class was rewritten or replaced." in nothing and "<b>0 fusions</b>" in nothing


def test_a_replacement_without_an_emitted_form_shows_the_layer_and_the_forward_as_written():
    torch.manual_seed(0)
    model = toys.TinyMoEModel(toys.ModuleListMoE())  # per-expert modules: stacked, no emitted form
    transfuse.rewrite(model, example_inputs=(torch.randn(2, 5, 32),))
    page = review_page(model, "toy")
    rows = _parse(page)
    section = page.split('<section id="ModuleListMoE">')[1].split("</section>")[0]
    (fused,) = [m for m in model.modules() if type(m).__name__ == "MoE"]
    assert html.escape(repr(fused)) in section
    written = [c[3] for _, c in rows.rows[("ModuleListMoE", "unified")]]
    assert written[0].strip().startswith("def forward(") and any("index_add_" in line for line in written)
