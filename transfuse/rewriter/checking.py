"""Checking fusions: what each fused instance is compared with, and the comparisons.

Before anything is fused, ``prepare`` runs the probe again recording each planned instance's
inputs and output (real tensors), and runs each original module once more on those inputs in
higher precision, its reference (``verify``): this is the last moment the original weights
exist unmerged, so no copy of the model is ever needed. An instance the probe did not reach
borrows the recorded inputs of a reached instance of its class (same class, same children)
and runs its own original module on them; with no such instance, or inputs that do not fit,
its fusions are refused (``verify.not-reached``).

After fusing, ``check_instances`` runs each fused instance on its inputs and judges the
output (``verify.judge``); ``check_model`` compares the whole model's output on the probe
with its output before the rewrite (``verify.judge_model``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..ops import conformance
from ..ops.accuracy import NON_FINITE
from ..ops.conformance import Verdict
from .. import settings
from ..progress import bar
from .analysis import class_key
from .capture import Call, Probe, eval_mode, record_calls
from .verify import Judgement, judge, judge_model

__all__ = [
    "REFERENCE_BYTES",
    "Check",
    "check_instances",
    "check_model",
    "evaluating",
    "judge_losses",
    "loss_in_training",
    "prepare",
    "provider_checks",
    "reference_output",
]

logger = logging.getLogger("transfuse")

# The largest copy of one module's tensors that a reference run may make (float64 or float32);
# a larger module is judged against its own output (``verify``: floors only).
REFERENCE_BYTES = settings.at_import("TRANSFUSE_REFERENCE_BYTES")


@contextlib.contextmanager
def evaluating(module: nn.Module):
    """Eval mode and no autograd, for the one-off calls a check makes."""
    with eval_mode(module), torch.no_grad():
        yield


@dataclass
class Check:
    """What one fused instance is judged against."""

    call: Call  # the inputs, and the original module's output on them
    reference: Any = None  # the original's output in higher precision; None where it could not run
    reference_dtype: torch.dtype | None = None
    borrowed_from: str | None = None  # the instance whose recorded inputs these are, if not its own
    unreferenced: str | None = None  # why there is no reference run, where one would have been made

    def describe(self) -> str:
        against = f"a {str(self.reference_dtype).replace('torch.', '')} run of the original" if self.reference is not None else "the original's own output"
        if self.unreferenced is not None:
            against += f" ({self.unreferenced})"
        borrowed = f", on the inputs of {self.borrowed_from}" if self.borrowed_from is not None else ""
        return f"against {against}{borrowed}"


def _unique_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def _floating_leaves(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else None, obj)
    return found


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, obj)


@contextlib.contextmanager
def _eager_interfaces():
    """transformers' attention and experts interfaces answer with the module's own eager code, for
    the length of the block: the kernels they dispatch to (``grouped_mm``, flash attention) have no
    float64, the eager code computes the same in any dtype."""
    patched = []
    for module_name, class_name in _INTERFACES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if "get_interface" in vars(cls):
            patched.append((cls, vars(cls)["get_interface"]))
            cls.get_interface = lambda self, implementation, default: default
    try:
        yield
    finally:
        for cls, original in patched:
            cls.get_interface = original


_INTERFACES = (("transformers.modeling_utils", "AttentionInterface"), ("transformers.integrations.moe", "ExpertsInterface"))


def reference_output(module: nn.Module, call: Call) -> tuple[Any, torch.dtype | None, str | None]:
    """``module``'s output on ``call``'s inputs computed in float64, else float32, from upcast copies
    of its tensors (the module itself is not changed), as written or, where that does not run in
    the dtype, with transformers' eager attention and experts, and its dtype; (None, None, why) where
    one of its tensors cannot be upcast (a quantized weight's type refuses it: the fused module is
    then judged against the original's own output, in its own dtype); (None, None, None) where
    neither dtype is more precise than the module, the copy would exceed ``REFERENCE_BYTES``, or it
    cannot run."""
    tensors = _unique_tensors(module)
    floating = {id(t): t for t in tensors.values() if t.is_floating_point()}
    working = [t.dtype for t in floating.values()] + [t.dtype for t in _floating_leaves((call.args, call.kwargs))]
    if not working:
        return None, None, None
    coarsest = max(torch.finfo(d).eps for d in working)
    count = sum(t.numel() for t in floating.values())
    for dtype in (torch.float64, torch.float32):
        if torch.finfo(dtype).eps >= coarsest or count * torch.finfo(dtype).bits // 8 > REFERENCE_BYTES:
            continue
        state, refused = _upcast(tensors, dtype)
        if state is None:
            return None, None, refused
        for interfaces in (contextlib.nullcontext, _eager_interfaces):
            args, kwargs = _cast(call.fresh(), dtype)
            try:
                with evaluating(module), interfaces():
                    return torch.func.functional_call(module, state, tuple(args), kwargs), dtype, None
            except Exception as exc:  # an op without this dtype (a fused attention kernel): try the next
                logger.debug("transfuse: %s does not run in %s: %s", type(module).__name__, dtype, exc)
    return None, None, None


def _upcast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[dict | None, str | None]:
    """Copies of the floating tensors in ``dtype`` (the others as they are), or None and the reason
    one cannot be made: a tensor subclass (a quantized weight) that refuses the change of dtype or
    keeps its own."""
    state, wanted = {}, _name(dtype)
    for name, t in tensors.items():
        if not t.is_floating_point():
            state[name] = t
            continue
        try:
            copy = t.detach().to(dtype)
        except Exception as exc:  # the subclass's own refusal: quanto's weights raise ValueError
            return None, f"{name} ({type(t).__name__}) cannot be made {wanted}: {type(exc).__name__}: {exc}"
        if copy.dtype != dtype:
            return None, f"{name} ({type(t).__name__}) stays {_name(copy.dtype)} when made {wanted}"
        state[name] = copy
    return state, None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _non_finite_parameter(module: nn.Module, seen: dict[int, bool] | None = None) -> str | None:
    """The name of a floating parameter of ``module`` with a NaN or infinite value, else None
    (buffers may hold -inf on purpose: attention masks). ``seen``: parameter id -> finite, for
    parameters already read (a decoder layer's are its attention's and MLP's too)."""
    for name, p in module.named_parameters():
        if not (p.is_floating_point() and not p.is_meta and type(p.data) is torch.Tensor):
            continue
        finite = seen.get(id(p)) if seen is not None else None
        if finite is None:
            # (torch has no isfinite for 8-bit floats: read through bfloat16, which holds each of their values)
            finite = bool(torch.isfinite(p if p.element_size() > 1 else p.to(torch.bfloat16)).all())
            if seen is not None:
                seen[id(p)] = finite
        if not finite:
            return name
    return None


def prepare(
    model: nn.Module, instances: Sequence[Any], probe: Probe, refuse: Callable[[Any, str, str], None]
) -> dict[str, Check]:
    """Record each planned instance's call and reference; ``refuse(instance, tag, reason)`` for those
    that cannot be checked. Must run before any fusion is applied."""
    io = record_calls(model, Probe(probe.args, probe.kwargs), real_paths={i.path for i in instances})
    reached = {path: call for path, call in io.real_calls.items() if call.output is not None}
    donors: dict[tuple, str] = {}
    for instance in instances:
        if instance.path in reached:
            donors.setdefault(class_key(instance.module), instance.path)
    checks: dict[str, Check] = {}
    finite: dict[int, bool] = {}  # each parameter read once (the model's weights do not change here)
    for instance in bar(instances, total=len(instances), desc="transfuse: reference runs"):
        broken = _non_finite_parameter(instance.module, finite)
        if broken is not None:
            refuse(
                instance,
                NON_FINITE,
                f"its parameter {broken} holds NaN or infinite values: a fused module compared with an output "
                "they make non-finite proves nothing, so the fusion cannot be checked.",
            )
            continue
        call, borrowed = reached.get(instance.path), None
        if call is None:
            borrowed = donors.get(class_key(instance.module))
            if borrowed is None:
                refuse(
                    instance,
                    "verify.not-reached",
                    "the probe input never reached this module, nor another of its class whose inputs it could "
                    "borrow, so the fusion cannot be checked; pass example_inputs that reach it, or verify=False.",
                )
                continue
            args, kwargs = reached[borrowed].fresh()
            try:
                with evaluating(instance.module):
                    output = instance.module(*args, **kwargs)
            except Exception as exc:
                refuse(
                    instance,
                    "verify.not-reached",
                    f"the probe input never reached this module, and it does not run on the inputs of {borrowed} "
                    f"({type(exc).__name__}: {exc}), so the fusion cannot be checked.",
                )
                continue
            call = Call(args, kwargs, output)
        reference, dtype, unreferenced = reference_output(instance.module, call)
        checks[instance.path] = Check(call, reference, dtype, borrowed, unreferenced)
    return checks


def check_instances(
    model: nn.Module, instances: Sequence[Any], checks: dict[str, Check], failed: Callable[[Any, str, str], None]
) -> list[Any]:
    """Run each fused instance on its recorded inputs; ``failed(instance, reason, tag)`` for those
    whose output ``judge`` does not pass. Returns the instances that passed."""
    kept = []
    for instance in bar(instances, total=len(instances), desc="transfuse: checking"):
        check = checks[instance.path]
        module = model.get_submodule(instance.path)
        args, kwargs = check.call.fresh()
        try:
            with evaluating(module):
                output = module(*args, **kwargs)
            verdict = judge(output, check.call.output, check.reference)
        except Exception as exc:  # a fused module that fails to run is undone, not fatal
            verdict = Judgement(False, f"the fused module raised {type(exc).__name__}: {exc}")
        if verdict.passed:
            instance.check = f"{verdict.describe()}, {check.describe()}" if verdict.fused is not None else check.describe()
            kept.append(instance)
        else:
            failed(instance, f"{verdict.reason}, {check.describe()}", verdict.tag)
    return kept


def provider_checks(model: nn.Module, consulted: list) -> list[Verdict]:
    """The conformance verdicts of the providers the fused modules' ops consulted while they were
    checked (``conformance.watching``), one per op, provider and configuration; where the model has
    parameters that require grad (it may be trained), each configuration is also checked with
    gradients now, so that a backward kernel is judged before a training step runs it."""
    trains = any(p.requires_grad for p in model.parameters())
    seen: dict = {}
    for op, grad, key, args, kwargs in consulted:
        seen.setdefault((op.name, key), (op, grad, key, args, kwargs))
    found: list[Verdict] = []
    for op, grad, key, args, kwargs in seen.values():
        found += op.verdicts(key)
        if trains and not grad and (op.name, (True, key[1])) not in seen and conformance.can_check_now(args, kwargs):
            found += conformance.check(op, True, (True, key[1]), args, kwargs).values()
    return found


def loss_in_training(model: nn.Module, probe: Probe) -> Any:
    """The model's loss on the probe (which carries labels) in training mode, without autograd and
    from a fixed random state (dropout draws the same masks each time); None without a loss."""
    flags = {m: m.training for m in model.modules()}
    devices = [p.device for p in model.parameters() if p.is_cuda][:1]
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            output = model(*probe.args, **probe.kwargs)
    finally:
        for module, flag in flags.items():
            module.training = flag
    return getattr(output, "loss", None)


# A loss is one number, summed over the probe: it differs by a few roundings of the sum.
LOSS_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def judge_losses(loss: Any, before: Any) -> Judgement:
    """Whether a loss equals the one before the rewrite (relative ``LOSS_TOLERANCE``, 2e-3 in 16 bits)."""
    if not isinstance(before, torch.Tensor):
        return Judgement(True, "")
    if not isinstance(loss, torch.Tensor):
        return Judgement(False, "the rewritten model returns no loss")
    error = abs(loss.double().item() - before.double().item()) / max(abs(before.double().item()), 1e-30)
    limit = LOSS_TOLERANCE.get(before.dtype, 2e-3)
    if error <= limit or (loss.isnan().item() and before.isnan().item()):
        return Judgement(True, "")
    return Judgement(False, f"loss {loss.item():.6g} against {before.item():.6g} (relative {error:.3g} > {limit:.1g})")


def check_model(model: nn.Module, probe: Probe) -> Judgement:
    """The whole model on the probe input against its output before the rewrite."""
    with evaluating(model):
        output = model(*probe.args, **probe.kwargs)
    return judge_model(output, probe.output)
