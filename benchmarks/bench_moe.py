"""Fused MoE against transformers' experts implementations, torch.compile and the bandwidth floor.

    python benchmarks/bench_moe.py --out DIR [--tokens 1 16 256 4096] [--crossover 1 2 4 8 16]
                                   [--no-compile] [--no-sweep] [--smoke]

A Qwen3-MoE-shaped block (hidden 2048, 128 experts, top-8, expert intermediate 768, bf16) from
transformers, with random weights. In one run:

1. correctness: transfuse's fused block (Triton kernels, and the native ops) and transformers'
   grouped_mm and batched_mm against transformers' eager experts, on fresh outputs over memory
   filled with NaN first;
2. the copy bandwidth of the GPU, and per token count the bandwidth floor: the bytes of the
   distinct experts the tokens are routed to, over that bandwidth;
3. timings (CUDA events, median, after warm-up; inputs rotated among 8, the L2 cache flushed
   before each call so weights come from memory as they would in a deep model) of:
   transformers eager / grouped_mm / batched_mm, torch.compile of the block (grouped_mm),
   transfuse native, transfuse Triton with its default path and tiles (up to
   ``DECODE_GRAPH_TOKENS`` the layer replays its own CUDA graph, ``transfuse.ops.graphs``: also
   timed without it; and the whole call replayed as a CUDA graph up to 256 tokens: the GPU time
   without launch overhead), and with each candidate
   configuration of its regime (``moe_configs.TUNING_CANDIDATES``: decode-path tiles at 1
   token, grouped tiles above; the best is reported: one run measures and tunes);
4. the crossover: at a few small token counts, the decode path against the grouped path, each
   with its default tiles;
5. DIR/bench_moe.json (everything) and DIR/bench_moe.md (the table, the crossover, and Python
   to paste into ``transfuse/ops/triton/moe_configs.py``: each measured regime's fastest
   configuration and the decode path's bound), also printed last.

Times are GPU times: the host runs ahead during the cache flush (~130 us), so launch overhead
hides as it does in a model whose GPU work outpaces the host. ``host_us`` is how long each call
takes to return on the host, for judging when that does not hold. A baseline that runs out of
memory (batched_mm at 4096 tokens) is recorded as such.

``--smoke`` runs the same steps on CPU at toy sizes (Triton interpreted), to test the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transfuse.ops.triton import moe_configs  # noqa: E402  (plain Python: Triton is imported later)
from transfuse.ops.graphs import suspended as no_decode_graphs  # noqa: E402  (the layer runs its code)
from transfuse.ops.moe_layer import DECODE_GRAPH_TOKENS  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DEVICE = "cuda"
TARGETS = {1: ("floor", 3.0), 16: ("floor", 1.5), 256: ("floor", 1.5), 4096: ("us", 1000.0)}
ROTATION = 8
# Largest error of an output relative to the reference's largest magnitude (bf16). The smoke test's
# interpreter rounds float32 to bfloat16 by truncation (the GPU rounds to nearest), hence its own.
TOLERANCE = 2e-2
DEADLINE_S = 240  # stop optional work (compile, sweeps, crossover) after this, so the run ends inside 5 minutes

_START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def late() -> bool:
    return time.monotonic() - _START > DEADLINE_S


# ---- setup ---------------------------------------------------------------------------------


def build_block():
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    config._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(config).to(DEVICE, torch.bfloat16).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block, config


def build_fused(block):
    import transfuse
    from transfuse.ops import MoE

    holder = torch.nn.Sequential(block)
    x = torch.randn(1, 8, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    transfuse.rewrite(holder, example_inputs=(x,), fusions=["moe"])
    transfuse.decode_steps(holder)  # small batches replayed as CUDA graphs, as the drop-in loader has them
    fused = holder[0]
    if not isinstance(fused, MoE):
        raise RuntimeError(f"transfuse did not fuse the block:\n{transfuse.report(holder)}")
    return fused


@contextmanager
def experts_implementation(config, name: str):
    previous = config._experts_implementation
    config._experts_implementation = name
    try:
        yield
    finally:
        config._experts_implementation = previous


@contextmanager
def provider(name: str):
    from transfuse.ops import set_priority

    for op in ("moe_route", "moe_experts"):
        set_priority([name], op)
    try:
        yield
    finally:
        for op in ("moe_route", "moe_experts"):
            set_priority(None, op)


def inputs_for(tokens: int) -> list[torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    return [torch.randn(1, tokens, HIDDEN, generator=g, device=DEVICE, dtype=torch.bfloat16) for _ in range(ROTATION)]


# ---- measuring -----------------------------------------------------------------------------


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class _WallEvent:
    """A stand-in for a CUDA event on CPU (``--smoke``)."""

    def record(self):
        self.time = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1e3


def event():
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else _WallEvent()


class Timer:
    """Median GPU time (CUDA events) and host time of a call, inputs rotated, L2 flushed before each."""

    def __init__(self):
        self.flush = torch.empty((512 << 20) if DEVICE == "cuda" else 1 << 20, dtype=torch.uint8, device=DEVICE)

    def __call__(self, fn, inputs, reps: int) -> dict:
        with torch.no_grad():
            for x in inputs[:3]:
                fn(x)
            synchronize()
            starts, ends = [event() for _ in range(reps)], [event() for _ in range(reps)]
            host = []
            for i in range(reps):
                self.flush.zero_()
                x = inputs[i % len(inputs)]
                starts[i].record()
                t0 = time.perf_counter()
                fn(x)
                host.append(time.perf_counter() - t0)
                ends[i].record()
            synchronize()
        gpu = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        return {"us": statistics.median(gpu), "host_us": statistics.median(host) * 1e6, "reps": reps}


def copy_bandwidth() -> float:
    """Bytes moved per second by a device-to-device copy of 1 GiB (read + write)."""
    src = torch.empty((1 << 30) if DEVICE == "cuda" else 1 << 24, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = event(), event()
        start.record()
        dst.copy_(src)
        end.record()
        synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def touched_experts(block, inputs) -> float:
    """The mean number of distinct experts the tokens of each input are routed to."""
    counts = []
    with torch.no_grad():
        for x in inputs:
            ids = block.gate(x.view(-1, HIDDEN))[2]
            counts.append(ids.unique().numel())
    return sum(counts) / len(counts)


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def poison() -> None:
    """Fill the caching allocator's free memory with NaN, so that an output the kernels leave unwritten shows."""
    if DEVICE == "cuda":
        block = torch.empty(1 << 28, dtype=torch.float32, device=DEVICE).fill_(float("nan"))
        del block


