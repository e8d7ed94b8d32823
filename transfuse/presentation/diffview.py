"""The diff of a rewrite as text (unified, optionally coloured), and as a review page in HTML.

The review page is one self-contained file (no network): a header with the model, the versions
and the rewrite's report (fusions made, fusions refused with their reasons, notes), a table of
contents, then one section per rewritten class, unified or side by side (a toggle), with Python
highlighted and the real file's line numbers. Classes whose instances were replaced (norms, MoE
blocks) are shown as what they become: the forward an emitted file gives them, or, where the
fusion has no emitted form, the layer that takes their place.
"""

from __future__ import annotations

import builtins
import difflib
import html
import io
import keyword
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from itertools import zip_longest

from torch import nn

from ..rewriter.source import MethodRewrite

__all__ = ["colour", "review_page", "summary"]

_COLOURS = {"+": "\033[32m", "-": "\033[31m", "@": "\033[36m"}
_BOLD, _RESET = "\033[1m", "\033[0m"


def colour(text: str) -> str:
    """ANSI colours for a unified diff: additions green, removals red, hunk headers cyan."""
    lines = []
    for line in text.splitlines():
        if line.startswith(("+++", "---")):
            lines.append(f"{_BOLD}{line}{_RESET}")
        elif line[:1] in _COLOURS:
            lines.append(f"{_COLOURS[line[0]]}{line}{_RESET}")
        else:
            lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")


def _counts(rewrite: MethodRewrite) -> tuple[int, int]:
    added = removed = 0
    for line in rewrite.diff(context=0).splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def summary(rewrites: list[MethodRewrite]) -> list[str]:
    """One line per rewritten method: class, method, fusions, lines added and removed."""
    lines = []
    for rewrite in rewrites:
        added, removed = _counts(rewrite)
        lines.append(
            f"{rewrite.cls.__name__}.{rewrite.method_name} ({', '.join(rewrite.kinds)}): +{added} -{removed} lines"
        )
    return lines


# ---- Python highlighting ------------------------------------------------------------------------

_BUILTINS = set(dir(builtins))


def _token_class(token: tokenize.TokenInfo) -> str | None:
    if token.type == tokenize.COMMENT:
        return "c"
    if token.type == tokenize.STRING or token.type in (getattr(tokenize, "FSTRING_START", -1),
                                                        getattr(tokenize, "FSTRING_MIDDLE", -1),
                                                        getattr(tokenize, "FSTRING_END", -1)):  # fmt: skip
        return "s"
    if token.type == tokenize.NUMBER:
        return "n"
    if token.type == tokenize.NAME:
        if keyword.iskeyword(token.string) or token.string in ("self", "cls"):
            return "k"
        if token.string in _BUILTINS:
            return "b"
    return None


def highlighted_lines(text: str) -> list[str]:
    """Each line of Python ``text`` as escaped HTML with spans for keywords, strings, numbers,
    comments and builtins (plain, escaped lines where the text does not tokenize)."""
    lines = text.splitlines()
    spans: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            kind = _token_class(token)
            if kind is None:
                continue
            (first, start), (last, end) = token.start, token.end
            for number in range(first, last + 1):
                if number - 1 < len(lines):
                    spans[number].append((start if number == first else 0, end if number == last else len(lines[number - 1]), kind))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [html.escape(line) for line in lines]
    out = []
    for number, line in enumerate(lines, start=1):
        pieces, at = [], 0
        for start, end, kind in sorted(spans.get(number, ())):
            if start < at:
                continue
            pieces.append(html.escape(line[at:start]))
            pieces.append(f'<span class="{kind}">{html.escape(line[start:end])}</span>')
            at = end
        pieces.append(html.escape(line[at:]))
        out.append("".join(pieces))
    return out


# ---- one section per class ----------------------------------------------------------------------


def _shown_path(filename: str) -> str:
    """A source file as the page names it: from the package down where it is installed
    (``transformers/models/llama/modeling_llama.py``), else as it is."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


@dataclass
class _Section:
    anchor: str
    title: str
    subtitle: str
    body: str
    where: str = ""  # the file, shown in the section (the contents show only the subtitle)


_UNIFIED_COLUMNS = '<col class="num"><col class="num"><col class="mark"><col>'


def _diff_tables(old: str, new: str, context: int = 3) -> tuple[str, str]:
    """(unified, side by side) tables of the change from ``old`` to ``new``, real line numbers on
    the old side, the new text's on the other."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    old_html, new_html = highlighted_lines(old), highlighted_lines(new)
    matcher = difflib.SequenceMatcher(a=old_lines, b=new_lines, autojunk=False)
    unified, split = [], []
    for group in matcher.get_grouped_opcodes(context):
        first, last = group[0], group[-1]
        header = f"@@ {first[1] + 1}-{last[2]} → {first[3] + 1}-{last[4]} @@"
        unified.append(f'<tr class="hunk"><td colspan="4">{header}</td></tr>')
        split.append(f'<tr class="hunk"><td colspan="4">{header}</td></tr>')
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                for i, j in zip(range(i1, i2), range(j1, j2)):
                    unified.append(_row(i + 1, j + 1, " ", old_html[i], "ctx"))
                    split.append(_pair(i + 1, old_html[i], "ctx", j + 1, new_html[j], "ctx"))
                continue
            for i in range(i1, i2):
                unified.append(_row(i + 1, "", "-", old_html[i], "del"))
            for j in range(j1, j2):
                unified.append(_row("", j + 1, "+", new_html[j], "add"))
            for i, j in zip_longest(range(i1, i2), range(j1, j2)):
                split.append(
                    _pair(
                        i + 1 if i is not None else "", old_html[i] if i is not None else "", "del" if i is not None else "empty",
                        j + 1 if j is not None else "", new_html[j] if j is not None else "", "add" if j is not None else "empty",
                    )  # fmt: skip
                )
    table = '<table class="diff {kind}"><colgroup>{cols}</colgroup>{rows}</table>'
    return (
        table.format(kind="unified", cols=_UNIFIED_COLUMNS, rows="".join(unified)),
        table.format(kind="split", cols='<col class="num"><col class="half"><col class="num"><col class="half">', rows="".join(split)),
    )


