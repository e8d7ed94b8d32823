"""Applying fusions to a model: plan per class, fuse per instance, verify, undo what does not match.

The steps, in order:

1. probe: one short forward of the original model records each module's first call;
2. plan: each module class is traced (in eval mode, like the probe) and matched once; each
   instance is validated;
3. fuse: each planned fusion builds its modules from the instance's own tensors;
4. verify: each fused module is run on its recorded inputs and compared with its
   recorded outputs, then the whole model with its original output; any fusion that
   does not match is undone and reported. No copy of the model is made: only the probe's
   inputs and outputs of the fused modules are kept.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .analysis import analyse
from .capture import Probe, eval_mode, is_meta_model, make_probe, record_calls
from .fusion import Fused, Fuser, Refusal
from .report import FusionRecord, RewriteReport, SkipRecord
from .verify import LOCAL_TOLERANCE, MODEL_TOLERANCE, relative_error, tolerance

__all__ = ["REPORT_ATTR", "is_fused", "rewrite_model"]

logger = logging.getLogger("transfuse")

REPORT_ATTR = "_transfuse_report"
# Set on an instance whose methods were rewritten in place.
REWRITTEN_ATTR = "_transfuse_rewritten"


def is_fused(module: nn.Module) -> bool:
    """A transfuse layer, or an instance transfuse already rewrote."""
    return getattr(type(module), "__transfuse_layer__", False) or getattr(module, REWRITTEN_ATTR, False)


@dataclass
class _Planned:
    path: str
    module: nn.Module
    fuser: Fuser
    found: Any
    fused: Fused | None = None


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


@contextlib.contextmanager
def _evaluating(module: nn.Module):
    flags = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def _plan(model: nn.Module, fusers: Sequence[Fuser], probe: Probe, report: RewriteReport) -> list[_Planned]:
    planned: list[_Planned] = []
    claimed: list[str] = []  # paths whose whole subtree a planned fusion consumes
    classes = set()
    for path, module in model.named_modules():
        if is_fused(module) or any(path.startswith(p + ".") or path == p for p in claimed):
            continue
        wanting = [f for f in fusers if f.wants(module)]
        if not wanting:
            continue
        analysis = analyse(module, path, probe)
        classes.add(analysis.cls)
        for fuser in wanting:
            verdict = analysis.verdict(fuser)
            if verdict is None:
                continue
            if isinstance(verdict, Refusal):
                report.add_skip(SkipRecord.of(type(module).__name__, fuser.kind, verdict))
                continue
            refusal = fuser.validate(module, verdict)
            if refusal is not None:
                report.add_skip(SkipRecord.of(type(module).__name__, fuser.kind, refusal, path))
                continue
            planned.append(_Planned(path, module, fuser, verdict))
            if fuser.replaces_module:
                claimed.append(path)
                break
            claimed.extend(f"{path}.{child}" if path else child for child in fuser.claimed_children(verdict))
    logger.info("transfuse: analysed %d module classes, %d fusions planned", len(classes), len(planned))
    return planned


def _apply(model: nn.Module, item: _Planned) -> None:
    item.fused = item.fuser.fuse(item.module, item.found)
    if item.fused.replacement is not None:
        if not item.path:
            raise ValueError("A fusion cannot replace the model itself; rewrite its parent instead.")
        _set_submodule(model, item.path, item.fused.replacement)


def _undo(model: nn.Module, item: _Planned) -> None:
    if item.fused.replacement is not None:
        _set_submodule(model, item.path, item.module)
    elif item.fused.undo is not None:
        item.fused.undo()


def _verify_locally(model: nn.Module, applied: list[_Planned], io: Probe, report: RewriteReport) -> list[_Planned]:
    """Run each fused module on its recorded inputs; undo those whose outputs differ."""
    kept = []
    unverified = 0
    for item in applied:
        call = io.real_calls.get(item.path)
        if call is None or call.output is None:
            unverified += 1
            kept.append(item)
            continue
        module = model.get_submodule(item.path)
        with _evaluating(module):
            try:
                output = module(*call.args, **call.kwargs)
                error = relative_error(output, call.output)
            except Exception as exc:  # a fused module that fails to run is undone, not fatal
                output, error = None, float("inf")
                logger.warning("transfuse: fused %s failed on its probe input: %s", item.path, exc)
        tol = tolerance(call.output, LOCAL_TOLERANCE)
        if error <= tol:
            kept.append(item)
            continue
        _undo(model, item)
        report.add_skip(
            SkipRecord(
                type(item.module).__name__,
                item.fuser.kind,
                f"the fused module's output differs from the original's by {error:.3g} of its scale "
                f"(tolerance {tol:.1g}); undone.",
                "verify.mismatch",
                path=item.path,
            )
        )
    if unverified:
        report.notes.append(f"{unverified} fused modules were not called by the probe input and were not checked alone")
    return kept


def _verify_model(model: nn.Module, applied: list[_Planned], probe: Probe, report: RewriteReport) -> list[_Planned]:
    with _evaluating(model):
        output = model(*probe.args, **probe.kwargs)
    error = relative_error(output, probe.output)
    tol = tolerance(probe.output, MODEL_TOLERANCE)
    if error <= tol:
        report.notes.append(f"verified: the model's output on the probe input differs by {error:.3g} of its scale")
        return applied
    for item in reversed(applied):
        _undo(model, item)
    report.notes.append(
        f"the rewritten model's output differed from the original's by {error:.3g} of its scale "
        f"(tolerance {tol:.1g}), though each fused module matched alone; all {len(applied)} fusions were undone"
    )
    return []


def rewrite_model(
    model: nn.Module,
    fusers: Sequence[Fuser],
    *,
    verify: bool = True,
    example_inputs: Any = None,
) -> RewriteReport:
    """Apply ``fusers`` to ``model`` in place and return the report (also kept on the model)."""
    start = time.perf_counter()
    previous: RewriteReport | None = getattr(model, REPORT_ATTR, None)
    report = RewriteReport(fusions=list(previous.fusions) if previous else [])
    probe = record_calls(model, make_probe(model, example_inputs))
    if probe.error is not None:
        report.notes.append(f"the probe forward stopped early ({probe.error}); classes it did not reach were traced without inputs")
    with eval_mode(model):  # traced as the probe ran: fusions reproduce inference (see each fuser for training)
        planned = _plan(model, fusers, probe, report)
    meta = is_meta_model(model)
    checking = verify and not meta and probe.error is None and bool(planned)
    io = None
    if checking:
        io = record_calls(model, Probe(probe.args, probe.kwargs), real_paths={p.path for p in planned})
    for item in planned:
        _apply(model, item)
    applied = planned
    if checking:
        applied = _verify_locally(model, applied, io, report)
        applied = _verify_model(model, applied, probe, report) if applied else applied
    elif verify and meta:
        report.notes.append("not verified: the model's parameters are on the meta device")
    for item in applied:
        report.fusions.append(
            FusionRecord(item.path, type(item.module).__name__, item.fuser.kind, item.fused.replaced, item.fused.into)
        )
    elapsed = time.perf_counter() - start
    logger.info("transfuse: %d fusions in %.2f s", len(applied), elapsed)
    object.__setattr__(model, REPORT_ATTR, report)
    return report
