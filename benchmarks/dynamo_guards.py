"""What Dynamo's guards cost a compiled decode step, with the module guards on and off.

    python benchmarks/dynamo_guards.py [--model qwen3_moe] [--layers 2 8] [--calls 2000]

A tiny random model (``transfuse.tiny``) of each layer count, rewritten and
``transfuse.compile``'d (``inductor=False``, a ``KVStore`` on any device), runs a short greedy
``generate``; the locals of its last decode step are then given to the guards of the Dynamo
entry that step ran (``DynamoEntries.serving``, the check a replay makes, ``replay.py``), in the
call's own context, ``--calls`` times. Prints the microseconds a check takes, with
``trust_modules`` off and on. The guards' cost grows with the module tree, not with the
weights, so a tiny model stands for a large one of as many layers. Nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfuse  # noqa: E402
from transfuse.compile.attention import IMPLEMENTATION  # noqa: E402
from transfuse.compile.calls import attention_implementation  # noqa: E402
from transfuse.tiny import tiny_model  # noqa: E402


def check_us(model_type: str, layers: int, trust_modules: bool, calls: int) -> float:
    torch.manual_seed(0)
    model = transfuse.rewrite(tiny_model(model_type, num_hidden_layers=layers).eval())
    transfuse.compile(model, inductor=False, kv_store=True, trust_modules=trust_modules)
    compiled = model._transfuse_compiled
    inner, frames = compiled.compiled, []

    def recording(*args, **kwargs):
        frames.append({"args": args, "kwargs": kwargs})
        return inner(*args, **kwargs)

    compiled.compiled = recording
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    frame = frames[-1]
    with torch.no_grad(), attention_implementation(compiled.configs, IMPLEMENTATION):
        if compiled.dynamo.serving(frame) is None:
            raise SystemExit(f"{model_type}, {layers} layers: no Dynamo entry's guards pass for the last decode step")
        for _ in range(calls // 10):
            compiled.dynamo.serving(frame)
        start = time.perf_counter()
        for _ in range(calls):
            compiled.dynamo.serving(frame)
        return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_moe")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    print(f"{args.model}, torch {torch.__version__}: microseconds a guard check of a decode step")
    print("| layers | module guards on | trust_modules |")
    print("|---:|---:|---:|")
    for layers in args.layers:
        on, off = (check_us(args.model, layers, trust, args.calls) for trust in (False, True))
        print(f"| {layers} | {on:.1f} | {off:.1f} |", flush=True)


if __name__ == "__main__":
    main()
