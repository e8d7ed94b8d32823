"""Deliberately wrong providers, for the tests and the fuzz run of provider conformance.

A ``Fault`` is a provider of one op that computes the native definition and then errs by
``error`` (a scale, or noise of that relative size) on the calls where its condition holds: always,
or only at some shapes (one row, a batch of several sequences, above a row count, a decode step's
token count, a long cache) or some data (an expert that receives no token, every token routed to
the same experts). A fault that depends on a size declares it as a threshold, as a real provider
must: conformance finds a wrong branch only behind a declared threshold.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from transfuse import ops

# Each op's conditions: {name: (predicate of the call's arguments, the thresholds it declares)}.
Condition = tuple[Callable[..., bool], dict]


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _batch(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() >= 3 else 1


def _row_conditions(threshold: int) -> dict[str, Condition]:
    return {
        "always": (lambda *a, **k: True, {}),
        "one row": (lambda x, *a, **k: _rows(x) == 1, {}),
        "batch > 1": (lambda x, *a, **k: _batch(x) > 1, {}),
        f"rows >= {threshold}": (lambda x, *a, **k: _rows(x) >= threshold, {"rows": (threshold,)}),
    }


def _rotary_seq(q: torch.Tensor, dim: int) -> int:
    return q.shape[2] if dim in (1, -3) else q.shape[1]


def _rotary_conditions() -> dict[str, Condition]:
    def dim(args: tuple, kwargs: dict) -> int:
        return args[4] if len(args) > 4 else kwargs.get("unsqueeze_dim", 1)

    return {
        "always": (lambda *a, **k: True, {}),
        "one position": (lambda *a, **k: _rotary_seq(a[0], dim(a, k)) == 1, {}),
        "batch > 1": (lambda *a, **k: a[0].shape[0] > 1, {}),
        "seq >= 9": (lambda *a, **k: _rotary_seq(a[0], dim(a, k)) >= 9, {"seq": (9,)}),
    }


def _idle_expert(x, weights, ids, w13, *rest) -> bool:
    return bool((torch.bincount(ids.flatten().long(), minlength=w13.shape[0]) == 0).any())


def _one_group(x, weights, ids, *rest) -> bool:
    return ids.shape[0] > 1 and bool((ids == ids[:1]).all())


def _experts_conditions() -> dict[str, Condition]:
    return {
        "always": (lambda *a, **k: True, {}),
        "tokens < 4 (a decode path)": (lambda x, *a, **k: x.shape[0] < 4, {"tokens": (4,)}),
        "an idle expert": (_idle_expert, {}),
        "all tokens to the same experts": (_one_group, {}),
    }


def _decode_conditions() -> dict[str, Condition]:
    return {
        "always": (lambda *a, **k: True, {}),
        "batch > 1": (lambda q, *a, **k: q.shape[0] > 1, {}),
        "length >= 65": (lambda q, keys, *a, **k: keys.shape[2] >= 65, {"length": (65,)}),
    }


CONDITIONS: dict[str, dict[str, Condition]] = {
    "rms_norm": _row_conditions(65),
    "fused_add_rms_norm": _row_conditions(65),
    "silu_and_mul": _row_conditions(65),
    "rotary": _rotary_conditions(),
    "moe_experts": _experts_conditions(),
    "decode_attention": _decode_conditions(),
}


@dataclass(frozen=True)
class Fault:
    op: str
    condition: str
    error: float  # relative: 0.01 is 1%
    kind: str = "scale"  # "scale" (times 1 + error) or "noise" (plus error times a random sign per element)

    def applies(self, *args: Any, **kwargs: Any) -> bool:
        return CONDITIONS[self.op][self.condition][0](*args, **kwargs)

    def describe(self) -> str:
        return f"{self.op} {self.error:.2%} {self.kind} at {self.condition}"

    def provider(self) -> Callable[..., Any]:
        native = ops.get_op(self.op).native.impl

        def faulty(*args: Any, **kwargs: Any) -> Any:
            out = native(*args, **kwargs)
            if not self.applies(*args, **kwargs):
                return out
            return tuple(self._err(t) for t in out) if isinstance(out, tuple) else self._err(out)

        return faulty

    def _err(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if self.kind == "scale":
            return t * (1 + self.error)
        signs = torch.randint(0, 2, t.shape, generator=torch.Generator().manual_seed(0)).to(t.device) * 2 - 1
        return t + t * (signs.to(t.dtype) * self.error)


@contextlib.contextmanager
def installed(fault: Fault, name: str = "faulty") -> Iterator[None]:
    """The fault registered as a provider of its op, first in its priority, for the block."""
    thresholds = CONDITIONS[fault.op][fault.condition][1]
    ops.register_provider(fault.op, name, fault.provider(), differentiable=True, thresholds=thresholds)
    ops.set_priority([name], op=fault.op)
    try:
        yield
    finally:
        ops.set_priority(None, op=fault.op)
        ops.unregister_provider(fault.op, name)


# ---- a model's call of each op, and calls at shapes where a condition holds -------------------

# Where each condition holds, as sizes for the op's own sampler (``Sampler.make``): the witness
# shapes are chosen apart from the classes conformance checks.
WITNESS_SIZES: dict[str, dict[str, tuple]] = {
    "rows": {"always": ((("rows", 9),), "random"), "one row": ((("rows", 1),), "random"),
             "batch > 1": ((("batch", 3), ("rows", 4)), "random"), "rows >= 65": ((("rows", 100),), "random")},
    "rotary": {"always": ((("batch", 1), ("seq", 5)), "random"), "one position": ((("batch", 2), ("seq", 1)), "random"),
               "batch > 1": ((("batch", 3), ("seq", 4)), "random"), "seq >= 9": ((("batch", 1), ("seq", 12)), "random")},
    "moe_experts": {"always": ((("tokens", 5),), "random"), "tokens < 4 (a decode path)": ((("tokens", 2),), "random"),
                    "an idle expert": ((("tokens", 7),), "one idle"),
                    "all tokens to the same experts": ((("tokens", 6),), "one group")},
    "decode_attention": {"always": ((("batch", 1), ("length", 10)), "random"),
                         "batch > 1": ((("batch", 3), ("length", 10)), "random"),
                         "length >= 65": ((("batch", 1), ("length", 100)), "random")},
}  # fmt: skip


def template(op: str, dtype: torch.dtype) -> tuple[tuple, dict]:
    """A call of ``op`` as a small model makes it (random non-zero values)."""
    g = torch.Generator().manual_seed(3)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    flags = ops.RMSNormSpec().flags()
    if op == "rms_norm":
        return (rand(1, 32, 64), 1 + rand(64, scale=0.1), 1e-6, *flags), {}
    if op == "fused_add_rms_norm":
        return (rand(1, 32, 64), rand(1, 32, 64), 1 + rand(64, scale=0.1), 1e-6, *flags), {}
    if op == "silu_and_mul":
        return (rand(1, 32, 128, scale=2.0),), {}
    if op == "rotary":
        angle = torch.rand(1, 32, 8, generator=g) * 6
        angle = torch.cat([angle, angle], -1)
        return (rand(1, 4, 32, 16), rand(1, 2, 32, 16), angle.cos().to(dtype), angle.sin().to(dtype), 1), {}
    if op == "moe_experts":
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(32)])
        weights = torch.rand(32, 2, generator=g).softmax(-1)
        return (rand(32, 64), weights, ids, rand(4, 64, 64, scale=0.1), rand(4, 64, 32, scale=0.1), None, None,
                "silu", False, True, False, False, 1.0, float("inf")), {}  # fmt: skip
    if op == "decode_attention":
        return (rand(1, 4, 1, 16), rand(1, 2, 40, 16), rand(1, 2, 40, 16), torch.zeros(2, 1, 40, dtype=dtype), 0.25), {}
    raise ValueError(op)


def witness(fault: Fault, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call of the fault's op, like ``args``, at a shape where its condition holds."""
    from transfuse.ops.conformance import ShapeClass

    family = fault.op if fault.op in WITNESS_SIZES else "rows"
    sizes, data = WITNESS_SIZES[family][fault.condition]
    sampler = ops.get_op(fault.op).sampler
    return sampler.make(ShapeClass("witness", sizes, data=data), args, kwargs, torch.Generator().manual_seed(5))
