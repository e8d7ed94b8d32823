"""Sweep the Triton rms_norm, fused_add_rms_norm, silu_and_mul and gelu_and_mul launch shapes against torch.compile.

    python benchmarks/sweep_triton_ops.py --out DIR [--tokens 1 16 256 4096 32768]

For each op and token count (hidden 4096, bf16) it times, in CUDA-graph replays over rotated
inputs (``bench_ops.time_graph``), ``torch.compile`` of the Hugging Face code (before and after
the sweep, so the table shows its run-to-run spread), the CUDA provider, the Triton kernel with
its default launch shape, and under each launch shape of the grid below, checked against native
first. The norms vary rows per program and warps; the act-and-mul ops the block, the warps, and
whether the loads are predicated when the blocks tile the row. With ``--paired N`` the N fastest
shapes and the default are timed once more against torch.compile in alternating replays
(``bench_ops.time_paired``), which resolves the few-ns gaps that separate medians do not.
Writes DIR/sweep.md and DIR/sweep.json: per size, the fastest shape and how it compares with
torch.compile; and DIR/inductor.md: the Triton kernel torch.compile generated for each size and
the launch configuration its autotuning kept.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import re
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
# Blocks down to 128: torch.compile's pointwise heuristic launches 128-512 element blocks of 4 warps
# at 1-16 rows of 4096 (one or two elements a thread).
ACT_GRID = {
    "block": (128, 256, 512, 1024, 2048, 4096),
    "num_warps": (1, 2, 4, 8, 16),
    "masked": (False, True),
}


def configs(grid: dict, tokens: int):
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values))
        if config.get("rows", 1) > tokens:
            continue
        if config.get("block", 2**31) < 32 * config["num_warps"]:  # more threads than elements
            continue
        yield config


def inductor_kernels(fn, inputs) -> dict:
    """Compile ``fn`` (a fresh ``torch.compile`` wrapper) on ``inputs``: the code Inductor generated
    and the launch configuration each of its Triton kernels kept after autotuning."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from torch._inductor.utils import run_and_get_code

    def autotuners() -> dict:
        # type(), not isinstance: the latter asks dead weak proxies for their __class__
        return {id(o): o for o in gc.get_objects() if issubclass(type(o), CachingAutotuner)}

    before = autotuners()
    _, code = run_and_get_code(fn, *inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    launches = []
    for key, tuner in autotuners().items():
        if key not in before:
            launchers = getattr(tuner, "launchers", None) or []
            kept = str(launchers[0].config) if len(launchers) == 1 else f"{len(launchers)} launchers"
            if launchers:  # (a second, empty autotuner per kernel is Inductor's own bookkeeping)
                launches.append(f"{tuner.fn.__name__}: {kept}")
    return {"code": "\n\n".join(kernel_sources("\n".join(code))), "launches": launches}


def kernel_sources(code: str) -> list[str]:
    """The Triton kernels (heuristics decorator to the end of the source) in Inductor's output."""
    kernels = re.findall(r"async_compile\.triton\('\w+', '''(.*?)''', device_str", code, flags=re.S)
    return [k[k.index("@triton_heuristics") :].strip() if "@triton_heuristics" in k else k.strip() for k in kernels]


def sweep_case(op: str, tokens: int, hidden: int, paired: int) -> dict:
    case = bench_ops.build_case(op, tokens, hidden, torch.bfloat16)
    example = case.make_inputs()
    sets = bench_ops._input_sets(case.make_inputs, case.min_bytes)
    result = {"op": op, "tokens": tokens, "triton": []}
    try:
        result["inductor"] = inductor_kernels(case.variants["hf compile"], example)
    except Exception as exc:  # noqa: BLE001 - the listing is a nicety; the timings still count
        result["inductor"] = {"code": "", "launches": [f"unavailable: {type(exc).__name__}: {exc}"]}
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
    timed = sorted((t for t in result["triton"] if t["us"] is not None), key=lambda t: t["us"])
    result["paired"] = []
    candidates = [None, *(t["config"] for t in timed[:paired])] if paired else []  # None: the default
    for config in candidates:
        tuning.clear()
        tuning.update(config or {})
        pair = bench_ops.time_paired(triton, case.variants["hf compile"], sets)
        result["paired"].append({"config": config or "default", **pair})
    tuning.clear()
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
    if any(r.get("paired") for r in results):
        lines += [
            "",
            "## Against torch.compile in alternating replays (ours / compile, median of 40 rounds)",
            "",
            "| op | tokens | shape | ours us | compile us | ratio | slower rounds |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        for r in results:
            for p in r.get("paired", []):
                lines.append(
                    f"| {r['op']} | {r['tokens']} | {p['config']} | {p['us']:.3f} | {p['baseline_us']:.3f} | "
                    f"{p['ratio']:.3f} | {p['slower_rounds']}/{p['rounds']} |"
                )
    for r in results:
        lines += ["", f"## {r['op']} @ {r['tokens']}", ""]
        for t in sorted(r["triton"], key=lambda t: (t["us"] is None, t["us"] or 0)):
            lines.append(f"- {t['config']}: " + (f"{t['us']:.2f} us" if t["us"] is not None else t["note"]))
    return "\n".join(lines) + "\n"


def inductor_markdown(results: list[dict], command: str) -> str:
    lines = ["# The kernels torch.compile generated for the Hugging Face code", "", f"Command: `{command}`"]
    for r in results:
        lines += ["", f"## {r['op']} @ {r['tokens']}", "", *[f"- {x}" for x in r["inductor"]["launches"]]]
        lines += ["", "```python", r["inductor"]["code"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096, 32768])
    parser.add_argument("--ops", nargs="+", default=["rms_norm", "fused_add_rms_norm", "silu_and_mul"])
    parser.add_argument("--paired", type=int, default=0, help="time the N fastest shapes against compile in pairs")
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
                results.append(sweep_case(op, tokens, args.hidden, args.paired))
                (args.out / "sweep.md").write_text(markdown(results, command))
                listed = [{k: v for k, v in r.items() if k != "inductor"} for r in results]  # in inductor.md
                (args.out / "sweep.json").write_text(json.dumps(listed, indent=1))
                (args.out / "inductor.md").write_text(inductor_markdown(results, command))
                print(f"{op} @{tokens} done ({time.perf_counter() - started:.0f} s)", flush=True)
    print(markdown(results, command).split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
