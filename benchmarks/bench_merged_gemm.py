"""Merged projections against separate ones, at Llama-3-8B's shapes, eager and compiled.

The QKV and gate/up fusions replace three (two) matrix products of one input by one with
the weights concatenated. This measures, per token count, the separate products as the
model writes them against the merged product as the rewritten model runs it:

  qkv:     q, k, v = x·Wq, x·Wk, x·Wv        vs  x·[Wq|Wk|Wv], split
  gate_up: silu(x·Wg) * (x·Wu)               vs  act_and_mul(x·[Wg|Wu])

each eager and under ``torch.compile``, with CUDA events (median), bf16.

    python benchmarks/bench_merged_gemm.py --out DIR [--tokens 1 16 512 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_e2e import time_fn  # noqa: E402  (the same median-of-CUDA-events timing)
from transfuse.ops import act_and_mul  # noqa: E402

HIDDEN, Q, KV, INTER = 4096, 4096, 1024, 14336


def separate_qkv(x, wq, wk, wv):
    return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)


def merged_qkv(x, w):
    return F.linear(x, w).split((Q, KV, KV), dim=-1)


def separate_glu(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def merged_glu(x, w):
    return act_and_mul(F.linear(x, w), "silu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512, 4096])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    wq, wk, wv = (torch.randn(n, HIDDEN, device=dev, dtype=dt) * 0.02 for n in (Q, KV, KV))
    wg, wu = (torch.randn(INTER, HIDDEN, device=dev, dtype=dt) * 0.02 for _ in range(2))
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    cases = {
        "qkv": (lambda x: separate_qkv(x, wq, wk, wv), lambda x: merged_qkv(x, wqkv)),
        "gate_up": (lambda x: separate_glu(x, wg, wu), lambda x: merged_glu(x, wgu)),
    }
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt)
        for name, (separate, merged) in cases.items():
            for mode in ("eager", "compiled"):
                sep = torch.compile(separate) if mode == "compiled" else separate
                mer = torch.compile(merged) if mode == "compiled" else merged
                with torch.inference_mode():
                    s_ms, m_ms = time_fn(lambda: sep(x), dev, 50), time_fn(lambda: mer(x), dev, 50)
                rows.append(dict(tokens=tokens, case=name, mode=mode, separate_ms=s_ms, merged_ms=m_ms))
                print(f"T={tokens:5d} {name:8s} {mode:9s} separate {s_ms:8.4f} ms  merged {m_ms:8.4f} ms  "
                      f"({s_ms / m_ms:.2f}x)", flush=True)
    lines = ["| tokens | case | mode | separate ms | merged ms | speed-up |", "| ---: | --- | --- | ---: | ---: | ---: |"]
    lines += [
        f"| {r['tokens']} | {r['case']} | {r['mode']} | {r['separate_ms']:.4f} | {r['merged_ms']:.4f} | "
        f"{r['separate_ms'] / r['merged_ms']:.2f}x |"
        for r in rows
    ]
    header = f"Command: `python benchmarks/bench_merged_gemm.py --out {args.out}` on {torch.cuda.get_device_name()}\n\n"
    with open(os.path.join(args.out, "bench_merged_gemm.md"), "w") as f:
        f.write(header + "\n".join(lines) + "\n")
    with open(os.path.join(args.out, "bench_merged_gemm.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
