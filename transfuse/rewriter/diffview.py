"""The diff of a rewrite as text (unified, optionally coloured) or as a side-by-side HTML page."""

from __future__ import annotations

import difflib
import html

from .source import MethodRewrite

__all__ = ["colour", "html_page", "summary"]

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


def summary(rewrites: list[MethodRewrite]) -> list[str]:
    """One line per rewritten method: class, method, fusions, lines added and removed."""
    lines = []
    for rewrite in rewrites:
        added = removed = 0
        for line in rewrite.diff(context=0).splitlines():
            if line.startswith("+") and not line.startswith("+++"):
                added += 1
            elif line.startswith("-") and not line.startswith("---"):
                removed += 1
        lines.append(
            f"{rewrite.cls.__name__}.{rewrite.method_name} ({', '.join(rewrite.kinds)}): +{added} -{removed} lines"
        )
    return lines


def html_page(rewrites: list[MethodRewrite], title: str = "transfuse diff") -> str:
    """A self-contained page with one side-by-side table per rewritten method."""
    differ = difflib.HtmlDiff(wrapcolumn=100)
    tables = []
    for rewrite in rewrites:
        table = differ.make_table(
            rewrite.original.file.text.splitlines(),
            rewrite.edited_file_text().splitlines(),
            fromdesc=html.escape(rewrite.original.filename),
            todesc=html.escape(f"rewritten: {rewrite.cls.__name__}.{rewrite.method_name} ({', '.join(rewrite.kinds)})"),
            context=True,
            numlines=3,
        )
        tables.append(f"<h2>{html.escape(rewrite.cls.__name__)}</h2>\n{table}")
    page = differ.make_file([], [], context=True)
    head, _, tail = page.partition("<body>")
    body = "\n".join(tables) if tables else "<p>No source was rewritten.</p>"
    return f"{head.lstrip()}<body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body>\n</html>\n"
