"""Launch shapes of the training step's Triton kernels at Llama-3-8B's training shapes, on the GPU.

    python benchmarks/train_kernels.py --out DIR [--tokens 8192] [--quick]

The kernels a training step runs besides the matrix products (``bench_train.py --profile`` lists
them): the RMSNorm backward (plain, and with the residual's gradient added, for
``fused_add_rms_norm``), the gated activation's backward, the loss's ``cross_entropy_grad`` over a
block of logits, and the backward's in-place ``scale_`` of the saved gradients (by a scale of one
and by another). Each is timed in CUDA-graph replays over rotated inputs (``bench_ops.time_graph``)
at its default launch and under each launch of a small grid (``TUNING`` of its module), checked
first against the native computation, with the bytes it must move turned into GB/s beside the
copy bandwidth measured in the same run. Writes DIR/train_kernels.md and .json.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_ops  # noqa: E402

from transfuse.ops import RMSNormSpec  # noqa: E402
from transfuse.ops.act_and_mul import act_and_mul_backward_native  # noqa: E402
from transfuse.ops.linear_cross_entropy import cross_entropy_grad_native  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, EPS = 4096, 14336, 128256, 1e-5
DTYPE = torch.bfloat16
FLAGS = RMSNormSpec().flags()  # LlamaRMSNorm's roundings

GRIDS = {
    "rms_norm_backward": {"backward_programs_per_sm": (2, 4, 8, 16), "backward_warps": (4, 8, 16)},
    "act_and_mul_backward": {"backward_block": (1024, 2048, 4096), "backward_warps": (2, 4, 8, 16)},
    "cross_entropy_grad": {"block": (2048, 4096, 8192, 16384), "num_warps": (4, 8, 16, 32)},
    "scale_": {"scale_programs_per_sm": (4, 8, 16, 32, 64)},
}
QUICK = {
    "rms_norm_backward": {"backward_programs_per_sm": (4, 16), "backward_warps": (8, 16)},
    "act_and_mul_backward": {"backward_block": (1024, 4096), "backward_warps": (4, 8)},
    "cross_entropy_grad": {"block": (4096, 8192), "num_warps": (8, 16)},
    "scale_": {"scale_programs_per_sm": (8, 32)},
}
MODULES = {
    "rms_norm_backward": "transfuse.ops.triton.rms_norm",
    "act_and_mul_backward": "transfuse.ops.triton.act_and_mul",
    "cross_entropy_grad": "transfuse.ops.triton.cross_entropy",
    "scale_": "transfuse.ops.triton.cross_entropy",
}


def _norm_reference(dy, x, weight, dresidual=None):
    """HF LlamaRMSNorm's gradients by autograd: (dx [+ dresidual], dweight)."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    h = x.float()
    out = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    dx, dw = torch.autograd.grad(out, (x, weight), dy)
    return (dx if dresidual is None else dx + dresidual), dw


def cases(tokens: int, ce_rows: int):
    """(name, make_inputs, kernel fn, reference fn or None, bytes moved)."""
    from transfuse.ops.triton import act_and_mul as act
    from transfuse.ops.triton import cross_entropy as ce
    from transfuse.ops.triton import rms_norm as norm

    def norm_inputs(residual: bool):
        def make():
            dy = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
            w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(DTYPE)
            return (dy, x, w) + ((torch.randn_like(dy),) if residual else ())
        return make

    def norm_kernel(dy, x, w, dres=None):
        return norm.rms_norm_backward(dy, x, w, EPS, FLAGS, dres)

    elem = DTYPE.itemsize
    norm_bytes = 3 * tokens * HIDDEN * elem
    yield "rms_norm_backward", norm_inputs(False), norm_kernel, _norm_reference, norm_bytes
    yield "fused_add_rms_norm_backward", norm_inputs(True), norm_kernel, _norm_reference, norm_bytes + tokens * HIDDEN * elem

    def act_inputs():
        return (torch.randn(tokens, INTERMEDIATE, device="cuda", dtype=DTYPE),
                torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=DTYPE))  # fmt: skip

    yield (
        "act_and_mul_backward", act_inputs, lambda dy, x: act.act_and_mul_backward(dy, x, act.SILU),
        lambda dy, x: act_and_mul_backward_native(dy, x, None), 5 * tokens * INTERMEDIATE * elem,
    )  # fmt: skip

    def ce_inputs():
        logits = torch.randn(ce_rows, VOCAB, device="cuda", dtype=DTYPE)
        targets = torch.randint(0, VOCAB, (ce_rows,), device="cuda")
        targets[::7] = -100
        return logits, targets, torch.tensor(1 / tokens, device="cuda")

    yield (
        "cross_entropy_grad", ce_inputs, lambda l, t, s: (ce.cross_entropy_grad(l, t, s, -100), l),
        lambda l, t, s: (cross_entropy_grad_native(l, t, s, -100), l), 3 * ce_rows * VOCAB * elem,
    )  # fmt: skip

    for value in (0.5, 1.0):
        def scale_inputs(value=value):
            return torch.randn(VOCAB, HIDDEN, device="cuda", dtype=DTYPE), torch.tensor(value, device="cuda")

        yield f"scale_ by {value}", scale_inputs, ce.scale_, lambda x, s: x.mul_(s.to(x.dtype)), 2 * VOCAB * HIDDEN * elem