def _row(old_number, new_number, mark: str, code: str, kind: str) -> str:
    return (
        f'<tr class="{kind}"><td class="num">{old_number}</td><td class="num">{new_number}</td>'
        f'<td class="mark">{mark}</td><td class="code">{code}</td></tr>'
    )


def _pair(old_number, old_code, old_kind, new_number, new_code, new_kind) -> str:
    return (
        f'<tr><td class="num {old_kind}">{old_number}</td><td class="code {old_kind}">{old_code}</td>'
        f'<td class="num {new_kind}">{new_number}</td><td class="code {new_kind}">{new_code}</td></tr>'
    )


def _rewrite_section(rewrite: MethodRewrite, what: str) -> _Section:
    unified, split = _diff_tables(rewrite.original.file.text, rewrite.edited_file_text())
    added, removed = _counts(rewrite)
    name = f"{rewrite.cls.__name__}.{rewrite.method_name}"
    return _Section(
        anchor=f"{rewrite.cls.__name__}-{rewrite.method_name}",
        title=name,
        subtitle=f"{what} ({', '.join(rewrite.kinds)}): +{added} −{removed} lines",
        where=html.escape(_shown_path(rewrite.original.filename)),
        body=f'<div class="view unified-view">{unified}</div><div class="view split-view">{split}</div>',
    )


def _replacement_section(cls: type, fuser, layer: nn.Module | None) -> _Section:
    """A replaced class with no emitted form: its forward as written, and the layer taking its place."""
    from ..rewriter.source import method_source
    from ..rewriter.tracer import unwrapped_forward

    source = method_source(unwrapped_forward(cls))
    code = ""
    if source is not None:
        text = source.file.text.splitlines()[source.line() - 1 : source.file.positions[source.node].end.line]
        first = source.line()
        rows = "".join(_row(first + k, "", "", line, "ctx") for k, line in enumerate(highlighted_lines("\n".join(text))))
        code = (
            f"<p>The forward as written ({html.escape(_shown_path(source.filename))}):</p>"
            f'<table class="diff unified"><colgroup>{_UNIFIED_COLUMNS}</colgroup>{rows}</table>'
        )
    replaced_by = html.escape(repr(layer)) if layer is not None else "(no instance left to show)"
    return _Section(
        anchor=cls.__name__,
        title=cls.__name__,
        subtitle=f"replaced ({fuser.kind}): every instance is now the fused layer below",
        where=html.escape(_shown_path(source.filename)) if source is not None else "",
        body=f"<p>Replaced by:</p><pre class=\"layer\">{replaced_by}</pre>{code}",
    )


