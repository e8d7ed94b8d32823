"""Where a compiled decode step's host time goes: each layer of the call, timed on the host.

    python benchmarks/decode_host.py [--model qwen3_moe|llama] [--batch 1] [--prompt 512] [--new 128]

The model of ``bench_decode.py``, ``transfuse.compile``'d four times (``replay=False``: every
step through Dynamo; ``lean_loop=False``: transformers' own decoding loop; the defaults;
``trust_modules=True``), warmed up, then one ``generate`` with the layers of the compiled call
wrapped in host timers: the whole call (``_Compiled.__call__``), the Dynamo-compiled function
inside it, the backend's whole-step graph (``StepGraph``), the replay itself, and the
``KVStore``'s work before and after the step; then the rewritten model uncompiled, its decode
steps replayed as graphs of its eager forward (``TRANSFUSE_STEP_GRAPHS=1``:
``transfuse/compile/eager_steps.py``), its call timed the same way. Each is the host time per token (the GPU is not
waited for; with the deferred stop check the host runs ahead until ``generate`` reads the flag
of the step before). What is left of the token's wall time is ``generate``'s own loop, which
includes that wait. Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfuse  # noqa: E402
from bench_decode import build, generate  # noqa: E402
from transfuse.compile import backend, kv_store, replay  # noqa: E402

TOTALS: dict[str, float] = collections.defaultdict(float)


def timed_method(cls, name: str, label: str):
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_moe")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stock = build(args.model, device)
    ids = torch.randint(0, stock.config.vocab_size, (args.batch, args.prompt), device=device)
    from transfuse import compile as compile_package

    timed_method(compile_package._Compiled, "__call__", "the compiled call")
    timed_method(replay.CallGraphs, "__call__", "  CallGraphs (the whole call replayed)")
    timed_method(backend.StepGraph, "__call__", "  StepGraph")
    timed_method(backend._Graph, "replay", "    the replay (input copies, launch, output copies)")
    timed_method(kv_store.KVStore, "begin", "  KVStore.begin")
    timed_method(kv_store.KVStore, "end", "  KVStore.end")
    timed_method(compile_package.eager_steps.EagerSteps, "__call__", "the eager path's call")
    for options in ({"replay": False}, {"lean_loop": False}, {}, {"trust_modules": True}, "eager"):
        if options == "eager":  # uncompiled, its steps as graphs of the eager forward
            os.environ["TRANSFUSE_STEP_GRAPHS"] = "1"
            model = transfuse.decode_steps(transfuse.rewrite(copy.deepcopy(stock)))
            options = {"eager, step graphs": True}
        else:
            model = transfuse.compile(transfuse.rewrite(copy.deepcopy(stock)), **options)
            dynamo = model._transfuse_compiled.compiled

            def inner(*a, _f=dynamo, **k):
                start = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    TOTALS["  the Dynamo-compiled function"] += time.perf_counter() - start

            model._transfuse_compiled.compiled = inner
        for _ in range(2):
            generate(model, ids, args.new)
        torch.cuda.synchronize() if device == "cuda" else None
        walls = []
        for new in (1, args.new):
            TOTALS.clear()
            start = time.perf_counter()
            generate(model, ids, new)
            if device == "cuda":
                torch.cuda.synchronize()
            walls.append((time.perf_counter() - start, dict(TOTALS)))
        (short, short_totals), (full, full_totals) = walls
        tokens = args.new - 1
        print(f"\n{args.model} batch {args.batch} {options or 'defaults'}: wall {(full - short) / tokens * 1e6:.0f} us a token")
        for label in full_totals:
            per = (full_totals[label] - short_totals.get(label, 0.0)) / tokens * 1e6
            print(f"  {label:<60} {per:8.1f} us")
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