# ---- the run -------------------------------------------------------------------------------


def check(block, config, fused, tokens: int) -> dict:
    x = inputs_for(tokens)[0]
    errors = {}
    with torch.no_grad():
        with experts_implementation(config, "eager"):
            want = block(x)
        for name in ("grouped_mm", "batched_mm"):
            try:
                with experts_implementation(config, name):
                    poison()
                    errors[f"transformers {name}"] = relative_error(block(x), want)
            except torch.cuda.OutOfMemoryError:
                errors[f"transformers {name}"] = "out of memory"
                torch.cuda.empty_cache()
        for name in ("triton", "native"):
            with provider(name):
                poison()
                out = fused(x)
                errors[f"transfuse {name}"] = "NaN in output" if out.isnan().any() else relative_error(out, want)
    return errors


def time_all(block, config, fused, tokens: int, timer: Timer, args) -> dict:
    inputs = inputs_for(tokens)
    reps = 3 if args.smoke else 50 if tokens <= 16 else 30 if tokens <= 256 else 15
    results = {}
    attempt = attempter(results, timer, inputs, tokens)

    for impl in ("eager", "grouped_mm", "batched_mm"):
        with experts_implementation(config, impl):
            attempt(f"transformers {impl}", block, max(5, reps // 3) if impl == "eager" and tokens > 256 else reps)
    if args.compile and not late():
        # One compiled block for every size, as a user would have it: static for the first size,
        # then recompiled once with dynamic shapes (torch.compile's default).
        if getattr(args, "compiled", None) is None:  # not `or`: a compiled module's truth value calls len()
            args.compiled = torch.compile(block)
        with experts_implementation(config, "grouped_mm"):
            t0 = time.monotonic()
            attempt("torch.compile (grouped_mm)", args.compiled, reps)
            results.get("torch.compile (grouped_mm)", {})["wall_s_with_compile"] = time.monotonic() - t0
    with provider("native"), no_decode_graphs():
        attempt("transfuse native", fused, max(5, reps // 3))
    with provider("triton"):
        attempt("transfuse triton", fused, reps)
        default = moe_configs.config_for(tokens, TOP_K, EXPERTS)
        results["transfuse triton"]["config"] = default.describe()
        if DEVICE == "cuda" and tokens <= DECODE_GRAPH_TOKENS:
            with no_decode_graphs():
                attempt("transfuse triton, no decode graph", fused, reps)
        if DEVICE == "cuda" and tokens <= 256:
            attempt("transfuse triton (CUDA graph)", graphed(fused, inputs[0]), reps)
        with no_decode_graphs():  # a decode graph replays the tiles it was captured with
            best = sweep(fused, tokens, default, results, attempt, reps) if args.sweep else None
        results["transfuse triton best"] = best or {
            "us": results["transfuse triton"].get("us", math.inf), "config": default.describe(), "repr": repr(default)
        }  # fmt: skip
    return results


def attempter(results: dict, timer: Timer, inputs, tokens: int):
    """``attempt(name, fn, reps)``: time ``fn`` into ``results[name]``; a failure or running out of
    memory is recorded as that entry's result, not raised."""

    def attempt(name, fn, reps):
        try:
            results[name] = timer(fn, inputs, reps)
            log(f"  {tokens:>5} tokens  {name:<44} {results[name]['us']:9.1f} us (host {results[name]['host_us']:.1f} us)")
        except torch.cuda.OutOfMemoryError:
            results[name] = {"error": "out of memory"}
            torch.cuda.empty_cache()
            log(f"  {tokens:>5} tokens  {name:<44} out of memory")
        except Exception as exc:  # a variant that fails is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            log(f"  {name} failed: {results[name]['error']}")

    return attempt


def graphed(fused, example):
    """The block captured in a CUDA graph on the first call, then replayed with each input copied
    into the captured one: GPU time without the host's launch overhead (what a model run under
    CUDA graphs would see). Captured lazily, so that a failure is the timing's, not the row's."""
    static, captured = example.clone(), []

    def replay(x):
        if not captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fused(static)  # kernels compiled and memory cached off the capture
            torch.cuda.current_stream().wait_stream(side)
            captured.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(captured[0]):
                fused(static)
        static.copy_(x)
        captured[0].replay()

    return replay


def sweep(fused, tokens: int, default, results: dict, attempt, reps: int) -> dict:
    """Time each candidate of the token count's regime; the best of them and the default."""
    timed = [(results["transfuse triton"].get("us", math.inf), default)]
    for candidate in moe_configs.TUNING_CANDIDATES[moe_configs.regime(tokens, TOP_K, EXPERTS)]:
        if late():
            break
        name = f"transfuse triton {candidate.describe()}"
        with moe_configs.using_config(candidate):
            attempt(name, fused, reps)
        results[name]["config"] = candidate.describe()
        timed.append((results[name].get("us", math.inf), candidate))
    best_us, best = min(timed, key=lambda t: t[0])
    return {"us": best_us, "config": best.describe(), "repr": repr(best)}


def crossover(fused, timer: Timer, counts: list[int]) -> list[dict]:
    """Per token count, the default decode-path and grouped-path ("tiny") configurations, each
    forced: where the decode path stops winning is where DECODE_MAX_PAIRS belongs."""
    rows = []
    for tokens in counts:
        if late():
            break
        results, inputs = {}, inputs_for(tokens)
        attempt = attempter(results, timer, inputs, tokens)
        for path in ("decode", "tiny"):
            with provider("triton"), moe_configs.using_config(moe_configs.CONFIGS[path]), no_decode_graphs():
                attempt(path, fused, 3 if DEVICE != "cuda" else 50)
        rows.append({"tokens": tokens, "pairs": tokens * TOP_K, **{k: v.get("us") for k, v in results.items()}})
    return rows


def suggested_defaults(rows: list[dict], cross: list[dict]) -> str:
    """Python to paste into transfuse/ops/triton/moe_configs.py: each regime's fastest configuration
    in this run (regimes not measured keep theirs), and the decode path's bound."""
    best: dict[str, tuple[float, str, int]] = {}
    for row in rows:
        found = row.get("results", {}).get("transfuse triton best")
        if found and math.isfinite(found["us"]):
            name = moe_configs.regime(row["tokens"], TOP_K, EXPERTS)
            if name not in best or row["tokens"] > best[name][2]:  # the largest count measured in the regime
                best[name] = (found["us"], found["repr"], row["tokens"])
    lines = ["CONFIGS: dict[str, Config] = {"]
    for name, current in moe_configs.CONFIGS.items():
        if name in best:
            us, text, tokens = best[name]
            lines.append(f'    "{name}": {text},  # fastest at {tokens} tokens: {us:.1f} us')
        else:
            lines.append(f'    "{name}": {current!r},  # not measured: unchanged')
    lines.append("}")
    wins = [c["pairs"] for c in cross if (c.get("decode") or math.inf) < (c.get("tiny") or math.inf)]
    if wins:
        lines.append(f"DECODE_MAX_PAIRS = {max(wins)}  # the most pairs at which the decode path won here")
    elif cross:
        lines.append("DECODE_MAX_PAIRS = 0  # the decode path never won here")
    else:
        lines.append(f"DECODE_MAX_PAIRS = {moe_configs.DECODE_MAX_PAIRS}  # not measured: unchanged")
    return "\n".join(lines)


def verdict(tokens: int, floor_us: float, results: dict) -> tuple[str, list[str]]:
    """PASS/FAIL against the targets, and why."""
    ours = results["transfuse triton"].get("us", math.inf)
    reasons = []
    kind, bound = TARGETS.get(tokens, ("floor", math.inf))
    if kind == "floor" and ours > bound * floor_us:
        reasons.append(f"{ours / floor_us:.2f}x floor > {bound}x")
    if kind == "us" and ours >= bound:
        reasons.append(f"{ours:.0f} us >= {bound:.0f} us")
    for name, r in results.items():
        if name.startswith("transformers") and "us" in r and r["us"] <= ours:
            reasons.append(f"not faster than {name}")
    return ("PASS" if not reasons else "FAIL"), reasons


def _cell(result: dict | None) -> str:
    """A timing, or why there is none (out of memory, an error, not run)."""
    if result is None:
        return "-"
    return f"{result['us']:.1f}" if "us" in result else result.get("error", "-")[:24]


def table(rows: list[dict]) -> str:
    names = [
        "transformers eager", "transformers grouped_mm", "transformers batched_mm",
        "torch.compile (grouped_mm)", "transfuse native",
    ]  # fmt: skip
    head = ["tokens", "floor us", "transfuse triton us", "x floor", "host us", "no decode graph us", "CUDA graph us",
            "best tiles us",
            "best tiles", *[n.replace("transformers ", "hf ") for n in names], "targets"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        r = row["results"]
        ours = r["transfuse triton"].get("us", math.nan)
        cells = [
            str(row["tokens"]), f"{row['floor_us']:.1f}", f"{ours:.1f}", f"{ours / row['floor_us']:.2f}",
            f"{r['transfuse triton'].get('host_us', math.nan):.1f}", _cell(r.get("transfuse triton, no decode graph")),
            _cell(r.get("transfuse triton (CUDA graph)")),
            f"{r['transfuse triton best']['us']:.1f}", r["transfuse triton best"]["config"],
            *[_cell(r.get(n)) for n in names],
            row["verdict"] + ("" if row["verdict"] == "PASS" else f" ({'; '.join(row['reasons'])})"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover_table(rows: list[dict]) -> str:
    lines = ["| tokens | pairs | decode path | grouped path (tiny) |", "|---|---|---|---|"]
    for row in rows:
        cells = [str(row["tokens"]), str(row["pairs"]), *(f"{row.get(k) or math.nan:.1f}" for k in ("decode", "tiny"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment() -> dict:
    import transformers
    import triton

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU ({platform.processor() or 'unknown'}), smoke test"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown"
    return {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "transfuse_commit": sha,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }  # fmt: skip


def _smoke_sizes() -> None:
    global HIDDEN, INTER, EXPERTS, TOP_K, DEVICE, ROTATION, TOLERANCE
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("--smoke needs TRITON_INTERPRET=1 set before triton is imported.")
    os.environ["TRITON_INTERPRET"] = "1"
    HIDDEN, INTER, EXPERTS, TOP_K, DEVICE, ROTATION, TOLERANCE = 64, 32, 8, 2, "cpu", 2, 6e-2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for bench_moe.json and bench_moe.md")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="time the default tiles only")
    parser.add_argument(
        "--crossover", type=int, nargs="*", default=[1, 2, 4, 8, 16],
        help="token counts at which to time the decode path against the grouped path (none: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes on CPU with Triton interpreted: tests the script"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        _smoke_sizes()
        args.compile = False  # Inductor on CPU would take most of the smoke test's time
    elif not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU (or --smoke, which runs toy sizes on CPU).", file=sys.stderr)
        return 2
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    report = {"environment": environment(), "shape": dict(hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K)}
    log(f"environment: {report['environment']}")
    block, config = build_block()
    fused = build_fused(block)
    log(f"fused: {fused.extra_repr()}")
    report["copy_bandwidth_GBps"] = bandwidth = copy_bandwidth() / 1e9
    log(f"copy bandwidth {bandwidth:.0f} GB/s")
    expert_bytes = (block.experts.gate_up_proj[0].numel() + block.experts.down_proj[0].numel()) * 2
    timer, rows = Timer(), []
    for tokens in args.tokens:
        row = {"tokens": tokens}
        try:
            row["errors"] = check(block, config, fused, tokens)
            log(f"{tokens} tokens: errors vs transformers eager {row['errors']}")
            row["touched_experts"] = touched_experts(block, inputs_for(tokens))
            row["floor_us"] = row["touched_experts"] * expert_bytes / (bandwidth * 1e9) * 1e6
            row["results"] = time_all(block, config, fused, tokens, timer, args)
            row["verdict"], row["reasons"] = verdict(tokens, row["floor_us"], row["results"])
            bad = [
                k
                for k, v in row["errors"].items()
                if k.startswith("transfuse") and not (isinstance(v, float) and v <= TOLERANCE)
            ]
            if bad:
                row["verdict"], row["reasons"] = "FAIL", row["reasons"] + [f"wrong numbers: {', '.join(bad)}"]
        except Exception:  # keep the other sizes' results
            row["error"] = traceback.format_exc()
            log(row["error"])
        rows.append(row)
        (args.out / "bench_moe.json").write_text(json.dumps({**report, "rows": rows}, indent=2, default=str))
    report["crossover"] = cross = crossover(fused, timer, args.crossover)
    report["suggested_defaults"] = suggestion = suggested_defaults(rows, cross)
    (args.out / "bench_moe.json").write_text(json.dumps({**report, "rows": rows}, indent=2, default=str))
    text = table([r for r in rows if "results" in r])
    header = (
        f"Qwen3-MoE block (hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, intermediate {INTER}, bf16) "
        f"on {report['environment']['gpu']}; copy bandwidth {bandwidth:.0f} GB/s; times in us (CUDA events, median).\n"
        f"Command: {report['environment']['command']}\n\n"
    )
    extra = (
        f"\n\nDecode path against the grouped path (default tiles of each, us):\n\n{crossover_table(cross)}\n\n"
        f"Suggested defaults: replace CONFIGS and DECODE_MAX_PAIRS in transfuse/ops/triton/moe_configs.py with\n\n"
        f"```python\n{suggestion}\n```\n"
    )
    (args.out / "bench_moe.md").write_text(header + text + extra)
    print(header + text + extra)
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"{r['tokens']} tokens: the benchmark failed; see bench_moe.json", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
