"""Host time per call: how long issuing one call takes on the CPU, for the small calls of a decode step.

    python benchmarks/host_overhead.py --out DIR [--profile] [--training]

For one token (hidden 4096, bf16) it issues each path many times without synchronising and
divides the host time by the count; the GPU work of each call is a few microseconds, so the
host is the bottleneck and this is its cost. Paths: a torch ``add`` (the machine's floor for
one dispatched op), every provider of rms_norm, fused_add_rms_norm and silu_and_mul (direct,
and through ``transfuse.ops`` dispatch), and the fused Qwen3-MoE block of ``bench_moe.py`` at
one token, replaying its decode graph (``transfuse.ops.graphs``) and without it. The dispatched
path adds ``transfuse.ops``' provider choice to the direct call of the same provider. The Triton paths run twice: through Triton's own launch (``launch.FAST = False``)
and through ``transfuse.ops.triton.launch``'s fast path. ``--profile`` also writes cProfile's
top functions for the Triton paths. ``--training`` adds the ops as a training step calls them
(inputs that need a gradient): the rms_norm path layer by layer (dispatch, autograd Function, the
Triton wrapper, the launch alone), against ``F.rms_norm`` and a torch ``mul``, plus rotary and
act_and_mul. Writes DIR/host_overhead.md and .json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from transfuse import ops  # noqa: E402
from transfuse.ops import RMSNormSpec  # noqa: E402
from transfuse.ops.graphs import suspended  # noqa: E402
from transfuse.ops.triton import launch  # noqa: E402

CALLS = 400
REPEATS = 7
HIDDEN = 4096


def host_us(fn, calls: int = CALLS) -> float:
    """Median over REPEATS of the host microseconds per call of ``calls`` calls issued back to back."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def profile_top(fn, calls: int = 2000, top: int = 18) -> str:
    for _ in range(20):
        fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def paths() -> dict[str, tuple]:
    """name -> (callable, uses Triton)."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, residual, weight = torch.randn(1, HIDDEN, **bf16), torch.randn(1, HIDDEN, **bf16), torch.randn(HIDDEN, **bf16)
    gate_up = torch.randn(1, 2 * HIDDEN, **bf16)
    flags = RMSNormSpec(upcast=True, cast_before_weight=True).flags()
    out = {"torch add (reference)": (lambda: torch.add(x, x), False)}
    for op, args in (
        ("rms_norm", (x, weight, 1e-6, *flags)),
        ("fused_add_rms_norm", (x, residual, weight, 1e-6, *flags)),
        ("silu_and_mul", (gate_up,)),
    ):
        for name, provider in ops.get_op(op).providers.items():
            if provider.supported() and provider.supports_args(*args):
                out[f"{op}: {name} provider, direct"] = (lambda p=provider, a=args: p.impl(*a), name == "triton")
    spec = RMSNormSpec(upcast=True, cast_before_weight=True)
    default = ops.get_op("rms_norm").select(x, weight, 1e-6, *flags).name
    out[f"ops.rms_norm, dispatched (default: {default})"] = (
        lambda: ops.rms_norm(x, weight, 1e-6, spec),
        default == "triton",
    )
    try:
        import bench_moe

        fused = bench_moe.build_fused(bench_moe.build_block()[0])
        token = torch.randn(1, 1, bench_moe.HIDDEN, **bf16)
        out["MoE block, 1 token (Qwen3-MoE shape)"] = (lambda: fused(token), True)
        out["MoE block, 1 token, no decode graph"] = (lambda: _without_graphs(fused, token), True)
        from transfuse.ops import moe_experts
        from transfuse.ops.moe_layer import _tensor

        tokens = token.reshape(-1, bench_moe.HIDDEN)
        experts = fused.plan.experts
        w13, w2 = _tensor(fused, experts.w13), _tensor(fused, experts.w2)
        _, weights, ids = fused._route(token, tokens)
        out["MoE block: routing (router linear, moe_route)"] = (lambda: fused._route(token, tokens), True)
        out["MoE block: moe_experts"] = (lambda: moe_experts(tokens, weights, ids, w13, w2, experts.spec), True)
    except Exception as exc:  # noqa: BLE001 - report and go on with the op paths
        print(f"MoE block skipped: {type(exc).__name__}: {exc}", flush=True)
    return out


def training_paths() -> dict[str, tuple]:
    """The same ops as a training step calls them (inputs that need a gradient, grad on): the
    forward's host cost per call, split into its layers (dispatch, autograd Function, the Triton
    path's Python, the launch). Eight rows of hidden 2048 (Qwen3-MoE), so the GPU keeps ahead."""
    import torch.nn.functional as F

    from transfuse.ops.act_and_mul import act_and_mul
    from transfuse.ops.rotary import rotary
    from transfuse.ops.triton import rms_norm as triton_rms_norm

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    hidden = 2048
    x = torch.randn(8, hidden, **bf16, requires_grad=True)
    weight = torch.randn(hidden, **bf16, requires_grad=True)
    spec = RMSNormSpec(upcast=True, cast_before_weight=True)
    flags = spec.flags()
    # q of a merged q/k/v projection, as Qwen3's q_norm sees it: [B, S, heads, head_dim], rows not collapsible.
    qkv = torch.randn(1, 8, 40 * 128, **bf16, requires_grad=True)
    q = qkv[..., : 32 * 128].view(1, 8, 32, 128)
    head_weight = torch.randn(128, **bf16, requires_grad=True)
    qr = torch.randn(1, 32, 8, 128, **bf16, requires_grad=True)
    kr = torch.randn(1, 4, 8, 128, **bf16, requires_grad=True)
    cos, sin = torch.randn(1, 8, 128, **bf16), torch.randn(1, 8, 128, **bf16)
    gate_up = torch.randn(8, 2 * 768, **bf16, requires_grad=True)
    out2 = x.new_empty(x.shape)
    xd = x.detach()
    kernel_args = (xd, xd, weight.detach(), xd, out2, out2, 8, 1, hidden, hidden, hidden, hidden, 1e-6)
    kernel_kwargs = dict(N=hidden, CONTIGUOUS=True, UPCAST=True, CAST_BEFORE_WEIGHT=True, OFFSET=False,
                         WEIGHT_FP32=False, HAS_WEIGHT=True, ADD_RESIDUAL=False, GATE=0, ROUND_NORM=True,
                         BLOCK_N=hidden, ROWS=1, num_warps=4)  # fmt: skip
    return {
        "train: torch mul (reference)": (lambda: x * 2, False),
        "train: F.rms_norm": (lambda: F.rms_norm(x, (hidden,), weight, 1e-6), False),
        "train: ops.rms_norm (dispatch + autograd + kernel)": (lambda: ops.rms_norm(x, weight, 1e-6, spec), True),
        "train: triton rms_norm_autograd, direct": (
            lambda: triton_rms_norm.rms_norm_autograd(x, weight, 1e-6, *flags), True
        ),
        "train: triton _normalise (no autograd)": (
            lambda: triton_rms_norm._normalise(x.detach(), None, weight.detach(), 1e-6, flags), True
        ),
        "train: the rms_norm kernel's launch alone": (
            lambda: triton_rms_norm._rms_norm_kernel[(8,)](*kernel_args, **kernel_kwargs), True
        ),
        "train: ops.rms_norm of a merged projection's q heads": (
            lambda: ops.rms_norm(q, head_weight, 1e-6, spec), True
        ),
        "train: rotary of q and k": (lambda: rotary(qr, kr, cos, sin), True),
        "train: act_and_mul silu": (lambda: act_and_mul(gate_up, "silu"), True),
    }


