"""What a rewrite did: the fusions made, the ones refused and why, and how it was verified."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..ops.conformance import Verdict
from .fusion import Refusal

__all__ = ["FusionRecord", "RewriteReport", "SkipRecord"]


@dataclass(frozen=True)
class FusionRecord:
    """One fusion: at ``path`` (qualified module name), an instance of ``cls`` had ``replaced``
    (child names, or ``""`` for itself) replaced by a ``into``."""

    path: str
    cls: str
    kind: str
    replaced: tuple[str, ...]
    into: str
    check: str = ""  # how it was verified, or why it was not
    claimed: tuple[str, ...] = ()  # children (dotted) the fused op computes in full (a mixture's router and experts)


@dataclass(frozen=True)
class SkipRecord:
    """A fusion not made: for the whole class (``path`` None) or for one instance."""

    cls: str
    kind: str
    reason: str
    tag: str
    where: str | None = None
    path: str | None = None

    @classmethod
    def of(cls, class_name: str, kind: str, refusal: Refusal, path: str | None = None) -> SkipRecord:
        return cls(class_name, kind, refusal.reason, refusal.tag, refusal.where, path)


@dataclass
class RewriteReport:
    fusions: list[FusionRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Why nothing was rewritten (the probe could not run), else None.
    not_rewritten: str | None = None
    # "verified", or "unverified: <why>" (only when the caller asked, or on the meta device).
    verification: str = "verified"
    # The providers of the ops the fused modules call, judged against each op's native definition
    # at every shape class (``transfuse.ops.conformance``); a failed one is not dispatched.
    providers: list[Verdict] = field(default_factory=list)
    # In batch-invariant mode: the functions the model's forwards called that the mode does not
    # make invariant (name -> where first called), kept up to date as the model runs; None: off.
    batch_invariant: dict[str, str] | None = None

    def counts(self) -> dict[str, int]:
        """Number of fusions per kind."""
        return dict(Counter(f.kind for f in self.fusions))

    def add_skip(self, record: SkipRecord) -> None:
        if record not in self.skipped:
            self.skipped.append(record)

    def __str__(self) -> str:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.counts().items())) or "none"
        lines = [f"transfuse: {len(self.fusions)} fusions ({counts}), {len(self.skipped)} refused"]
        if self.not_rewritten is not None:
            lines.append(f"not rewritten: {self.not_rewritten}")
        elif self.fusions and self.verification != "verified":
            lines.append(self.verification)
        if self.fusions:
            lines += ["", "fused:"]
            groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
            for f in self.fusions:
                groups[(f.kind, f.cls, f.into)].append(f.path or "<model>")
            rows = [("kind", "class", "into", "count", "first at")]
            rows += [(k, c, i, str(len(p)), p[0]) for (k, c, i), p in groups.items()]
            lines += _table(rows)
        if self.skipped:
            lines += ["", "refused:"]
            rows = [("kind", "class", "where", "reason")]
            for s in self.skipped:
                where = s.path or s.where or ""
                if s.path and s.where:
                    where = f"{s.path} ({s.where})"
                rows.append((s.kind, s.cls, where, f"[{s.tag}] {s.reason}"))
            lines += _table(rows)
        if self.providers:
            lines += ["", "providers checked against the native ops (every shape class their dispatch tells apart):"]
            rows = [("op", "provider", "configuration", "verdict")]
            for v in self.providers:
                what = f"{v.config}{', with gradients' if v.grad else ''}"
                verdict = f"conforms at {len(v.classes)} classes: {', '.join(v.classes)}" if v.passed else f"[{v.tag}] {v.reason}"
                rows.append((v.op, v.provider, what, verdict))
            lines += _table(rows)
        if self.batch_invariant is not None:
            lines += ["", "batch-invariant mode: on"]
            if self.batch_invariant:
                lines.append("not invariant (called by the model, computed as the library chooses):")
                rows = [("function", "called at")] + sorted(self.batch_invariant.items())
                lines += _table(rows)
            else:
                lines.append("every function the model's forward called is computed batch-invariantly")
        if self.notes:
            lines += [""] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]
        out.append("  " + "  ".join(cells).rstrip())
    return out
