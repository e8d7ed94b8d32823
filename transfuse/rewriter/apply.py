"""Applying fusions to a model: plan per class, fuse per instance, verify, undo what does not match.

The steps, in order:

1. probe: one short forward of the original model records each module's first call; a probe
   that cannot run means nothing is fused (unless the caller passed ``verify=False``);
2. plan: each module class is traced (in eval mode, like the probe) and matched once;
   each instance is validated;
   source fusers' edits to a class's forward are composed and compiled once per class;
3. prepare (``checking``): each planned instance's inputs and output are recorded, and its
   original module is run again in higher precision, before any weight is merged;
4. fuse: per instance, a replacing fuser swaps the module, source fusers rebuild the
   instance's children, and the edited forward is bound to the instance (the object
   stays an instance of its class and keeps every other attribute);
5. verify: each fused instance is run on its recorded inputs and judged against its
   reference next to the original's own error (``verify``), then the whole model against its
   own output; an instance that fails has all its fusions undone and reported. No copy of the
   model is made: only the probe's inputs and outputs of the fused modules are kept. An error
   part-way undoes every fusion before it is raised.

Steps 1 to 3 and 5 run the model's own Python, which may assign attributes, caches, counters,
globals and the random state: the model's state is captured first (``state``) and put back after
each, leaving only what the fusions themselves changed; after an error, all of it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..ops import conformance
from ..ops.accuracy import NON_FINITE
from ..ops.hooks import share_hooks
from ..progress import bar
from .analysis import ClassAnalysis, analyse
from .capture import Probe, ProbeUnavailable, eval_mode, is_meta_model, make_probe, record_calls
from .checking import check_instances, check_model, judge_losses, loss_in_training, prepare, provider_checks
from .fusion import Fused, Fuser, Refusal, SourceFuser
from .report import FusionRecord, RewriteReport, SkipRecord
from .sharing import Sharing
from .source import MethodRewrite, bind, remember, rewrite_method, unbind
from .state import ModelState
from .tracer import unwrapped_forward

__all__ = ["REPLACED_ATTR", "REPORT_ATTR", "REWRITTEN_ATTR", "is_fused", "rewrite_model", "rewrites_of"]

logger = logging.getLogger("transfuse")

REPORT_ATTR = "_transfuse_report"
# On an instance whose forward was rewritten: the MethodRewrite it runs.
REWRITTEN_ATTR = "_transfuse_rewrite"
# On the model: {original class: (fuser, found or None)} for classes whose instances were replaced.
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
    bound: bool = False  # the rewritten forward is bound to the instance
    check: str = ""  # how the fused instance was verified

    @property
    def replacing(self) -> _Planned | None:
        return next((p for p in self.plans if p.fuser.replaces_module), None)


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


_OFFLOADED = (
    "its parameters are on the meta device in a model that has real ones (offloaded by accelerate), "
    "so they cannot be merged or shared."
)


def _simpler_probes(kwargs: dict) -> list[tuple[str, dict]]:
    """The made probe's fallbacks, simplest last: without labels (a loss that does not take the token
    ids as labels: git counts its image tokens in), with ``use_cache=False`` where the forward only
    takes it through ``**kwargs`` (a cache the tiny layout cannot serve: granitemoehybrid's mamba-only
    layers), and both."""
    unlabelled = {k: v for k, v in kwargs.items() if k != "labels"}
    found = []
    if "labels" in kwargs:
        found.append(("without labels", unlabelled))
    if "use_cache" not in kwargs:
        found.append(("with use_cache=False", {**kwargs, "use_cache": False}))
        if "labels" in kwargs:
            found.append(("without labels and with use_cache=False", {**unlabelled, "use_cache": False}))
    return found


def _plan(
    model: nn.Module, fusers: Sequence[Fuser], probe: Probe, report: RewriteReport, suggest: Sequence[Fuser] = ()
) -> list[_Instance]:
    instances: list[_Instance] = []
    claimed: list[str] = []  # paths whose whole subtree a planned fusion consumes
    classes = set()
    meta_model = is_meta_model(model)
    sharing = Sharing(model)
    modules = list(model.named_modules())
    for path, module in bar(modules, total=len(modules), desc="transfuse: analysing"):
        if is_fused(module) or any(path.startswith(p + ".") or path == p for p in claimed):
            continue
        wanting = [f for f in fusers if f.wants(module)]
        suggesting = [f for f in suggest if f.wants(module)]
        if not wanting and not suggesting:
            continue
        offloaded = not meta_model and any(p.is_meta for p in module.parameters())
        analysis = analyse(module, path, probe)
        classes.add(analysis.cls)
        for fuser in suggesting if not offloaded else ():
            _suggest(fuser, module, analysis, report)
        instance = _Instance(path, module, analysis)
        for fuser in wanting:
            verdict = analysis.verdict(fuser)
            if verdict is None:
                continue
            if isinstance(verdict, Refusal):
                report.add_skip(SkipRecord.of(type(module).__name__, fuser.kind, verdict))
                continue
            if offloaded:  # only the fusions its class matches concern it
                report.add_skip(SkipRecord(type(module).__name__, fuser.kind, _OFFLOADED, "instance.offloaded", path=path))
                continue
            refusal = sharing.refusal(fuser.kind, module, fuser.rebuilt_children(verdict))
            refusal = refusal or fuser.validate(module, verdict)
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


def _suggest(fuser: Fuser, module: nn.Module, analysis: ClassAnalysis, report: RewriteReport) -> None:
    """An opt-in fusion that was not asked for: a note where it would apply."""
    verdict = analysis.verdict(fuser)
    if verdict is None or isinstance(verdict, Refusal) or fuser.validate(module, verdict) is not None:
        return
    note = fuser.suggestion(module, verdict)
    if note and note not in report.notes:
        report.notes.append(note)


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
        report.notes.extend(n for n in rewrite.notes if n not in report.notes)
        declared = (p.fuser.declaration(p.found) for p in instance.plans if isinstance(p.fuser, SourceFuser))
        rewrite.declarations = tuple(d for d in declared if d is not None)
        rewrite.recipe = tuple((p.fuser, p.found) for p in instance.plans if isinstance(p.fuser, SourceFuser))
        remember(rewrite)


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
            share_hooks(instance.module, plan.fused.replacement)  # called in its place, it runs its hooks
            _set_submodule(model, instance.path, plan.fused.replacement)
            _adopt_training(plan.fused.replacement, instance.module.training, existing)
    _adopt_training(instance.module, instance.module.training, existing)
    if instance.rewrite is not None:
        module = instance.module
        slot = _forward_slot(module)
        instance.previous_forward = module.__dict__.get(slot)
        module.__dict__[slot] = bind(instance.rewrite, module)
        module.__dict__[REWRITTEN_ATTR] = instance.rewrite
        instance.bound = True


def _adopt_training(root: nn.Module, training: bool, existing: set[int]) -> None:
    """Modules a fusion created (a new nn.Module starts in training mode) take the training flag
    of the module they were fused into; the modules they reuse keep their own."""
    for module in root.modules():
        if id(module) not in existing:
            module.training = training


def _undo(model: nn.Module, instance: _Instance) -> None:
    """Put the instance back as it was; what was never done (a failure part-way) is skipped, and a
    second undo does nothing."""
    module = instance.module
    if instance.bound:
        slot = _forward_slot(module)
        if instance.previous_forward is None:
            module.__dict__.pop(slot, None)
        else:
            module.__dict__[slot] = instance.previous_forward
        module.__dict__.pop(REWRITTEN_ATTR, None)
        unbind(module)
        instance.bound = False
    for plan in reversed(instance.plans):
        fused, plan.fused = plan.fused, None
        if fused is None:
            continue
        if fused.replacement is not None:
            _set_submodule(model, instance.path, module)
        elif fused.undo is not None:
            fused.undo()


def _verified(
    model: nn.Module, applied: list[_Instance], training: list[_Instance], checks: dict, probe: Probe, report: RewriteReport
) -> list[_Instance]:
    """The applied instances that pass their checks (each fused module, the training-only ones by
    the loss, then the whole model); the others are undone and reported."""

    def failed(instance: _Instance, reason: str, tag: str) -> None:
        _undo(model, instance)
        what = "has non-finite values the original does not" if tag == NON_FINITE else "is less accurate than the original"
        _refuse(report, instance, tag, f"the fused module {what}: {reason}; undone.")

    applied = [i for i in applied if i in training] + check_instances(
        model, [i for i in applied if i not in training], checks, failed
    )
    if any(i in training for i in applied):
        applied = _check_training(model, applied, [i for i in applied if i in training], probe, report)
    if not applied:
        return applied
    verdict = check_model(model, probe)
    if verdict.passed:
        report.notes.append(f"verified: the whole model's output on the probe input differs by {verdict.describe() or 'nothing'}")
        return applied
    _undo_all(model, applied)
    report.notes.append(
        f"the rewritten model's output differed from the original's ({verdict.reason}), though each "
        "fused module passed alone; all fusions were undone"
    )
    return []


class RewriteError(RuntimeError):
    """A rewrite failed part-way (a fused model that raised, say); every fusion was undone and the
    model's state put back (the message names anything that is not as it was)."""


