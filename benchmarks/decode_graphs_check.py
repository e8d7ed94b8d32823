"""Check the fused MoE layer's decode graphs (``transfuse.ops.graphs``) on a GPU and time their parts.

    python benchmarks/decode_graphs_check.py

Builds ``bench_moe.py``'s Qwen3-MoE block, fuses it, and under ``no_grad`` at 1 and 4 tokens (each
called twice first, as a shape is captured when seen the second time):
whether a graph is captured (and why not), whether replay equals running the layer, and the
host microseconds per call with and without the graph and of each part of a replay.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_moe  # noqa: E402

from transfuse.ops import dispatch, graphs  # noqa: E402
from transfuse.ops.moe_layer import _LAYER_GRAPHS  # noqa: E402


def host_us(fn, calls: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> int:
    fused = bench_moe.build_fused(bench_moe.build_block()[0])
    captures = []
    capture = graphs.SmallBatchGraphs._capture

    def counted(self, x, key):
        captures.append((key[:5], dispatch.generation()))
        return capture(self, x, key)

    graphs.SmallBatchGraphs._capture = counted
    a = torch.randn(1, 2048, device="cuda")
    print(f"torch add: {host_us(lambda: torch.add(a, a)):.1f} us", flush=True)
    with torch.no_grad():
        for tokens in (1, 4):
            x = torch.randn(1, tokens, bench_moe.HIDDEN, device="cuda", dtype=torch.bfloat16)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fused(x)  # a shape is captured when seen the second time
                out = fused(x)
            for w in caught:
                print("warning:", w.message)
            table = _LAYER_GRAPHS.get(fused)
            print(f"{tokens} token(s): graphable {table.graphable(x) if table else None}, "
                  f"captured {len(table._graphs) if table else 0}, failed {table.failed if table else None}")
            print("  replay == layer:", torch.equal(out, fused._forward(x)), flush=True)
            print(f"  captures so far: {len(captures)}, first: {captures[:1]}; generation now {dispatch.generation()}")
            print(f"  host us, graph: {host_us(lambda: fused(x)):.1f}", flush=True)
            print(f"  captures so far: {len(captures)}, last: {captures[-1:]}; generation now {dispatch.generation()}")
            if table:
                now = table._key(x)
                for k in table._graphs:
                    print("  stored key differs at", [i for i, (a, b) in enumerate(zip(k, now)) if a != b], k[:5])
            os.environ["TRANSFUSE_DECODE_GRAPHS"] = "0"
            print(f"  host us, eager: {host_us(lambda: fused(x)):.1f}", flush=True)
            del os.environ["TRANSFUSE_DECODE_GRAPHS"]
            if table and table._graphs:
                graph, static_x, static_out = table._graphs[table._key(x)]
                for name, fn in (
                    ("graphable", lambda: table.graphable(x)),
                    ("key", lambda: table._key(x)),
                    ("copy in", lambda: static_x.copy_(x)),
                    ("replay", graph.replay),
                    ("copy out", lambda: graphs.copy_out(static_out)),
                ):
                    print(f"  part {name}: {host_us(fn):.1f} us", flush=True)
        # The capture steps by hand, with the traceback, should the table have failed.
        if table is not None and table.failed:
            x = torch.randn(1, 1, bench_moe.HIDDEN, device="cuda", dtype=torch.bfloat16)
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fused._forward(x)
                print("manual capture without the warm-up and sync check: OK")
            except Exception:
                traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
