"""Fuzzing provider conformance: random deliberately wrong providers, none of them ever kept.

Each case draws an op, one of the conditions its faults may have (``tests.faults``: always, or at
some shapes or data only, a size declared as a threshold), a dtype, a kind of error (a scale, or
noise) and its size (1-5% in bfloat16 and float16, 0.3-5% in float32). The fault is registered
first in its op's priority; a call as a model makes it is dispatched (its configuration is then
checked), then a call at a shape where the fault applies. A case fails when the faulty provider
runs there: a wrong output kept.

    python -m tests.fuzz_providers --cases 500 --seed 0     # the big run
    python -m pytest tests/test_fuzz_providers.py           # CI: a fixed, seeded 50
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

import torch

from transfuse import ops

from .faults import CONDITIONS, Fault, installed, template, witness

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def draw(rng: random.Random) -> tuple[Fault, torch.dtype]:
    op = rng.choice(sorted(CONDITIONS))
    condition = rng.choice(sorted(CONDITIONS[op]))
    dtype = rng.choice(DTYPES)
    low = 0.003 if dtype == torch.float32 else 0.01
    return Fault(op, condition, rng.uniform(low, 0.05), rng.choice(("scale", "noise"))), dtype


def run_case(fault: Fault, dtype: torch.dtype) -> str:
    """"refused" (the fault never ran where it is wrong), or "kept"."""
    args, kwargs = template(fault.op, dtype)
    with installed(fault):
        ops.get_op(fault.op)(*args, **kwargs)
        wrong_args, wrong_kwargs = witness(fault, args, kwargs)
        assert fault.applies(*wrong_args, **wrong_kwargs), fault.describe()
        with ops.trace() as calls:
            ops.get_op(fault.op)(*wrong_args, **wrong_kwargs)
    return "kept" if any(c.provider == "faulty" for c in calls) else "refused"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, outcomes, kept = random.Random(args.seed), Counter(), []
    start = time.perf_counter()
    for _ in range(args.cases):
        fault, dtype = draw(rng)
        outcome = run_case(fault, dtype)
        outcomes[(fault.op, outcome)] += 1
        if outcome == "kept":
            kept.append(f"{fault.describe()} in {dtype}")
    print(f"`python -m tests.fuzz_providers --cases {args.cases} --seed {args.seed}`: {args.cases} cases in "
          f"{time.perf_counter() - start:.0f} s, {len(kept)} wrong outputs kept")  # fmt: skip
    print("\n| op | refused | kept |\n| --- | ---: | ---: |")
    for op in sorted({op for op, _ in outcomes}):
        print(f"| {op} | {outcomes[(op, 'refused')]} | {outcomes[(op, 'kept')]} |")
    for line in kept:
        print(f"kept: {line}")
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
