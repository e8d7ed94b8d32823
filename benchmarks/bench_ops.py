"""Time every provider of rms_norm, fused_add_rms_norm, gated_rms_norm, silu_and_mul, gelu_and_mul and rotary on a CUDA GPU
against the Hugging Face eager code, ``torch.compile`` of it, and the copy bandwidth of the same run.

    python benchmarks/bench_ops.py --out DIR [--hidden 4096] [--tokens 1 16 256 4096 32768]

Steps, in order: build the CUDA extension (log in DIR/cuda_build.log); measure the copy
bandwidth (a large device-to-device copy, bytes read + written); check every provider
against native on random data with poisoned outputs (a provider that fails is not timed);
time each variant with CUDA-graph replays over rotated inputs (several input sets whose
total exceeds the L2, so large sizes are not flattered) and, for reference, as plain eager
calls (host launch overhead included). The default dispatch may pick one provider eagerly
(least host cost) and another inside a graph capture (least device time): its provider
column names both, and its graph time is the captured choice's. Kernel launches at small
sizes are counted with the profiler. Writes DIR/results.json and DIR/results.md and prints a
summary table last. The target check against ``torch.compile`` uses a separate timing in which the
default's graph and compile's are replayed in alternation (``time_paired``): separate runs of one
kernel differ by up to ~0.1 us at a few us a call, more than the differences being judged.

Bandwidth counts the fewest bytes each op must move: inputs read once, outputs written once.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transfuse import ops  # noqa: E402
from transfuse.ops import RMSNormSpec  # noqa: E402

OPS = ("rms_norm", "fused_add_rms_norm", "gated_rms_norm", "silu_and_mul", "gelu_and_mul", "rotary")
KERNEL_PROVIDERS = ("torch", "triton", "cuda")
ROTATE_BYTES = 256 * 2**20  # input sets rotated per graph: > 4x the H200's 60 MB L2
CALLS_PER_GRAPH = 100
EPS = 1e-6
LLAMA = RMSNormSpec()  # LlamaRMSNorm: normalise in float32, cast back, multiply by the weight
TARGET_SHARE = 0.8
# The default counts as slower than torch.compile when the median ratio of alternating replays exceeds 1 + this.
PAIRED_TOLERANCE = 0.01


@dataclass
class Row:
    op: str
    tokens: int
    variant: str
    provider: str = ""
    graph_us: float | None = None
    eager_us: float | None = None
    gbps: float | None = None
    copy_share: float | None = None
    launches: int | None = None
    note: str = ""
    # Default rows only: graph us of the default and of "hf compile" replayed in alternation, and the
    # median over rounds of their ratio (see ``time_paired``).
    paired: dict | None = None


@dataclass
class Case:
    """One op at one size: how to make inputs, the variants to time, and the bytes it must move."""

    op: str
    tokens: int
    make_inputs: Callable[[], tuple]
    min_bytes: int
    variants: dict[str, Callable[..., object]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Inputs and the Hugging Face reference code.


def _randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _hf_rms_norm(hidden: int, dtype: torch.dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(hidden, eps=EPS).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(_randn(hidden, dtype=dtype))
    return module


def _hf_act(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _add_providers(case: Case, args_of) -> Case:
    for name, provider in ops.get_op(case.op).providers.items():
        case.variants[name] = _bind(provider, args_of)
    return case


def _rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype) -> Case:
    norm = _hf_rms_norm(hidden, dtype)
    weight = norm.weight.detach()
    size = torch.finfo(dtype).bits // 8
    case = Case("rms_norm", tokens, lambda: (_randn(tokens, hidden, dtype=dtype),), (2 * tokens + 1) * hidden * size)
    case.variants["hf eager"] = norm
    case.variants["hf compile"] = _compiled(norm)
    case.variants["default"] = lambda x: ops.rms_norm(x, weight, EPS, LLAMA)
    return _add_providers(case, lambda x: (x, weight, EPS, *LLAMA.flags()))


def _fused_add_rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype) -> Case:
    norm = _hf_rms_norm(hidden, dtype)
    weight = norm.weight.detach()

    def hf_add_norm(x, residual):  # a decoder layer's `residual + hidden_states`, then its norm
        residual = residual + x
        return norm(residual), residual

    size = torch.finfo(dtype).bits // 8
    case = Case(
        "fused_add_rms_norm",
        tokens,
        lambda: (_randn(tokens, hidden, dtype=dtype), _randn(tokens, hidden, dtype=dtype)),
        (4 * tokens + 1) * hidden * size,
    )
    case.variants["hf eager"] = hf_add_norm
    case.variants["hf compile"] = _compiled(hf_add_norm)
    case.variants["default"] = lambda x, r: ops.fused_add_rms_norm(x, r, weight, EPS, LLAMA)
    return _add_providers(case, lambda x, r: (x, r, weight, EPS, *LLAMA.flags()))


def _gated_rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype) -> Case:
    """qwen3_next's gated norm (the output gate of its linear attention), eager and compiled."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    norm = Qwen3NextRMSNormGated(hidden, eps=EPS).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(hidden, dtype=dtype))
    weight = norm.weight.detach()
    size = torch.finfo(dtype).bits // 8
    case = Case(
        "gated_rms_norm",
        tokens,
        lambda: (_randn(tokens, hidden, dtype=dtype), _randn(tokens, hidden, dtype=dtype)),
        (3 * tokens + 1) * hidden * size,
    )
    case.variants["hf eager"] = norm
    case.variants["hf compile"] = _compiled(norm)
    case.variants["default"] = lambda x, g: ops.gated_rms_norm(x, g, weight, EPS, LLAMA, "silu")
    return _add_providers(case, lambda x, g: (x, g, weight, EPS, *LLAMA.flags(), "silu"))