def _without_graphs(layer, x):
    with suspended():
        return layer(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--training", action="store_true", help="also the ops as a training step calls them")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, profiles = [], {}
    chosen = {**paths(), **(training_paths() if args.training else {})}
    for name, (fn, uses_triton) in chosen.items():
        with torch.set_grad_enabled(name.startswith("train:")):
            row = {"path": name}
            if uses_triton:
                launch.FAST = False
                row["triton launch us"] = host_us(fn)
                if args.profile:
                    profiles[f"{name}, Triton's launch"] = profile_top(fn)
                launch.FAST = True
            row["us"] = host_us(fn)
            if uses_triton and args.profile:
                profiles[f"{name}, fast launch"] = profile_top(fn)
            rows.append(row)
            print(f"{name:<48} {row['us']:8.1f} us" + (f"   (Triton's launch: {row['triton launch us']:.1f} us)"
                                                          if "triton launch us" in row else ""), flush=True)
    import triton

    meta = {
        "command": "python3 " + " ".join([f"benchmarks/{Path(__file__).name}", *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    lines = [
        "# Host time per call, one token",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; bf16, hidden {HIDDEN}. Median of "
        f"{REPEATS} runs of {CALLS} calls issued back to back, host microseconds per call.",
        "",
        "| path | host us | host us with Triton's own launch |",
        "| --- | ---: | ---: |",
    ]
    for row in rows:
        triton_us = f"{row['triton launch us']:.1f}" if "triton launch us" in row else ""
        lines.append(f"| {row['path']} | {row['us']:.1f} | {triton_us} |")
    for name, text in profiles.items():
        lines += ["", f"## cProfile: {name}", "", "```", text.strip(), "```"]
    (args.out / "host_overhead.md").write_text("\n".join(lines) + "\n")
    (args.out / "host_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n".join(lines[:12 + len(rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
