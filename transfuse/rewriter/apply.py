"""Applying fusions to a model: plan per class, fuse per instance, verify, undo what does not match.

The steps, in order:

1. probe: one short forward of the original model records each module's first call;
2. plan: each module class is traced (in eval mode, like the probe) and matched once;
   each instance is validated;
   source fusers' edits to a class's forward are composed and compiled once per class;
3. fuse: per instance, a replacing fuser swaps the module, source fusers rebuild the
   instance's children, and the edited forward is bound to the instance (the object
   stays an instance of its class and keeps every other attribute);
4. verify: each fused instance is run on its recorded inputs and compared with its
   recorded outputs, then the whole model with its original output; an instance that
   does not match has all its fusions undone and reported. No copy of the model is made:
   only the probe's inputs and outputs of the fused modules are kept.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..ops.graphs import suspended as graphs_suspended
from .analysis import ClassAnalysis, analyse
from .capture import Probe, eval_mode, is_meta_model, make_probe, record_calls
from .fusion import Fused, Fuser, Refusal, SourceFuser
from .report import FusionRecord, RewriteReport, SkipRecord
from .source import MethodRewrite, rewrite_method
from .tracer import unwrapped_forward
from .verify import LOCAL_TOLERANCE, MODEL_TOLERANCE, relative_error, tolerance

__all__ = ["REPLACED_ATTR", "REPORT_ATTR", "REWRITTEN_ATTR", "is_fused", "rewrite_model", "rewrites_of"]

logger = logging.getLogger("transfuse")

REPORT_ATTR = "_transfuse_report"
# On an instance whose forward was rewritten: the MethodRewrite it runs.
REWRITTEN_ATTR = "_transfuse_rewrite"
# On the model: {original class: (fuser, found)} for classes whose instances were replaced.
REPLACED_ATTR = "_transfuse_replaced"


def is_fused(module: nn.Module) -> bool:
    """A transfuse layer, or an instance transfuse already rewrote."""
    return getattr(type(module), "__transfuse_layer__", False) or REWRITTEN_ATTR in module.__dict__


def rewrites_of(model: nn.Module) -> list[MethodRewrite]:
    """The distinct method rewrites running in ``model``, in module order."""
    found: dict[int, MethodRewrite] = {}
    for module in model.modules():
        rewrite = module.__dict__.get(REWRITTEN_ATTR)
        if rewrite is not None:
            found.setdefault(id(rewrite), rewrite)
    return list(found.values())


@dataclass
class _Planned:
    fuser: Fuser
    found: Any
    fused: Fused | None = None


@dataclass
class _Instance:
    """One module instance and the fusions planned for it."""

    path: str
    module: nn.Module
    analysis: ClassAnalysis
    plans: list[_Planned] = field(default_factory=list)
    rewrite: MethodRewrite | None = None
    previous_forward: Any = None  # what the rewritten forward displaced in the instance's __dict__

    @property
    def replacing(self) -> _Planned | None:
        return next((p for p in self.plans if p.fuser.replaces_module), None)


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


@contextlib.contextmanager
def _evaluating(module: nn.Module):
    # Verification calls are one-off: no fused layer captures a CUDA graph of them.
    with eval_mode(module), torch.no_grad(), graphs_suspended():
        yield


_OFFLOADED = (
    "its parameters are on the meta device in a model that has real ones (offloaded by accelerate), "
    "so they cannot be merged or shared."
)


def _plan(model: nn.Module, fusers: Sequence[Fuser], probe: Probe, report: RewriteReport) -> list[_Instance]:
    instances: list[_Instance] = []
    claimed: list[str] = []  # paths whose whole subtree a planned fusion consumes
    classes = set()
    meta_model = is_meta_model(model)
    for path, module in model.named_modules():
        if is_fused(module) or any(path.startswith(p + ".") or path == p for p in claimed):
            continue
        wanting = [f for f in fusers if f.wants(module)]
        if not wanting:
            continue
        if not meta_model and any(p.is_meta for p in module.parameters()):
            for fuser in wanting:
                report.add_skip(SkipRecord(type(module).__name__, fuser.kind, _OFFLOADED, "instance.offloaded", path=path))
            continue
        analysis = analyse(module, path, probe)
        classes.add(analysis.cls)
        instance = _Instance(path, module, analysis)
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
            instance.plans.append(_Planned(fuser, verdict))
            if fuser.replaces_module:
                if not path:
                    raise ValueError("A fusion cannot replace the model itself; rewrite its parent instead.")
                claimed.append(path)
                instance.plans = [instance.plans[-1]]
                break
            claimed.extend(f"{path}.{child}" if path else child for child in fuser.claimed_children(verdict))
        if instance.plans:
            instances.append(instance)
    for instance in instances:
        _compose_source_edits(instance, report)
    instances = [i for i in instances if i.plans]
    logger.info(
        "transfuse: analysed %d module classes, %d fusions planned",
        len(classes),
        sum(len(i.plans) for i in instances),
    )
    return instances


def _compose_source_edits(instance: _Instance, report: RewriteReport) -> None:
    """The class's forward with every planned source edit that proves out (once per class)."""
    source_plans = [p for p in instance.plans if isinstance(p.fuser, SourceFuser)]
    if not source_plans:
        return
    analysis = instance.analysis
    key = tuple((p.fuser.kind, p.found) for p in source_plans)  # found records are frozen: hashable
    if key not in analysis.rewrites:
        edits = [(p.fuser.kind, _edit_for(p)) for p in source_plans]
        analysis.rewrites[key] = rewrite_method(analysis.cls, unwrapped_forward(analysis.cls), edits)
    rewrite, refusals = analysis.rewrites[key]
    for kind, refusal in refusals.items():
        where = analysis.where()
        report.add_skip(SkipRecord(analysis.cls.__name__, kind, refusal.reason, refusal.tag, where))
    instance.plans = [p for p in instance.plans if p.fuser.kind not in refusals]
    instance.rewrite = rewrite
    if rewrite is not None:
        rewrite.declarations = tuple(p.fuser.declaration(p.found) for p in instance.plans if isinstance(p.fuser, SourceFuser))


