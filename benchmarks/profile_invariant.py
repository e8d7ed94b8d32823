"""Where batch-invariant mode's time goes: the kernels of a decode step and of a prompt's forward,
the default mode's and the mode's side by side.

    python benchmarks/profile_invariant.py --out DIR [--model llama qwen3_moe] [--batch 1 32] [--new 16] [--prefill 2048]
    python benchmarks/profile_invariant.py --tiny --out DIR        # a dry run on a CPU

The models of ``bench_batch_invariant.py`` (random bf16 weights), each mode on the step-graph path
(``transfuse.decode_steps``). Decode: ``--new`` greedy tokens of a 128-token prompt under the
profiler, less a profiled generate of one token, per decode token. Prefill: one forward over
``--prefill`` tokens. Per mode: the kernel time in all (busy), the wall time under the profiler,
and the largest kernels by name side by side. Writes DIR/profile_invariant.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_batch_invariant import build, prepared  # noqa: E402
import bench_full_size  # noqa: E402


def generate(model, ids: torch.Tensor, new: int) -> None:
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)


def prefill_profile(model, ids: torch.Tensor) -> dict:
    def forward():
        with torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids), use_cache=False)

    forward()
    profiled = bench_full_size._profiled(forward)
    top = sorted(profiled["by_name"].items(), key=lambda item: -item[1])[:20]
    return {**{k: v for k, v in profiled["split"].items()}, "busy": profiled["busy"],
            "wall under the profiler": profiled["wall"], "kernels": {name[:120]: ms for name, ms in top}}  # fmt: skip


def section(title: str, by_mode: dict[str, dict]) -> list[str]:
    modes = list(by_mode)
    # Kernel time in all, and the wall time; no split by kind: the mode's GEMM and the default
    # mode's decode attention both have a ``_partial_kernel``, which a split by name confuses.
    kinds = ["busy", "wall under the profiler"]
    lines = [f"### {title}", "", "| ms | " + " | ".join(modes) + " |", "| --- |" + " ---: |" * len(modes)]
    lines += [f"| {kind} | " + " | ".join(f"{by_mode[m][kind]:.3f}" for m in modes) + " |" for kind in kinds]
    names = sorted({n for m in modes for n in by_mode[m]["kernels"]},
                   key=lambda n: -max(by_mode[m]["kernels"].get(n, 0.0) for m in modes))  # fmt: skip
    lines += ["", "| kernel | " + " | ".join(modes) + " |", "| --- |" + " ---: |" * len(modes)]
    for name in names:
        cells = [f"{by_mode[m]['kernels'][name]:.4f}" if name in by_mode[m]["kernels"] else "" for m in modes]
        lines.append(f"| `{name[:90]}` | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", nargs="+", default=["llama", "qwen3_moe"], choices=["llama", "qwen3_moe"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cpu":
        bench_full_size._profiled = _cpu_profiled  # the CPU's dry run: wall time only
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "profiles": {}}  # fmt: skip
    lines = ["# Batch-invariant mode's kernels against the default mode's", "",
             f"`python {' '.join(sys.argv)}`", "",
             f"{results['device']}, torch {torch.__version__}; step-graph path; ms per decode token "
             "(a generate of one token profiled and taken away) or per prompt forward.", ""]  # fmt: skip
    for name in args.model:
        stock = build(name, device, args.tiny)
        vocab = stock.config.vocab_size
        g = torch.Generator().manual_seed(0)
        by_title: dict[str, dict[str, dict]] = {}
        for mode in ("default", "invariant"):
            model = prepared(stock, mode, "steps")
            for batch in args.batch:
                ids = torch.randint(1, vocab, (batch, args.prompt), generator=g).to(device)
                generate(model, ids, args.new)
                title = f"{name} decode batch {batch}"
                by_title.setdefault(title, {})[mode] = bench_full_size.profile_split(
                    lambda: generate(model, ids, args.new), args.new, lambda: generate(model, ids, 1))
                print(title, mode, {k: round(v, 3) for k, v in by_title[title][mode].items() if isinstance(v, float)},
                      flush=True)  # fmt: skip
            if args.prefill:
                ids = torch.randint(1, vocab, (1, args.prefill), generator=g).to(device)
                title = f"{name} prefill {args.prefill}"
                by_title.setdefault(title, {})[mode] = prefill_profile(model, ids)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        for title, by_mode in by_title.items():
            lines += section(title, by_mode)
        results["profiles"][name] = by_title
        del stock
    with open(os.path.join(args.out, "profile_invariant.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "profile_invariant.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _cpu_profiled(fn) -> dict:
    start = time.perf_counter()
    fn()
    wall = (time.perf_counter() - start) * 1e3
    return {"split": {"GEMM/GEMV": 0.0, "attention": 0.0, "other kernels": 0.0}, "by_name": {"(cpu wall)": wall},
            "busy": 0.0, "wall": wall}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