def _act_and_mul_case(op: str, tokens: int, hidden: int, dtype: torch.dtype) -> Case:
    """``act(gate) * up`` as LlamaMLP writes it, on the halves of a merged ``[gate | up]`` projection."""
    act = _hf_act("silu" if op == "silu_and_mul" else "gelu_pytorch_tanh")

    def hf_act_and_mul(x):
        return act(x[:, :hidden]) * x[:, hidden:]

    size = torch.finfo(dtype).bits // 8
    case = Case(op, tokens, lambda: (_randn(tokens, 2 * hidden, dtype=dtype),), 3 * tokens * hidden * size)
    case.variants["hf eager"] = hf_act_and_mul
    case.variants["hf compile"] = _compiled(hf_act_and_mul)
    activation = "silu" if op == "silu_and_mul" else "gelu_tanh"
    case.variants["default"] = lambda x: ops.act_and_mul(x, activation)
    extra = () if op == "silu_and_mul" else ("tanh",)
    return _add_providers(case, lambda x: (x, *extra))


# Llama-3-8B's attention: 32 query heads, 8 key/value heads, head_dim 128 (``--hidden`` does not apply).
ROTARY_HEADS, ROTARY_KV_HEADS, ROTARY_HEAD_DIM = 32, 8, 128


def _rotary_case(tokens: int, dtype: torch.dtype) -> Case:
    """``apply_rotary_pos_emb`` on one sequence of ``tokens``, its q and k the transposed head views of
    column slices of a merged q/k/v projection (as a fused attention's are), cos and sin ``[1, tokens, 128]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hq, hk, d = ROTARY_HEADS, ROTARY_KV_HEADS, ROTARY_HEAD_DIM

    def make_inputs():
        qkv = _randn(1, tokens, (hq + 2 * hk) * d, dtype=dtype)
        q = qkv[..., : hq * d].view(1, tokens, hq, d).transpose(1, 2)
        k = qkv[..., hq * d : (hq + hk) * d].view(1, tokens, hk, d).transpose(1, 2)
        return q, k, _randn(1, tokens, d, dtype=dtype), _randn(1, tokens, d, dtype=dtype)

    size = torch.finfo(dtype).bits // 8
    case = Case("rotary", tokens, make_inputs, (2 * (hq + hk) + 2) * d * tokens * size)
    case.variants["hf eager"] = apply_rotary_pos_emb
    case.variants["hf compile"] = _compiled(apply_rotary_pos_emb)
    case.variants["default"] = ops.rotary
    return _add_providers(case, lambda q, k, cos, sin: (q, k, cos, sin, 1))


def build_case(op: str, tokens: int, hidden: int, dtype: torch.dtype) -> Case:
    """The inputs, HF eager and compiled references, and transfuse variants of one op at one size."""
    if op == "rms_norm":
        return _rms_norm_case(tokens, hidden, dtype)
    if op == "fused_add_rms_norm":
        return _fused_add_rms_norm_case(tokens, hidden, dtype)
    if op == "gated_rms_norm":
        return _gated_rms_norm_case(tokens, hidden, dtype)
    if op == "rotary":
        return _rotary_case(tokens, dtype)
    return _act_and_mul_case(op, tokens, hidden, dtype)


def _bind(provider, args_of):
    """A variant that calls one provider directly; ``supports`` asks whether it takes the inputs."""

    def call(*inputs):
        return provider.impl(*args_of(*inputs))

    call.supports = lambda *inputs: provider.supports_args(*args_of(*inputs))
    call.provider = provider
    return call


# ---------------------------------------------------------------------------------------------
# Measuring.


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    n = int(gib * 2**30) // 2
    src, dst = (
        torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_(),
        torch.empty(n, device="cuda", dtype=torch.bfloat16),
    )
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times)


def _input_sets(make_inputs, per_set_bytes: int) -> list[tuple]:
    count = max(2, min(64, math.ceil(ROTATE_BYTES / max(per_set_bytes, 1))))
    return [make_inputs() for _ in range(count)]


def _capture(fn, input_sets, per_graph: int = CALLS_PER_GRAPH) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph of ``per_graph``-odd calls of ``fn`` over the rotated inputs, and its call count."""
    calls = len(input_sets) * max(1, round(per_graph / len(input_sets)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream, as graph capture requires
        for inputs in input_sets:
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
    graph.replay()
    torch.cuda.synchronize()
    return graph, calls


def _replay_us(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def time_graph(fn, input_sets, repeats: int = 10, per_graph: int = CALLS_PER_GRAPH) -> float:
    """Microseconds per call, from CUDA-graph replays of ``per_graph`` calls over rotated inputs (median
    of ``repeats``)."""
    graph, calls = _capture(fn, input_sets, per_graph)
    times = [_replay_us(graph, calls) for _ in range(repeats)]
    del graph
    return statistics.median(times)


def time_paired(fn, baseline, input_sets, rounds: int = 40) -> dict:
    """``fn`` against ``baseline``, their graphs replayed in alternation (so drift in clocks or in the
    rest of the machine hits both alike): each one's median graph us, the median of the per-round
    ratio fn / baseline, and in how many rounds ``fn`` was the slower. Separate ``time_graph`` runs of
    one kernel differ by up to ~0.1 us at a few us a call; alternation narrows that to the ratio."""
    graph, calls = _capture(fn, input_sets)
    base_graph, base_calls = _capture(baseline, input_sets)
    ours, theirs = [], []
    for i in range(rounds):
        first_ours = i % 2 == 0  # and alternate which goes first
        pair = [(graph, calls, ours), (base_graph, base_calls, theirs)]
        for g, n, into in pair if first_ours else pair[::-1]:
            into.append(_replay_us(g, n))
    del graph, base_graph
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {
        "us": statistics.median(ours),
        "baseline_us": statistics.median(theirs),
        "ratio": statistics.median(ratios),
        "slower_rounds": sum(r > 1.0 for r in ratios),
        "rounds": rounds,
    }


def time_eager(fn, input_sets, repeats: int = 10) -> float:
    """Microseconds per call issued from Python one after another (host launch cost included)."""
    calls = len(input_sets) * max(1, round(CALLS_PER_GRAPH / len(input_sets)))
    for inputs in input_sets:
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def count_launches(fn, inputs) -> int | None:
    """GPU activities (kernels, copies, memsets) one call issues, as the profiler records them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn(*inputs)
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(*inputs)
            torch.cuda.synchronize()
    except (RuntimeError, AssertionError) as exc:  # the profiler is a nicety: report, don't stop the run
        print(f"profiler unavailable: {exc}", flush=True)
        return None
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


# ---------------------------------------------------------------------------------------------
# Correctness before timing.


def _ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    finfo = torch.finfo(dtype)
    _, exponent = torch.frexp(ref.double())
    exponent = exponent.clamp(min=round(math.log2(finfo.tiny)) + 1)
    spacing = torch.ldexp(torch.ones_like(ref, dtype=torch.double), exponent - 1 + round(math.log2(finfo.eps)))
    return (out.double() - ref.double()).abs() / spacing


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:120] if text else ""


def check_against_native(fn, native, inputs, dtype) -> str:
    """'' when fn matches native (every element written, within 2 ulps, 95% bit-identical), else why not."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # new tensors start as NaN
    try:
        got, ref = fn(*inputs), native(*inputs)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = False
    got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
    for out, expected in zip(got, ref, strict=True):
        if out.shape != expected.shape or out.dtype != expected.dtype:
            return f"shape/dtype {tuple(out.shape)} {out.dtype} vs {tuple(expected.shape)} {expected.dtype}"
        if out.isnan().any():
            return f"{int(out.isnan().sum())} elements never written"
        worst = _ulps(out, expected, dtype)
        far = (worst > 2) & ((out.double() - expected.double()).abs() > 2**-14)
        if far.any():
            return f"{int(far.sum())} elements more than 2 ulps off (worst {worst.max().item():.1f})"
        share = (out.to(dtype) == expected.to(dtype)).float().mean().item()
        if share < 0.95:
            return f"only {share:.1%} bit-identical to native"
    return ""


# ---------------------------------------------------------------------------------------------
# The run.


def build_cuda_extension(out: Path) -> str:
    """Build in a child process so the compiler's output goes to out/cuda_build.log; '' on success."""
    log = out / "cuda_build.log"
    start = time.perf_counter()
    with log.open("w") as handle:
        result = subprocess.run(
            [sys.executable, "-m", "transfuse.ops.cuda"], cwd=REPO, stdout=handle, stderr=subprocess.STDOUT
        )
    elapsed = time.perf_counter() - start
    status = "" if result.returncode == 0 else f"build failed (exit {result.returncode}); see {log}"
    print(f"cuda extension: {'built' if not status else status} in {elapsed:.0f} s", flush=True)
    return status


def run_case(case: Case, dtype: torch.dtype, copy_bps: float, launch_tokens: set[int]) -> list[Row]:
    """Check each kernel variant against native on this size, then time every variant that passes."""
    probe = case.make_inputs()
    per_set = sum(t.numel() * t.element_size() for t in probe)
    input_sets = _input_sets(case.make_inputs, per_set)
    rows = []
    for name, fn in case.variants.items():
        row = Row(case.op, case.tokens, name)
        rows.append(row)
        try:
            measure(row, fn, case, probe, input_sets, dtype, copy_bps, case.tokens in launch_tokens)
        except Exception as exc:  # one broken variant (a compile or launch failure) must not lose the run
            row.note = f"ERROR: {type(exc).__name__}: {_first_line(exc)}"
            torch.cuda.synchronize()
    default = next((r for r in rows if r.variant == "default"), None)
    compiled = next((r for r in rows if r.variant == "hf compile"), None)
    if default and compiled and default.graph_us and compiled.graph_us:
        try:
            default.paired = time_paired(case.variants["default"], case.variants["hf compile"], input_sets)
        except RuntimeError as exc:
            default.note += f" (paired timing failed: {_first_line(exc)})"
            torch.cuda.synchronize()
    del input_sets
    torch.cuda.empty_cache()
    return rows


def measure(row: Row, fn, case: Case, probe, input_sets, dtype, copy_bps: float, count: bool) -> None:
    """Fill ``row`` for one variant: refused, WRONG against native, or its times, bandwidth and launches."""
    supports = getattr(fn, "supports", None)
    if supports is not None and not fn.provider.supported():
        row.note = "unavailable here"
        return
    if supports is not None and not supports(*probe):
        row.note = "refuses these arguments"  # e.g. F.rms_norm, whose rounding differs from Llama's
        return
    if row.variant == "default":
        row.provider = default_providers(fn, probe)
    if row.variant in KERNEL_PROVIDERS or row.variant == "default":
        problem = check_against_native(fn, case.variants["native"], probe, dtype)
        if problem:
            row.note = f"WRONG: {problem}"
            return
    try:
        row.graph_us = time_graph(fn, input_sets)
    except RuntimeError as exc:  # a variant that cannot be captured is still timed eagerly
        row.note = f"no graph: {_first_line(exc)}"
        torch.cuda.synchronize()
    row.eager_us = time_eager(fn, input_sets)
    best = row.graph_us or row.eager_us
    row.gbps = case.min_bytes / (best * 1e-6) / 1e9
    row.copy_share = case.min_bytes / (best * 1e-6) / copy_bps
    if count:
        row.launches = count_launches(fn, probe)


def default_providers(fn, probe) -> str:
    """The provider dispatch picks eagerly, and (where it differs) inside a CUDA-graph capture:
    eager calls are bound by host cost, captured ones by device time, and dispatch weighs each."""
    with ops.trace() as log:
        fn(*probe)
    eager = log[-1].provider
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with ops.trace() as log, torch.cuda.stream(stream), torch.cuda.graph(graph):
        fn(*probe)
    torch.cuda.current_stream().wait_stream(stream)
    del graph
    captured = log[-1].provider
    return eager if captured == eager else f"{eager}, graph: {captured}"


def verdicts(rows: list[Row]) -> list[str]:
    """The targets, checked on the default dispatch choice."""
    lines = []
    by_key = {(r.op, r.tokens, r.variant): r for r in rows}
    for op in sorted({r.op for r in rows}):
        for tokens in sorted({r.tokens for r in rows if r.op == op}):
            default, compiled = by_key.get((op, tokens, "default")), by_key.get((op, tokens, "hf compile"))
            if default is None or default.graph_us is None:
                lines.append(f"{op} @{tokens}: default not timed ({default.note if default else 'missing'})")
                continue
            checks = []
            if default.paired:
                p = default.paired
                ok = p["ratio"] <= 1.0 + PAIRED_TOLERANCE
                checks.append(
                    f"{'ok' if ok else 'SLOWER'} vs compile (alternating replays: {p['us']:.2f} vs "
                    f"{p['baseline_us']:.2f} us, ratio {p['ratio']:.3f}, "
                    f"slower in {p['slower_rounds']}/{p['rounds']} rounds)"
                )
            elif compiled and compiled.graph_us:
                ok = default.graph_us <= compiled.graph_us * 1.02
                checks.append(
                    f"{'ok' if ok else 'SLOWER'} vs compile ({default.graph_us:.1f} vs {compiled.graph_us:.1f} us)"
                )
            if tokens >= 4096 and op != "gelu_and_mul":
                ok = default.copy_share >= TARGET_SHARE
                checks.append(f"{'ok' if ok else 'BELOW'} {default.copy_share:.0%} of copy bandwidth (target 80%)")
            if default.launches is not None:
                checks.append(f"{'ok' if default.launches == 1 else 'NOT ONE'} launch ({default.launches})")
            lines.append(f"{op} @{tokens} [{default.provider}]: " + "; ".join(checks))
    return lines


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: list[Row], meta: dict) -> str:
    head = [
        "# transfuse ops benchmark",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"{meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
        f"CUDA {meta['cuda']}; {meta['dtype']}, hidden {meta['hidden']}; copy bandwidth "
        f"{meta['copy_gbps']:.0f} GB/s (read + write).",
        "",
        "graph us: per call, from CUDA-graph replays over inputs rotated beyond the L2. eager us: per call "
        "issued from Python (host launch cost included). GB/s and % copy: minimum bytes over graph time. "
        "launches: GPU activities of one call (profiler).",
        "",
        "| op | tokens | variant | provider | graph us | eager us | GB/s | % copy | launches | note |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    body = [
        f"| {r.op} | {r.tokens} | {r.variant} | {r.provider} | {_fmt(r.graph_us, '.2f')} | {_fmt(r.eager_us, '.2f')} | "
        f"{_fmt(r.gbps, '.0f')} | {_fmt(r.copy_share and 100 * r.copy_share, '.0f')} | {_fmt(r.launches, 'd')} | {r.note} |"
        for r in rows
    ]
    return (
        "\n".join(head + body + ["", "## Targets (default dispatch)", ""] + [f"- {v}" for v in meta["verdicts"]]) + "\n"
    )


def _cell(row: Row | None) -> str:
    if row is not None and row.note.startswith("WRONG"):
        return "WRONG"
    return "-" if row is None or row.graph_us is None else f"{row.graph_us:.1f}"


def summary_table(rows: list[Row]) -> str:
    """One line per op and size: graph us of each variant, then the default's provider, share of copy
    bandwidth and launches."""
    variants = ["hf eager", "hf compile", "native", "torch", "triton", "cuda", "default"]
    header = f"{'op':<19}{'tokens':>7}" + "".join(f"{v:>11}" for v in variants) + "  provider %copy launches"
    lines = [header]
    by_key = {(r.op, r.tokens, r.variant): r for r in rows}
    for op, tokens in sorted({(r.op, r.tokens) for r in rows}, key=lambda k: (OPS.index(k[0]), k[1])):
        cells = "".join(f"{_cell(by_key.get((op, tokens, v))):>11}" for v in variants)
        default = by_key.get((op, tokens, "default"))
        share = _fmt(default and default.copy_share and 100 * default.copy_share, ".0f")
        launches = _fmt(default and default.launches, "d")
        lines.append(f"{op:<19}{tokens:>7}{cells}  {default.provider if default else '':<8}{share:>6}{launches:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", required=True, type=Path, help="directory for results.json, results.md, cuda_build.log"
    )
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096, 32768])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()

    build_cuda_extension(args.out)
    copy_bps = copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s", flush=True)

    torch.manual_seed(0)
    rows: list[Row] = []
    meta = environment(args, copy_bps)
    with torch.no_grad():
        for op in args.ops:
            for tokens in args.tokens:
                case = build_case(op, tokens, args.hidden, dtype)
                rows += run_case(case, dtype, copy_bps, launch_tokens={1, 16})
                meta["seconds"] = round(time.perf_counter() - started)
                write_results(args.out, rows, meta)  # after every case: a run cut short keeps what it measured
                print(f"{op} @{tokens} done ({meta['seconds']} s)", flush=True)

    print(f"\ncopy bandwidth {copy_bps / 1e9:.0f} GB/s; {args.dtype}, hidden {args.hidden}; {meta['seconds']} s")
    print("\n".join(meta["verdicts"]))
    print("\ngraph-replay us per call (WRONG: failed the check against native, not timed)")
    print(summary_table(rows))
    return 1 if any(r.note.startswith(("WRONG", "ERROR")) for r in rows) else 0


def environment(args: argparse.Namespace, copy_bps: float) -> dict:
    import transformers
    import triton

    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "hidden": args.hidden,
        "copy_gbps": copy_bps / 1e9,
    }


def write_results(out: Path, rows: list[Row], meta: dict) -> None:
    meta["verdicts"] = verdicts(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "results.md").write_text(markdown(rows, meta))


if __name__ == "__main__":
    sys.exit(main())