def _check(name, make, kernel, reference) -> str:
    if reference is None:
        return ""
    inputs = make()
    got = kernel(*[t.clone() for t in inputs])
    want = reference(*[t.clone() for t in inputs])
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or w is None:
            continue
        scale = w.float().abs().max().clamp_min(1e-30)
        worst = max(worst, ((g.float() - w.float()).abs().max() / scale).item())
    return f"max err {worst:.1e} of the reference's largest"


def _tuning(name: str, config: dict):
    module = importlib.import_module(MODULES[name])
    saved = dict(module.TUNING)
    module.TUNING.update(config)
    return module, saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ce-rows", type=int, default=2048, help="rows of a loss block (512 MiB of Llama 3's logits)")
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_bps = bench_ops.copy_bandwidth()
    grids = QUICK if args.quick else GRIDS
    rows = []
    for name, make, kernel, reference, moved in cases(args.tokens, args.ce_rows):
        base = name.replace("fused_add_", "").split(" ")[0]
        grid = grids.get(base, {})
        configs = [{}] + ([dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else [])
        input_sets = bench_ops._input_sets(make, moved)
        for config in configs:
            module, saved = _tuning(base, config) if config else (None, None)
            try:
                note = _check(name, make, kernel, reference) if not config else ""
                us = bench_ops.time_graph(kernel, input_sets)
            except Exception as exc:  # a launch the GPU refuses (too many warps, registers) is a row
                us, note = None, f"failed: {bench_ops._first_line(exc)}"
            finally:
                if module is not None:
                    module.TUNING.clear()
                    module.TUNING.update(saved)
            gbps = moved / us / 1e3 if us and not name.endswith("by 1.0") else None  # a scale of one moves nothing
            row = {"kernel": name, "config": config or "default", "us": us, "gbps": gbps,
                   "copy_share": gbps * 1e9 / copy_bps if gbps else None, "note": note}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del input_sets
        torch.cuda.empty_cache()
    lines = [
        "`python " + " ".join(sys.argv) + "`",
        "",
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, copy {copy_bps / 1e9:.0f} GB/s; tokens "
        f"{args.tokens}, hidden {HIDDEN}, intermediate {INTERMEDIATE}, vocab {VOCAB}, loss block {args.ce_rows} rows, bf16",
        "",
        "| kernel | launch | us | GB/s | of copy | note |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    by_kernel: dict[str, list] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    for kernel_rows in by_kernel.values():
        timed = sorted((r for r in kernel_rows if r["us"]), key=lambda r: r["us"])
        shown = [r for r in kernel_rows if r["config"] == "default"] + [r for r in timed[:5] if r["config"] != "default"]
        for r in shown:
            us = f"{r['us']:.1f}" if r["us"] else "-"
            gbps = f"{r['gbps']:.0f}" if r["gbps"] else "-"
            share = f"{100 * r['copy_share']:.0f}%" if r["copy_share"] else "-"
            lines.append(f"| {r['kernel']} | {r['config']} | {us} | {gbps} | {share} | {r['note']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_kernels.md").write_text("\n".join(lines) + "\n")
    (out / "train_kernels.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
