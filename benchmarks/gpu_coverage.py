"""Tiny models of many causal-LM types on a CUDA GPU in bf16: does the rewrite stay as close to a
float32 reference as the stock model does, with the GPU's own providers?

    python benchmarks/gpu_coverage.py --out DIR [--types mixtral llama4_text ...] [--jobs 8]

For each type (default: every type the committed coverage table ran), in a subprocess of its own:
the stock model from its tiny config (``transfuse.tiny``) in float32 on the GPU gives the reference
logits; the same weights in bf16 give the stock model's own error against it; the bf16 copy,
rewritten, gives transfuse's. A row is ``worse`` when transfuse's error is over 1.5 times the stock
model's and over 1e-2 of the logits' scale (bf16 noise on random weights); its error is then
measured again with each op's GPU provider in turn replaced by the native definition. The providers
each fused op ran with are listed (``transfuse.ops.trace``). Writes ``DIR/gpu_coverage.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "coverage.json"
RATIO, FLOOR = 1.5, 1e-2


def run_type(model_type: str, device: str = "cuda") -> dict:
    import torch

    import transfuse
    from transfuse import ops
    from transfuse.tiny import tiny_model

    row: dict = {"model_type": model_type}
    try:
        reference_model = tiny_model(model_type).to(device).eval()
        vocab = reference_model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.no_grad():
            reference = reference_model(input_ids=ids, use_cache=False).logits.float()
        stock = copy.deepcopy(reference_model).to(torch.bfloat16)
        del reference_model
        with torch.no_grad():
            stock_logits = stock(input_ids=ids, use_cache=False).logits.float()
    except Exception as exc:  # noqa: BLE001 - a type that does not run here is a row
        row.update(status="stock fails", message=f"{type(exc).__name__}: {str(exc)[:200]}")
        return row
    scale = max(reference.abs().max().item(), 1e-30)
    row["stock_error"] = (stock_logits - reference).abs().max().item() / scale
    try:
        transfuse.rewrite(stock)
        row["fused"] = transfuse.report(stock).counts()
        with ops.trace() as calls, torch.no_grad():
            got = stock(input_ids=ids, use_cache=False).logits.float()
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - recorded: a failure inside transfuse on the GPU
        row.update(status="crash", message=f"{type(exc).__name__}: {str(exc)[:300]}", trace=traceback.format_exc()[-1500:])
        return row
    row["providers"] = sorted({f"{c.op}:{c.provider}" for c in calls})
    row["error"] = (got - reference).abs().max().item() / scale
    worse = row["error"] > RATIO * row["stock_error"] and row["error"] > FLOOR
    row["status"] = "worse" if worse else "ok"
    if worse:  # which op's GPU provider it is: each in turn forced to its native definition
        row["error_with_native"] = {}
        for op in sorted({c.op for c in calls if c.provider != "native"}):
            ops.set_priority(["native"], op)
            try:
                with torch.no_grad():
                    alone = stock(input_ids=ids, use_cache=False).logits.float()
                row["error_with_native"][op] = (alone - reference).abs().max().item() / scale
            finally:
                ops.set_priority(None, op)
    return row


def _subprocess(model_type: str, timeout: float, device: str) -> dict:
    command = [sys.executable, __file__, "--one", model_type, "--device", device]
    env = {**os.environ, "TRANSFUSE_PROGRESS": "0"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "timeout"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {"model_type": model_type, "status": "crash", "message": (done.stderr or done.stdout)[-300:]}


def _default_types() -> list[str]:
    rows = json.loads(RESULTS.read_text())["rows"]
    return [r["model_type"] for r in rows if r.get("status") == "ok"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=False)
    parser.add_argument("--types", nargs="*")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script itself")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_type(args.one, args.device)))
        return 0
    types = args.types or _default_types()
    started, rows = time.perf_counter(), []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_subprocess, t, args.timeout, args.device): t for t in types}
        for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
            row = future.result()
            rows.append(row)
            print(f"[{n}/{len(types)}] {row['model_type']}: {row['status']}", flush=True)
    rows.sort(key=lambda r: r["model_type"])
    counts = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    lines = [
        f"`python benchmarks/gpu_coverage.py {' '.join(sys.argv[1:])}` ({time.perf_counter() - started:.0f} s)",
        "",
        f"**{len(rows)} types: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + "**",
        "",
        "| type | status | stock bf16 error | transfuse bf16 error | fused | providers |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        fused = ", ".join(f"{k} {v}" for k, v in sorted((r.get("fused") or {}).items()))
        providers = ", ".join(p for p in r.get("providers", []) if not p.endswith(":native")) or "native only"
        stock_error = f"{r['stock_error']:.1e}" if "stock_error" in r else ""
        error = f"{r['error']:.1e}" if "error" in r else r.get("message", "")[:80]
        lines.append(f"| {r['model_type']} | {r['status']} | {stock_error} | {error} | {fused} | {providers} |")
    for r in rows:
        for op, error in r.get("error_with_native", {}).items():
            lines.append(f"\n{r['model_type']}: with {op} native, transfuse's error is {error:.1e}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_coverage.md").write_text(text)
        (out / "gpu_coverage.json").write_text(json.dumps(rows, indent=1))
    return 1 if any(r["status"] in ("worse", "crash") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