# ---- the page -----------------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1f2328; background: #fff; }
header, main, nav { max-width: 1240px; margin: 0 auto; padding: 0 16px; }
header { border-bottom: 1px solid #d0d7de; padding-bottom: 8px; }
h1 { font-size: 22px; margin: 16px 0 4px; } h2 { font-size: 17px; margin: 28px 0 2px; }
.meta, .sub { color: #59636e; font-size: 13px; } .sub { margin: 0 0 8px; }
table.report { border-collapse: collapse; margin: 6px 0 12px; width: 100%; font-size: 13px; }
table.report th, table.report td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eaeef2; vertical-align: top; }
table.report th { background: #f6f8fa; }
.tag { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; color: #8250df; }
nav ol { columns: 2; font-size: 13px; } nav a { color: #0969da; text-decoration: none; }
.toggle { position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 1; border-bottom: 1px solid #eaeef2; }
.toggle button { font: inherit; padding: 3px 10px; border: 1px solid #d0d7de; background: #f6f8fa; border-radius: 6px; cursor: pointer; }
.toggle button.on { background: #0969da; color: #fff; border-color: #0969da; }
table.diff { border-collapse: collapse; width: 100%; table-layout: fixed; font: 12px/1.5 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; border: 1px solid #d0d7de; }
table.diff col.num { width: 48px; } table.diff col.mark { width: 16px; } table.diff col.half { width: calc(50% - 48px); }
td.num { color: #8c959f; text-align: right; padding: 0 6px; user-select: none; vertical-align: top; }
td.mark { color: #59636e; user-select: none; vertical-align: top; }
td.code { white-space: pre-wrap; overflow-wrap: anywhere; padding: 0 6px; vertical-align: top; }
tr.hunk td { background: #ddf4ff; color: #59636e; padding: 2px 6px; }
tr.add td, td.add { background: #dafbe1; } tr.del td, td.del { background: #ffebe9; } td.empty { background: #f6f8fa; }
.k { color: #cf222e; } .s { color: #0a3069; } .n { color: #0550ae; } .c { color: #6e7781; font-style: italic; } .b { color: #8250df; }
pre.layer { background: #f6f8fa; border: 1px solid #d0d7de; padding: 8px; font-size: 12px; white-space: pre-wrap; }
body.split .unified-view, body:not(.split) .split-view { display: none; }
"""

_SCRIPT = """
function view(split) {
  document.body.classList.toggle('split', split);
  document.getElementById('unified').classList.toggle('on', !split);
  document.getElementById('split').classList.toggle('on', split);
}
"""


def _report_tables(report) -> str:
    from collections import Counter

    parts = []
    if report.not_rewritten:
        parts.append(f"<p><b>Not rewritten:</b> {html.escape(report.not_rewritten)}</p>")
    if report.fusions:
        groups: dict = {}
        for f in report.fusions:
            groups.setdefault((f.kind, f.cls, f.into), []).append(f.path or "&lt;model&gt;")
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{html.escape(c)}</td><td>{html.escape(i)}</td><td>{len(p)}</td>"
            f"<td>{html.escape(p[0])}</td></tr>"
            for (k, c, i), p in groups.items()
        )
        parts.append(
            '<h3>Fused</h3><table class="report"><tr><th>kind</th><th>class</th><th>into</th><th>count</th>'
            f"<th>first at</th></tr>{rows}</table>"
        )
    if report.skipped:
        rows = "".join(
            f"<tr><td>{html.escape(s.kind)}</td><td>{html.escape(s.cls)}</td><td>{html.escape(s.path or s.where or '')}</td>"
            f'<td><span class="tag">{html.escape(s.tag)}</span> {html.escape(s.reason)}</td></tr>'
            for s in report.skipped
        )
        parts.append(
            f'<h3>Refused</h3><table class="report"><tr><th>kind</th><th>class</th><th>where</th><th>reason</th></tr>{rows}</table>'
        )
    if report.notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>")
    counts = Counter(f.kind for f in report.fusions)
    headline = ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none"
    return f"<p><b>{len(report.fusions)} fusions</b> ({headline}), {len(report.skipped)} refused</p>" + "".join(parts)


def review_page(model: nn.Module, name: str) -> str:
    """The review page of a rewritten ``model`` (``name``: how the user named it)."""
    import torch
    import transformers

    from ..version import __version__
    from ..api import report as report_of
    from ..rewriter.apply import REPLACED_ATTR, rewrites_of
    from ..rewriter.emit import emitted_replacement

    report = report_of(model)
    sections = [_rewrite_section(r, "rewritten") for r in rewrites_of(model)]
    for cls, (fuser, found) in model.__dict__.get(REPLACED_ATTR, {}).items():
        rewrite = emitted_replacement(cls, fuser, found)
        if rewrite is not None:
            sections.append(_rewrite_section(rewrite, "replaced, as an emitted file writes it"))
        else:
            sections.append(_replacement_section(cls, fuser, _first_replacement(model, report, cls)))
    toc = "".join(f'<li><a href="#{s.anchor}">{html.escape(s.title)}</a> <span class="meta">{s.subtitle}</span></li>' for s in sections)
    body = "".join(
        f'<section id="{s.anchor}"><h2>{html.escape(s.title)}</h2><p class="sub">{s.subtitle} · {s.where}</p>{s.body}</section>'
        for s in sections
    ) or "<p>No class was rewritten or replaced.</p>"
    title = f"transfuse review: {name}"
    meta = (
        f"{html.escape(type(model).__name__)} · transfuse {__version__} · transformers {transformers.__version__} · "
        f"torch {torch.__version__}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>"
        f'<header><h1>{html.escape(title)}</h1><p class="meta">{meta}</p>{_report_tables(report)}</header>'
        f'<nav><h2>Contents</h2><ol>{toc}</ol></nav>'
        f'<main><div class="toggle"><button id="unified" class="on" onclick="view(false)">Unified</button> '
        f'<button id="split" onclick="view(true)">Side by side</button></div>{body}</main></body></html>\n'
    )


def _first_replacement(model: nn.Module, report, cls: type) -> nn.Module | None:
    """The fused layer now where the report says the first instance of ``cls`` was replaced."""
    path = next((f.path for f in report.fusions if f.cls == cls.__name__ and f.replaced == ("",) and f.path), None)
    return model.get_submodule(path) if path is not None else None