def _edit_for(plan: _Planned):
    return lambda tree, context: plan.fuser.edit(tree, plan.found, context)


# accelerate's hooks replace an instance's forward with a wrapper that calls _old_forward.
_HOOKED_FORWARD = "_old_forward"


def _forward_slot(module: nn.Module) -> str:
    return _HOOKED_FORWARD if "_hf_hook" in module.__dict__ and _HOOKED_FORWARD in module.__dict__ else "forward"


def _apply(model: nn.Module, instance: _Instance) -> None:
    existing = {id(m) for m in instance.module.modules()}
    for plan in instance.plans:
        plan.fused = plan.fuser.fuse(instance.module, plan.found)
        if plan.fused.replacement is not None:
            _set_submodule(model, instance.path, plan.fused.replacement)
            _adopt_training(plan.fused.replacement, instance.module.training, existing)
    _adopt_training(instance.module, instance.module.training, existing)
    if instance.rewrite is not None:
        module = instance.module
        slot = _forward_slot(module)
        instance.previous_forward = module.__dict__.get(slot)
        module.__dict__[slot] = types.MethodType(instance.rewrite.compile(), module)
        module.__dict__[REWRITTEN_ATTR] = instance.rewrite


def _adopt_training(root: nn.Module, training: bool, existing: set[int]) -> None:
    """Modules a fusion created (a new nn.Module starts in training mode) take the training flag
    of the module they were fused into; the modules they reuse keep their own."""
    for module in root.modules():
        if id(module) not in existing:
            module.training = training


def _undo(model: nn.Module, instance: _Instance) -> None:
    module = instance.module
    if instance.rewrite is not None:
        slot = _forward_slot(module)
        if instance.previous_forward is None:
            module.__dict__.pop(slot, None)
        else:
            module.__dict__[slot] = instance.previous_forward
        module.__dict__.pop(REWRITTEN_ATTR, None)
    for plan in reversed(instance.plans):
        if plan.fused is None:
            continue
        if plan.fused.replacement is not None:
            _set_submodule(model, instance.path, module)
        elif plan.fused.undo is not None:
            plan.fused.undo()


def _verify_locally(model: nn.Module, applied: list[_Instance], io: Probe, report: RewriteReport) -> list[_Instance]:
    """Run each fused instance on its recorded inputs; undo those whose outputs differ."""
    kept = []
    unverified = 0
    for instance in applied:
        call = io.real_calls.get(instance.path)
        if call is None or call.output is None:
            unverified += 1
            kept.append(instance)
            continue
        module = model.get_submodule(instance.path)
        with _evaluating(module):
            try:
                error = relative_error(module(*call.args, **call.kwargs), call.output)
            except Exception as exc:  # a fused module that fails to run is undone, not fatal
                error = float("inf")
                logger.warning("transfuse: fused %s failed on its probe input: %s", instance.path, exc)
        tol = tolerance(call.output, LOCAL_TOLERANCE)
        if error <= tol:
            kept.append(instance)
            continue
        _undo(model, instance)
        for plan in instance.plans:
            report.add_skip(
                SkipRecord(
                    type(instance.module).__name__,
                    plan.fuser.kind,
                    f"the fused module's output differs from the original's by {error:.3g} of its scale "
                    f"(tolerance {tol:.1g}); undone.",
                    "verify.mismatch",
                    path=instance.path,
                )
            )
    if unverified:
        report.notes.append(f"{unverified} fused modules were not called by the probe input and were not checked alone")
    return kept


def _verify_model(model: nn.Module, applied: list[_Instance], probe: Probe, report: RewriteReport) -> list[_Instance]:
    with _evaluating(model):
        output = model(*probe.args, **probe.kwargs)
    error = relative_error(output, probe.output)
    tol = tolerance(probe.output, MODEL_TOLERANCE)
    if error <= tol:
        report.notes.append(f"verified: the model's output on the probe input differs by {error:.3g} of its scale")
        return applied
    for instance in reversed(applied):
        _undo(model, instance)
    report.notes.append(
        f"the rewritten model's output differed from the original's by {error:.3g} of its scale "
        f"(tolerance {tol:.1g}), though each fused module matched alone; all fusions were undone"
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
        io = record_calls(model, Probe(probe.args, probe.kwargs), real_paths={i.path for i in planned})
    for instance in planned:
        _apply(model, instance)
    applied = planned
    if checking:
        applied = _verify_locally(model, applied, io, report)
        applied = _verify_model(model, applied, probe, report) if applied else applied
    elif verify and meta:
        report.notes.append("not verified: the model's parameters are on the meta device")
    replaced = model.__dict__.setdefault(REPLACED_ATTR, {})
    for instance in applied:
        for plan in instance.plans:
            if plan.fuser.replaces_module:
                replaced[type(instance.module)] = (plan.fuser, plan.found)
            report.fusions.append(
                FusionRecord(
                    instance.path, type(instance.module).__name__, plan.fuser.kind, plan.fused.replaced, plan.fused.into
                )
            )
    logger.info("transfuse: %d fusions in %.2f s", sum(len(i.plans) for i in applied), time.perf_counter() - start)
    object.__setattr__(model, REPORT_ATTR, report)
    return report