class ExampleInputsError(ValueError):
    """The model's forward rejected the caller's ``example_inputs``."""


def _signature_hint(model: nn.Module) -> str:
    try:
        names = [p for p in inspect.signature(model.forward).parameters if p not in ("args", "kwargs")]
    except (TypeError, ValueError):
        return ""
    return f" ({type(model).__name__}.forward takes: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"


def _refuse(report: RewriteReport, instance: _Instance, tag: str, reason: str) -> None:
    for plan in instance.plans:
        report.add_skip(SkipRecord(type(instance.module).__name__, plan.fuser.kind, reason, tag, path=instance.path))


def _check_training(
    model: nn.Module, applied: list[_Instance], training: list[_Instance], probe: Probe, report: RewriteReport
) -> list[_Instance]:
    """Fusions that change training mode only: the model's loss in training mode on the probe (from
    the same random state) with them, against the loss without them, every other fusion in place in
    both runs; undone if it differs."""
    with _bypassed(training):
        before = loss_in_training(model, probe)
    verdict = judge_losses(loss_in_training(model, probe), before)
    if verdict.passed:
        return applied
    for instance in training:
        _undo(model, instance)
        _refuse(report, instance, "verify.mismatch", f"the model's loss in training mode differs: {verdict.reason}; undone.")
    return [i for i in applied if i not in training]


