"""decode_attention on the GPU: the Triton provider against the native definition, at decode shapes.

    python benchmarks/decode_attention_kernel.py --out DIR [--quick]

The compile path's decode step calls ``ops.decode_attention`` once a layer, over a KV store's
whole capacity with the positions past the token masked (``transfuse/compile/kv_store.py``).
For Llama-3-8B's attention (32 query heads, 8 key/value heads, head size 128) and Qwen3-MoE's
(32 and 4), at batch 1 and 32 and a few capacities, each case is first checked: both providers'
relative error (Frobenius norm) against the same computation in float64, on random bf16 inputs
after the token's write, and the buffers each leaves behind compared bit for bit. Then both are
timed in alternating CUDA-graph replays over rotated inputs (``bench_ops.time_paired``), the
Triton kernel at its default launch and over a small grid of ``TUNING`` launches, with the bytes
the op must read (the keys and values of the whole capacity) as GB/s beside the copy bandwidth
measured in the same run. Writes DIR/decode_attention_kernel.md and .json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_ops  # noqa: E402

from transfuse.ops.decode_attention import decode_attention_native  # noqa: E402
from transfuse.ops.triton import decode_attention as triton_decode  # noqa: E402

DTYPE = torch.bfloat16
MODELS = {"llama": (32, 8, 128), "qwen3_moe": (32, 4, 128)}  # heads, kv heads, head size
GRID = {"block_n": (32, 64, 128), "num_warps": (2, 4, 8), "programs_per_sm": (1, 2, 4)}
QUICK = {"block_n": (64, 128), "num_warps": (4, 8), "programs_per_sm": (1, 2, 4)}


def inputs(batch: int, heads: int, kv_heads: int, dim: int, capacity: int, position: int):
    """One decode step's arguments: the query as attention's projection leaves it (a transposed
    view), full buffers, the token to write at ``position`` and the store's bias (positions past
    the token masked)."""
    query = torch.randn(batch, 1, heads, dim, device="cuda", dtype=DTYPE).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, capacity, dim, device="cuda", dtype=DTYPE)
    values = torch.randn(batch, kv_heads, capacity, dim, device="cuda", dtype=DTYPE)
    key = torch.randn(batch, kv_heads, 1, dim, device="cuda", dtype=DTYPE)
    value = torch.randn(batch, kv_heads, 1, dim, device="cuda", dtype=DTYPE)
    allowed = torch.arange(capacity, device="cuda") <= position
    bias = torch.zeros(batch * kv_heads, 1, capacity, device="cuda", dtype=DTYPE)
    bias.masked_fill_(~allowed, -math.inf)
    return query, keys, values, bias, 1 / math.sqrt(dim), key, value, torch.tensor([position], device="cuda")


def reference(query, keys, values, bias, scaling):
    """The native definition in float64 over the buffers as they are (the token already written):
    the same computation without rounding (``tests/test_decode_attention.py`` checks native
    against attention written out independently)."""
    return decode_attention_native(query.double(), keys.double(), values.double(), bias.double(), scaling)


def relative_error(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def check(args) -> dict:
    """Each provider's error against float64, and whether the buffers they write are equal."""
    query, keys, values, bias, scaling, key, value, position = args
    out = {}
    buffers = {}
    for name, fn in (("native", decode_attention_native), ("triton", triton_decode.decode_attention)):
        k, v = keys.clone(), values.clone()
        got = fn(query, k, v, bias, scaling, key, value, position)
        if got.isnan().any():
            raise RuntimeError(f"{name} gave NaN")
        out[f"{name}_error"] = relative_error(got, reference(query, k, v, bias, scaling))
        buffers[name] = (k, v)
    out["buffers_equal"] = all(torch.equal(a, b) for a, b in zip(buffers["native"], buffers["triton"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="a smaller launch grid")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    bandwidth = bench_ops.copy_bandwidth()
    grid = QUICK if args.quick else GRID
    rows = []
    torch.manual_seed(0)
    for model, (heads, kv_heads, dim) in MODELS.items():
        for batch, capacity in ((1, 768), (1, 4096), (32, 768), (32, 4096)):
            position = capacity - 130  # a store grows by half: its tail is masked
            sets = [inputs(batch, heads, kv_heads, dim, capacity, position) for _ in range(4)]
            checked = check(sets[0])
            read = 2 * batch * kv_heads * capacity * dim * DTYPE.itemsize
            timed = bench_ops.time_paired(triton_decode.decode_attention, decode_attention_native, sets)
            launches = {}
            for values in itertools.product(*grid.values()):
                launch = dict(zip(grid, values))
                triton_decode.TUNING.update(launch)
                try:
                    launches[" ".join(f"{k}={v}" for k, v in launch.items())] = bench_ops.time_graph(triton_decode.decode_attention, sets)
                finally:
                    triton_decode.TUNING.clear()
            best = min(launches, key=launches.get)
            row = dict(model=model, batch=batch, capacity=capacity, **checked,
                       native_us=timed["baseline_us"], triton_us=timed["us"], ratio=timed["ratio"],
                       slower_rounds=timed["slower_rounds"], rounds=timed["rounds"],
                       triton_gbs=read / timed["us"] / 1e3, best_launch=best, best_us=launches[best], launches=launches)
            rows.append(row)
            print(f"{model} batch {batch} capacity {capacity}: native {row['native_us']:.1f} us, triton "
                  f"{row['triton_us']:.1f} us ({row['triton_gbs']:.0f} GB/s), best {best} {launches[best]:.1f} us; "
                  f"errors {row['native_error']:.1e} / {row['triton_error']:.1e}, buffers equal {row['buffers_equal']}",
                  flush=True)
    command = "python benchmarks/decode_attention_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_gbs": bandwidth / 1e9, "rows": rows}
    (Path(args.out) / "decode_attention_kernel.json").write_text(json.dumps(result, indent=1))
    lines = [f"# decode_attention, Triton against native ({result['device']}, torch {result['torch']})", "",
             f"`{command}`", "", f"Copy bandwidth in this run: {result['copy_gbs']:.0f} GB/s. Times: median us a call of "
             f"alternating CUDA-graph replays ({rows[0]['rounds']} rounds); errors: relative to float64.", "",
             "| model | batch | capacity | native us | triton us | triton / native | triton GB/s | best launch (us) "
             "| native error | triton error | buffers equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['capacity']} | {r['native_us']:.1f} | {r['triton_us']:.1f} | "
                     f"{r['ratio']:.2f} | {r['triton_gbs']:.0f} | {r['best_launch']} ({r['best_us']:.1f}) | "
                     f"{r['native_error']:.1e} | {r['triton_error']:.1e} | {r['buffers_equal']} |")
    (Path(args.out) / "decode_attention_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
