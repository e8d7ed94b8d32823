"""Whole-model forward time: transfuse against transformers, eager and compiled, in one run.

A Llama-3-8B-shaped model (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocab
128256) with a few layers and random bf16 weights, forward over T tokens (no cache), for:

  transformers eager | transfuse eager | transformers compiled | transfuse compiled
  (compiled transfuse in both compile modes: native code inlined for Inductor, and the
  dispatched library ops as opaque nodes)

and, at T=1, the memory-bandwidth floor: the bytes of the weights a token must read once
(all of them but the input embedding table, of which a lookup reads one row, unless it is
tied to the output head) over the copy bandwidth measured in the same run. Before timing, each variant's logits are compared with
transformers eager (relative error over the logit scale).

    python benchmarks/bench_e2e.py --out DIR [--layers 4] [--tokens 1 16 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfuse  # noqa: E402
from transfuse import ops  # noqa: E402

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def build(layers: int, shape: dict, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", num_hidden_layers=layers, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (bytes read plus bytes written)."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device) / 1e3
    return 2 * src.numel() / seconds


def time_fn(fn, device: str, repeats: int = 20) -> float:
    """Median milliseconds of ``fn`` after warm-up (CUDA events on the GPU)."""
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (to check the script on a CPU)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--fusions", nargs="+", default=None, help="fusion kinds for transfuse (default: all)")
    parser.add_argument("--variants", nargs="+", default=None, help="only variants whose name contains one of these")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = TINY if args.tiny else LLAMA3_8B

    baseline = build(args.layers, shape, device, dtype)
    fused = build(args.layers, shape, device, dtype)
    transfuse.rewrite(fused, fusions=args.fusions)
    print(transfuse.report(fused))
    embedding = baseline.get_input_embeddings().weight
    tied = embedding is baseline.get_output_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in baseline.parameters() if p is not embedding or tied)
    bandwidth = copy_bandwidth(device)
    print(f"weights {weight_bytes / 2**30:.2f} GiB; copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    variants = {"transformers eager": (baseline, None), "transfuse eager": (fused, None)}
    if not args.no_compile:
        variants["transformers compiled"] = (torch.compile(baseline), None)
        variants["transfuse compiled (native)"] = (torch.compile(fused), "native")
        variants["transfuse compiled (library ops)"] = (torch.compile(fused), "library")

    if args.variants:
        variants = {k: v for k, v in variants.items() if k == "transformers eager" or any(w in k for w in args.variants)}
    rows = []
    for tokens in args.tokens:
        ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
        with torch.inference_mode():
            reference = baseline(input_ids=ids, use_cache=False).logits
        floor_ms = weight_bytes / bandwidth * 1e3 if tokens == 1 else float("nan")
        for name, (model, mode) in variants.items():
            ops.set_compile_mode(mode)
            torch._dynamo.reset() if mode is not None else None
            try:

                def run(model=model, ids=ids):
                    with torch.inference_mode():
                        return model(input_ids=ids, use_cache=False).logits

                error = relative_error(run(), reference)
                with ops.trace() as log:
                    run()
                providers = sorted({f"{d.op}:{d.provider}" for d in log})
                ms = time_fn(run, device)
            finally:
                ops.set_compile_mode(None)
            rows.append(
                dict(tokens=tokens, variant=name, ms=ms, error=error, floor_ms=floor_ms, providers=providers)
            )
            print(f"T={tokens:5d} {name:34s} {ms:9.3f} ms  err {error:.2e}  {' '.join(providers)}", flush=True)

    suffix = "" if args.fusions is None else "_" + "_".join(args.fusions)
    with open(os.path.join(args.out, f"bench_e2e{suffix}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", layers=args.layers,
                       weight_bytes=weight_bytes, copy_bandwidth=bandwidth, rows=rows), f, indent=1)
    lines = [
        f"| tokens | variant | ms | vs transformers eager | vs floor | max rel. error |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        base = next(r["ms"] for r in rows if r["tokens"] == row["tokens"] and r["variant"] == "transformers eager")
        floor = f"{row['ms'] / row['floor_ms']:.2f}x" if row["floor_ms"] == row["floor_ms"] else ""
        lines.append(
            f"| {row['tokens']} | {row['variant']} | {row['ms']:.3f} | {base / row['ms']:.2f}x | {floor} | {row['error']:.1e} |"
        )
    table = "\n".join(lines)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    header = f"Command: `python3 {' '.join(sys.argv)}` on {device_name}, {args.layers} layers\n\n"
    with open(os.path.join(args.out, f"bench_e2e{suffix}.md"), "w") as f:
        f.write(header + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
