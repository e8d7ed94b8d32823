"""Where the verification rule's constants come from: honest fusions against deliberately wrong ones.

For tiny models of many families in float32, float16 and bfloat16, every fused module's check is
recorded: its error against the float64 reference next to the original's own error, as the
share of each limit of the rule it used (``rms / rms limit`` and ``|bias difference| / bias
limit``; the rule passes below 1), and for the fused modules that are not bit-identical to the
original, how many standard deviations of chance their scale difference is (``z``). Then the same models are rewritten with a provider that is 1% or 0.3% off
(the native result times 1.01 or 1.003) given top priority for rms_norm, silu_and_mul and
moe_experts, and the script counts how many of the wrong fusions were still kept.

    python benchmarks/verify_rule.py --out DIR              # CPU: all families, three dtypes
    python benchmarks/verify_rule.py --out DIR --device cuda   # the same on a GPU (Triton/CUDA kernels)
    TRITON_INTERPRET=1 python benchmarks/verify_rule.py --out DIR --providers triton   # CPU, Triton's rounding

Writes ``DIR/verify_rule.md`` and ``DIR/verify_rule.json``. Exit status 1 if any honest fusion
failed its check or any wrong one passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

import transfuse
from transfuse.ops import get_op, register_provider, set_priority
from transfuse.rewriter import checking, verify
from transfuse.tiny import tiny_model

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "ernie4_5", "cohere"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granitemoe", "ernie4_5_moe"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WRONG_OPS = ("rms_norm", "silu_and_mul", "moe_experts")
# The fusion kind whose fused modules call each op.
_KIND = {"rms_norm": "rms_norm", "silu_and_mul": "gate_up", "moe_experts": "moe"}


class Recorder:
    """Wraps ``checking.judge`` to keep every verdict with the instance's class."""

    def __init__(self):
        self.verdicts: list[tuple[str, verify.Judgement, torch.dtype]] = []
        self._judge = checking.judge

    def __enter__(self):
        def judge(fused, original, reference):
            verdict = self._judge(fused, original, reference)
            tensors = verify.output_tensors(original)
            self.verdicts.append((type(fused).__name__, verdict, tensors[0].dtype if tensors else None))
            return verdict

        checking.judge = judge
        return self

    def __exit__(self, *exc):
        checking.judge = self._judge


def _margins(verdict: verify.Judgement, dtype: torch.dtype) -> tuple[float, float, float]:
    """How much of each limit the fused module used (1 = at the limit), and the scale difference
    from the original in standard deviations of chance (``z``)."""
    got, own, apart = verdict.fused, verdict.original or verify.EXACT, verdict.apart
    if got is None or apart is None:
        return 0.0, 0.0, 0.0
    rms_limit, bias_limit = verify.limits(dtype, own, apart)
    z = abs(apart.bias) / apart.noise if apart.noise > 0 else 0.0
    return got.rms / rms_limit, abs(apart.bias) / bias_limit, z


def _model(model_type: str, dtype: torch.dtype, device: str):
    return tiny_model(model_type, dtype=dtype).to(device)