@contextlib.contextmanager
def _bypassed(instances: Sequence[_Instance]):
    """The instances' rewritten forwards set aside for the length of the block (source fusions only)."""
    saved = []
    for instance in instances:
        if instance.bound:
            slot = _forward_slot(instance.module)
            saved.append((instance.module, slot, instance.module.__dict__[slot]))
            if instance.previous_forward is None:
                del instance.module.__dict__[slot]
            else:
                instance.module.__dict__[slot] = instance.previous_forward
    try:
        yield
    finally:
        for module, slot, forward in saved:
            module.__dict__[slot] = forward


def _undo_all(model: nn.Module, instances: Sequence[_Instance]) -> None:
    for instance in reversed(instances):
        _undo(model, instance)


def rewrite_model(
    model: nn.Module,
    fusers: Sequence[Fuser],
    *,
    verify: bool = True,
    example_inputs: Any = None,
    suggest: Sequence[Fuser] = (),
) -> RewriteReport:
    """Apply ``fusers`` to ``model`` in place and return the report (also kept on the model);
    ``suggest``: opt-in fusers whose report note says where they would apply.

    Fails closed: without a probe that runs, nothing is fused unless ``verify`` is False (or the
    model is on the meta device, which nothing can verify); a fusion whose check fails is undone;
    an error part-way undoes every fusion and raises ``RewriteError``.
    """
    start = time.perf_counter()
    previous: RewriteReport | None = getattr(model, REPORT_ATTR, None)
    report = RewriteReport(fusions=list(previous.fusions) if previous else [])
    meta = is_meta_model(model)
    state = ModelState.capture(model)
    # The probe, the traces and the reference runs run the model's own code: each is followed by
    # the state as it was (a trace leaves meta tensors where a forward assigns what it computed).
    with _put_back(state):
        probe, failure = _probe(model, example_inputs, report)
    if failure is not None and verify and not meta:
        return _not_rewritten(model, failure, report)
    if failure is not None:
        report.notes.append(f"the probe forward stopped early ({failure}); classes it did not reach were traced without inputs")
    with _put_back(state), eval_mode(model):  # traced as the probe ran: fusions reproduce inference
        planned = _plan(model, fusers, probe, report, suggest)
    checking = verify and not meta and bool(planned)
    if checking:
        with _put_back(state):
            planned, training, checks = _prepare_checks(model, planned, probe, report)
    elif planned:
        _unverified(report, "the caller passed verify=False" if not verify else _META)
    applied = _apply_all(model, planned, state)
    if checking:
        fused_state = ModelState.capture(model, copies=False, also=state)
        applied = _checked(model, applied, training, checks, probe, report, state)
        state.restore(keep=fused_state)  # what the checks' forwards changed; the fusions stay
    _record(model, applied, report)
    logger.info("transfuse: %d fusions in %.2f s", sum(len(i.plans) for i in applied), time.perf_counter() - start)
    object.__setattr__(model, REPORT_ATTR, report)
    return report


_META = "the model's parameters are on the meta device (no data to compare)"


def _probe(model: nn.Module, example_inputs: Any, report: RewriteReport) -> tuple[Probe, str | None]:
    """The probe forward, recorded, and why it failed (None: it ran). The probe made here is
    retried simpler before it fails; the caller's ``example_inputs`` must run as given."""
    try:
        made = make_probe(model, example_inputs)
        probe = record_calls(model, made)
        failure = probe.error
        if failure is not None and example_inputs is None:
            for what, kwargs in _simpler_probes(made.kwargs):
                retried = record_calls(model, Probe(made.args, kwargs))
                if retried.error is None:
                    report.notes.append(f"the probe ran {what}: as first made, the model raised {failure}")
                    return retried, None
    except ProbeUnavailable as exc:
        probe, failure = Probe((), {}), str(exc)
    if failure is not None and example_inputs is not None:
        raise ExampleInputsError(
            f"{type(model).__name__} rejected example_inputs: {failure}. Pass the arguments its forward "
            f"takes{_signature_hint(model)}, as a tuple of positional arguments or a dict of keyword "
            "arguments, or leave example_inputs out to let transfuse make random token ids."
        )
    return probe, failure


