"""Sweep the Triton rms_norm, fused_add_rms_norm, silu_and_mul and gelu_and_mul launch shapes against torch.compile.

    python benchmarks/sweep_triton_ops.py --out DIR [--tokens 1 16 256 4096 32768]

For each op and token count (hidden 4096, bf16) it times, in CUDA-graph replays over rotated
inputs (``bench_ops.time_graph``), ``torch.compile`` of the Hugging Face code (before and after
the sweep, so the table shows its run-to-run spread), the CUDA provider, the Triton kernel with
its default launch shape, and under each launch shape of the grid below, checked against native
first. The norms vary rows per program and warps; the act-and-mul ops the block, the warps, and
whether the loads are predicated when the blocks tile the row. Writes DIR/sweep.md and
DIR/sweep.json: per size, the fastest shape and how it compares with torch.compile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_ops  # noqa: E402

from transfuse.ops.triton import act_and_mul as triton_act  # noqa: E402
from transfuse.ops.triton import rms_norm as triton_norm  # noqa: E402

NORM_GRID = {"rows": (1, 2), "num_warps": (4, 8, 16)}
# "masked": the act-and-mul kernel predicates its loads even where its blocks tile the row exactly.
ACT_GRID = {"block": (512, 1024, 2048, 4096), "num_warps": (2, 4, 8, 16), "masked": (False, True)}


def configs(grid: dict, tokens: int):
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values))
        if config.get("rows", 1) > tokens:
            continue
        yield config


def sweep_case(op: str, tokens: int, hidden: int) -> dict:
    case = bench_ops.build_case(op, tokens, hidden, torch.bfloat16)
    example = case.make_inputs()
    sets = bench_ops._input_sets(case.make_inputs, case.min_bytes)
    result = {"op": op, "tokens": tokens, "triton": []}
    result["compile_before"] = bench_ops.time_graph(case.variants["hf compile"], sets)
    if "cuda" in case.variants and case.variants["cuda"].supports(*example):
        try:
            result["cuda"] = bench_ops.time_graph(case.variants["cuda"], sets)
        except Exception as exc:  # noqa: BLE001 - an unbuilt extension is reported, not fatal
            result["cuda_error"] = f"{type(exc).__name__}: {exc}"
    tuning = triton_norm.TUNING if "rms_norm" in op else triton_act.TUNING
    grid = NORM_GRID if "rms_norm" in op else ACT_GRID
    triton = case.variants["triton"]
    native = case.variants["native"]
    for config in configs(grid, tokens):
        tuning.clear()
        tuning.update(config)
        try:
            note = bench_ops.check_against_native(triton, native, example, torch.bfloat16)
            us = None if note else bench_ops.time_graph(triton, sets)
        except Exception as exc:  # noqa: BLE001 - a shape Triton cannot compile is recorded and skipped
            note, us = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", None
        result["triton"].append({"config": config, "us": us, "note": note})
    tuning.clear()
    result["default"] = bench_ops.time_graph(triton, sets)
    result["compile_after"] = bench_ops.time_graph(case.variants["hf compile"], sets)
    return result


def markdown(results: list[dict], command: str) -> str:
    lines = [
        "# Triton launch shapes against torch.compile (graph us per call, bf16, hidden 4096)",
        "",
        f"Command: `{command}`",
        "",
        "| op | tokens | compile (before / after) | cuda | triton default | best triton | best shape |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        timed = [t for t in r["triton"] if t["us"] is not None]
        best = min(timed, key=lambda t: t["us"]) if timed else None
        cuda = f"{r['cuda']:.2f}" if "cuda" in r else ""
        lines.append(
            f"| {r['op']} | {r['tokens']} | {r['compile_before']:.2f} / {r['compile_after']:.2f} | {cuda} | "
            f"{r['default']:.2f} | {best['us']:.2f} | {best['config']} |"
            if best
            else f"| {r['op']} | {r['tokens']} | {r['compile_before']:.2f} | {cuda} | {r['default']:.2f} | - | - |"
        )
    for r in results:
        lines += ["", f"## {r['op']} @ {r['tokens']}", ""]
        for t in sorted(r["triton"], key=lambda t: (t["us"] is None, t["us"] or 0)):
            lines.append(f"- {t['config']}: " + (f"{t['us']:.2f} us" if t["us"] is not None else t["note"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096, 32768])
    parser.add_argument("--ops", nargs="+", default=["rms_norm", "fused_add_rms_norm", "silu_and_mul"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python3 " + " ".join([f"benchmarks/{Path(__file__).name}", *(argv or sys.argv[1:])])
    bench_ops.build_cuda_extension(args.out)
    torch.manual_seed(0)
    results = []
    started = time.perf_counter()
    with torch.no_grad():
        for op in args.ops:
            for tokens in args.tokens:
                results.append(sweep_case(op, tokens, args.hidden))
                (args.out / "sweep.md").write_text(markdown(results, command))
                (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
                print(f"{op} @{tokens} done ({time.perf_counter() - started:.0f} s)", flush=True)
    print(markdown(results, command).split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