def honest(families, device):
    rows = []
    for model_type in families:
        for dtype_name, dtype in DTYPES.items():
            model = _model(model_type, dtype, device)
            with Recorder() as rec:
                transfuse.rewrite(model)
            report = transfuse.report(model)
            failed = [s for s in report.skipped if s.tag == "verify.mismatch"]
            margins = [_margins(v, d) for _, v, d in rec.verdicts if v.passed]
            worst_rms = max((m[0] for m in margins), default=0.0)
            worst_bias = max((m[1] for m in margins), default=0.0)
            zs = [m[2] for m in margins if m[2] > 0]
            ratios = [v.fused.rms / v.original.rms for _, v, _ in rec.verdicts
                      if v.passed and v.original is not None and v.original.rms > 0 and v.apart.rms > 0]
            own = [v.original.rms for _, v, _ in rec.verdicts if v.original is not None]
            rows.append(
                {
                    "model": model_type,
                    "dtype": dtype_name,
                    "fusions": len(report.fusions),
                    "checks": len(rec.verdicts),
                    "failed": [f"{s.cls} {s.kind}: {s.reason}" for s in failed],
                    "worst_rms_margin": worst_rms,
                    "worst_bias_margin": worst_bias,
                    "original_rms_median": sorted(own)[len(own) // 2] if own else None,
                    "differing": len(zs),
                    "worst_z": max(zs, default=0.0),
                    "worst_rms_ratio": max(ratios, default=0.0),
                }
            )
            print(f"honest {model_type:14s} {dtype_name:9s} fused {len(report.fusions):3d}  failed {len(failed)}  "
                  f"margins rms {worst_rms:.2f} bias {worst_bias:.2f}, differing {len(zs)}, worst z {max(zs, default=0):.1f}, "
                  f"worst rms ratio {max(ratios, default=0):.2f}", flush=True)
    return rows


def _wrong_provider(op: str, scale: float) -> None:
    native = get_op(op).native.impl
    register_provider(op, "wrong", lambda *a, **k: native(*a, **k) * scale, differentiable=True)
    set_priority(["wrong"], op=op)


def wrong(families, device, scales):
    rows = []
    for op in WRONG_OPS:
        for scale in scales:
            _wrong_provider(op, scale)
            try:
                for model_type in families:
                    for dtype_name, dtype in DTYPES.items():
                        model = _model(model_type, dtype, device)
                        with transfuse.ops.trace() as calls:
                            transfuse.rewrite(model)
                        if not any(c.op == op and c.provider == "wrong" for c in calls):
                            continue  # the model never calls this op (another activation, no experts)
                        report = transfuse.report(model)
                        survivors = [f for f in report.fusions if f.kind == _KIND[op]]
                        caught = [s for s in report.skipped if s.tag == "verify.mismatch" and s.kind == _KIND[op]]
                        rows.append(
                            {
                                "op": op,
                                "scale": scale,
                                "model": model_type,
                                "dtype": dtype_name,
                                "caught": len(caught),
                                "kept": len(survivors),
                            }
                        )
                        print(f"wrong {op:12s} x{scale} {model_type:14s} {dtype_name:9s} caught {len(caught):3d} "
                              f"kept {len(survivors):3d}", flush=True)
            finally:
                set_priority(None, op=op)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="*", default=DENSE + MOE)
    parser.add_argument("--scales", nargs="*", type=float, default=[1.01, 1.003])
    parser.add_argument("--providers", nargs="*", default=None, help="provider order for every op in the honest runs "
                        "(e.g. triton: on CPU under TRITON_INTERPRET=1, kernels that round unlike native)")
    args = parser.parse_args()
    if args.providers:
        set_priority(args.providers)
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    honest_rows = honest(args.models, args.device)
    set_priority(None)
    wrong_rows = wrong(args.models, args.device, args.scales)
    command = "python " + " ".join(sys.argv)
    lines = [
        f"`{command}`",
        "",
        f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
        + f"; rule: RMS_FACTOR {verify.RMS_FACTOR}, BIAS_SIGMAS {verify.BIAS_SIGMAS}, floors (units of rounding) "
        + ", ".join(f"{str(d).replace('torch.', '')} {v}" for d, v in verify.FLOOR_ULPS.items())
        + "; bias floors " + ", ".join(f"{str(d).replace('torch.', '')} {v}" for d, v in verify.BIAS_FLOOR_ULPS.items()),
        "",
        "## Honest fusions: the share of each limit the worst check used (passes below 1)",
        "",
        "| model | dtype | fusions | checks | failed | worst rms / limit | worst bias / limit | original's median rms | checks not bit-identical | worst z | worst rms / original's |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in honest_rows:
        own = f"{r['original_rms_median']:.2g}" if r["original_rms_median"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['fusions']} | {r['checks']} | {len(r['failed'])} | "
            f"{r['worst_rms_margin']:.2f} | {r['worst_bias_margin']:.2f} | {own} | {r['differing']} | {r['worst_z']:.1f} | {r['worst_rms_ratio']:.2f} |"
        )
    by = defaultdict(lambda: [0, 0])
    for r in wrong_rows:
        key = (r["op"], r["scale"], r["dtype"])
        by[key][0] += r["caught"]
        by[key][1] += r["kept"]
    lines += [
        "",
        "## Wrong providers (native times the scale, top priority): fusions caught and kept, over all models",
        "",
        "| op | scale | dtype | caught | kept |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for (op, scale, dtype), (caught, kept) in sorted(by.items()):
        lines.append(f"| {op} | {scale} | {dtype} | {caught} | {kept} |")
    kept_rows = [r for r in wrong_rows if r["kept"]]
    if kept_rows:
        lines += ["", "Wrong fusions kept: " + ", ".join(f"{r['op']} x{r['scale']} {r['model']} {r['dtype']}" for r in kept_rows)]
    failures = [f for r in honest_rows for f in r["failed"]]
    if failures:
        lines += ["", "Honest fusions refused: " + "; ".join(failures)]
    lines += ["", f"{time.time() - start:.0f} s"]
    with open(os.path.join(args.out, "verify_rule.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "verify_rule.json"), "w") as f:
        json.dump({"command": command, "honest": honest_rows, "wrong": wrong_rows}, f, indent=1)
    print("\n".join(lines))
    return 1 if failures or kept_rows else 0


if __name__ == "__main__":
    sys.exit(main())