def _not_rewritten(model: nn.Module, failure: str, report: RewriteReport) -> RewriteReport:
    """Nothing fused: no probe ran, so no fusion could be verified."""
    report.not_rewritten = (
        f"the probe forward could not run ({failure}), so no fusion could be verified; pass "
        "example_inputs that the model accepts, or verify=False to fuse without verification"
    )
    warnings.warn(f"transfuse: {type(model).__name__} was not rewritten: {report.not_rewritten}.", stacklevel=4)
    object.__setattr__(model, REPORT_ATTR, report)
    return report


def _prepare_checks(model: nn.Module, planned: list[_Instance], probe: Probe, report: RewriteReport):
    """(the instances that can be checked, those judged by the loss in training mode, the checks).
    Fusions that change training mode only run the original code in eval mode: they are judged by
    the model's loss in training mode instead (``_check_training``)."""
    training = [i for i in planned if all(p.fuser.changes_training for p in i.plans)]
    evaluated = [i for i in planned if i not in training]
    checks = prepare(model, evaluated, probe, lambda instance, tag, reason: _refuse(report, instance, tag, reason))
    return [i for i in planned if i.path in checks or i in training], training, checks


def _unverified(report: RewriteReport, why: str) -> None:
    report.verification = f"unverified: {why}"
    report.notes.append(report.verification)


@contextlib.contextmanager
def _put_back(state: ModelState):
    """The model's state as captured in ``state`` again when the block ends, however it ends."""
    try:
        yield
    finally:
        state.restore()


@contextlib.contextmanager
def _all_or_nothing(model: nn.Module, applied: list[_Instance], state: ModelState):
    """An error inside undoes every instance in ``applied``, puts the model's state back as captured in
    ``state`` and raises ``RewriteError``, which says what, if anything, is not as it was."""
    try:
        yield
    except BaseException as exc:
        _undo_all(model, applied)
        state.restore()
        if not isinstance(exc, Exception):
            raise
        raise RewriteError(
            f"transfuse could not finish rewriting {type(model).__name__} ({type(exc).__name__}: {exc}); "
            f"every fusion was undone and {_as_it_was(state)}."
        ) from exc


def _as_it_was(state: ModelState) -> str:
    differences = state.differences()
    if not differences:
        return "the model is as it was"
    shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
    return f"the model is as it was except: {shown}"


def _apply_all(model: nn.Module, planned: list[_Instance], state: ModelState) -> list[_Instance]:
    applied: list[_Instance] = []
    with _all_or_nothing(model, applied, state):
        for instance in planned:
            applied.append(instance)
            _apply(model, instance)
    return applied


def _checked(
    model, applied: list[_Instance], training, checks, probe: Probe, report: RewriteReport, state: ModelState
) -> list[_Instance]:
    """The applied instances that pass their checks, with the providers the checks consulted."""
    with _all_or_nothing(model, list(applied), state), conformance.watching() as consulted:
        passed = _verified(model, applied, training, checks, probe, report)
        report.providers = provider_checks(model, consulted) if passed else []
    return passed


def _record(model: nn.Module, applied: list[_Instance], report: RewriteReport) -> None:
    """Each fusion made, in the report; each replaced class, with what its emitted forward needs."""
    replaced = model.__dict__.setdefault(REPLACED_ATTR, {})
    differing: set[type] = set()
    for instance in applied:
        for plan in instance.plans:
            if plan.fused.replacement is not None and plan.fused.replaced == ("",):
                _keep_emission(replaced, differing, type(instance.module), plan)
            report.fusions.append(
                FusionRecord(
                    instance.path, type(instance.module).__name__, plan.fuser.kind, plan.fused.replaced,
                    plan.fused.into, instance.check or report.verification,
                    plan.fuser.claimed_children(plan.found),
                )
            )


def _keep_emission(replaced: dict, differing: set[type], cls: type, plan: _Planned) -> None:
    """What an emitted forward needs (not the match: it may hold graph nodes, which neither copy
    nor pickle); None where instances of one class differ in it."""
    emits = type(plan.fuser).emitted_forward is not Fuser.emitted_forward
    kept = plan.fuser.emission(plan.found, plan.fused) if emits else None
    if cls in differing or (cls in replaced and replaced[cls][1] != kept):
        differing.add(cls)
        kept = None
    replaced[cls] = (plan.fuser, kept)
