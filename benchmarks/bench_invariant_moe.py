"""The batch-invariant mode's MoE experts on the GPU: tiles for each token count, and their bits.

    python benchmarks/bench_invariant_moe.py --out DIR [--tokens 1 8 32 256 2048]

Qwen3-MoE expert shapes (hidden 2048, intermediate 768, 128 experts, top 8), bf16 random weights.
For each token count: the default mode's ``moe_experts`` (decode or grouped path, tiles by token
count) and, in the mode, the grouped path with each candidate tile set of ``CANDIDATES`` (every one
with the mode's reduction block, ``block_k`` 64), each call timed
inside a CUDA graph (median of 5 replays). Bits: token 0's output in each candidate at each token
count against token 0 alone with ``INVARIANT_CONFIG``; a candidate whose bits differ cannot be used
for that token count in the mode. Writes DIR/invariant_moe.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import time_graph  # noqa: E402
from transfuse import ops  # noqa: E402
from transfuse.ops.dispatch import batch_invariant_mode  # noqa: E402
from transfuse.ops.triton.moe_configs import INVARIANT_CONFIG, MoEConfig, using_config  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
CANDIDATES = [
    INVARIANT_CONFIG,
    MoEConfig(64, 32, 64, 4, 3),
    MoEConfig(64, 64, 64, 4, 3),
    MoEConfig(64, 64, 64, 4, 4),
    MoEConfig(64, 128, 64, 4, 4),
    MoEConfig(64, 256, 64, 8, 3),
    MoEConfig(128, 128, 64, 8, 3),
    MoEConfig(128, 256, 64, 8, 3),
    # block_m under 64: another instruction for the products on Hopper (mma rather than wgmma);
    # timed, and their bits shown, to learn whether a few rows may take smaller tiles.
    MoEConfig(16, 64, 64, 4, 4),
    MoEConfig(16, 128, 64, 4, 4),
    MoEConfig(32, 64, 64, 4, 4),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, dtype=dtype) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=device, dtype=dtype) / INTER**0.5
    router = torch.randn(EXPERTS, HIDDEN, device=device, dtype=dtype) / HIDDEN**0.5
    ops.set_priority(["triton"], op="moe_experts")
    ops.set_priority(["triton"], op="moe_route")
    x_all = torch.randn(max(args.tokens), HIDDEN, device=device, dtype=dtype)
    weights_all, ids_all = ops.moe_route(x_all @ router.t(), TOP_K)

    def run(tokens: int, config=None, invariant: bool = True):
        x, weights, ids = x_all[:tokens], weights_all[:tokens], ids_all[:tokens]

        def call():
            if not invariant:
                return ops.moe_experts(x, weights, ids, w13, w2)
            with batch_invariant_mode(), using_config(config):
                return ops.moe_experts(x, weights, ids, w13, w2)

        return call

    reference = run(1, INVARIANT_CONFIG)()[0].clone()
    rows = []
    for tokens in args.tokens:
        default = run(tokens, invariant=False)
        default()
        row = {"tokens": tokens, "default_us": time_graph(default, [()], repeats=5), "configs": []}
        for config in CANDIDATES:
            fn = run(tokens, config)
            same = torch.equal(fn()[0], reference)
            row["configs"].append({"config": config.describe(), "us": time_graph(fn, [()], repeats=5), "token0_same_bits": same})
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(os.path.join(args.out, "invariant_moe.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# The mode's MoE experts, Qwen3-MoE expert shapes ({result['device']}, torch {result['torch']})", "",
        f"`python benchmarks/bench_invariant_moe.py {shlex.join(argv or sys.argv[1:])}`", "",
        "us a call (CUDA graph, median of 5); `=`: token 0 the same bits as alone with INVARIANT_CONFIG.", "",
        "| tokens | default | " + " | ".join(c.describe() for c in CANDIDATES) + " |",
        "| ---: | ---: |" + " ---: |" * len(CANDIDATES),
    ]  # fmt: skip
    for row in rows:
        cells = [f"{c['us']:.1f} {'=' if c['token0_same_bits'] else 'DIFFERS'}" for c in row["configs"]]
        lines.append(f"| {row['tokens']} | {row['default_us']:.1f} | " + " | ".join(cells) + " |")
    with open(os.path.join(args.out, "invariant_moe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
