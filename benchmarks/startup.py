"""From a command to the first tokens: how long a fresh process waits.

* ``compile``: in a fresh process per run, a tiny random model is built, rewritten and
  ``transfuse.compile``d, then ``generate`` makes 16 tokens greedily, streaming them through
  transformers' ``TextIteratorStreamer``; the time from ``compile`` returning to the first token's
  text reaching the streamer (the time to the first token: on CUDA, where the stop check is
  deferred, a token reaches the streamer a step late, after the first decode step has been
  compiled), and to ``generate`` returning, split by
  torch's own timers (Dynamo, Inductor), the loading of kept compiled calls
  (``transfuse/compile/precompiled.py``) and what is left (capture and the steps). Runs come in
  turns, alternating: one with the transfuse cache empty (torch's own caches warm, as in any second
  process) and one with it filled by an earlier process; with ``--baseline-repo`` a third, with an
  empty cache and transfuse imported from another checkout (the code before a change: the baseline
  a change is measured against). The median of each.
* ``cli``: ``transfuse --help`` and the time until ``transfuse explain llama`` prints its first line.
* ``--gpu``: Llama-3-8B shapes with 8 layers in bfloat16 on CUDA (``--tiny`` shrinks them, for a
  dry run on the CPU).

    nice python benchmarks/startup.py --models llama qwen3_moe --pairs 5 --only compile --baseline-repo ../main
    python benchmarks/startup.py --gpu --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GPU_SHAPES = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  num_hidden_layers=8, vocab_size=128256, head_dim=128)  # fmt: skip


def child(options: dict) -> dict:
    """One fresh process's run (``--child``): what it measured, as JSON on the last line."""
    import torch

    import transfuse
    from torch._dynamo.utils import counters
    from transfuse.tiny import tiny_model

    device = options["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, options["dtype"])
    overrides = options["shapes"]
    if overrides:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs: a CPU's init of 2B weights takes a minute
            model = AutoModelForCausalLM.from_config(LlamaConfig(**overrides), dtype=dtype).eval()
    else:
        model = tiny_model(options["model"], dtype=dtype)
    model = transfuse.rewrite(model.to(device))
    start = time.perf_counter()
    transfuse.compile(model, cache_dir=options["cache_dir"])
    returned = time.perf_counter()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    streamer, first_token, reader = _first_token_streamer(model.config.vocab_size)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, streamer=streamer)  # fmt: skip
    if device == "cuda":
        torch.cuda.synchronize()
    done = time.perf_counter()
    reader.join(timeout=60)
    spent = _time_spent()
    kept = _precompiled_seconds()
    if not spent.get("dynamo"):  # calls kept across processes: traced and compiled by torch's precompile
        spent["dynamo"] = kept["kept_compile_s"]
    generate_s = done - returned
    return {
        "compile_call_s": returned - start,
        "precompiled": dict(getattr(getattr(model._transfuse_compiled, "precompiled", None), "counts", {}) or {}),
        **kept,
        "generate_s": generate_s,
        "first_token_s": first_token[0] - returned if first_token else float("nan"),
        "dynamo_s": spent.get("dynamo", 0.0),
        "inductor_s": spent.get("inductor", 0.0),
        "rest_s": max(generate_s - spent.get("dynamo", 0.0) - kept["load_s"], 0.0),
        "tokens": int(out.shape[1] - ids.shape[1]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "fxgraph_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_misses": counters["inductor"]["fxgraph_cache_miss"],
        "transfuse_cache": dict(counters["transfuse_cache"]),
    }


def _first_token_streamer(vocab: int):
    """transformers' own text streamer (the kind a compiled model's decoding loop keeps on its fast
    path) over a tokenizer whose every token is a line, so that each token's text is handed on as
    it comes; a thread notes when the first arrives. Returns (streamer, times, the thread):
    ``times[0]`` is when the first generated token reached the host."""
    import threading

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, TextIteratorStreamer

    words = Tokenizer(WordLevel({f"t{i}\n": i for i in range(vocab)}, "t0\n"))
    streamer = TextIteratorStreamer(PreTrainedTokenizerFast(tokenizer_object=words), skip_prompt=True)
    times: list[float] = []

    def note() -> None:
        for text in streamer:
            if text and not times:
                times.append(time.perf_counter())

    reader = threading.Thread(target=note, daemon=True)
    reader.start()
    return streamer, times, reader


def _precompiled_seconds() -> dict:
    """transfuse's own timers of kept compiled calls (absent in a checkout without them)."""
    try:
        from transfuse.compile.precompiled import SECONDS
    except ImportError:
        return {"load_s": 0.0, "inductor_load_s": 0.0, "kept_compile_s": 0.0}
    return {"load_s": SECONDS["load"], "inductor_load_s": SECONDS["inductor_load"], "kept_compile_s": SECONDS["compile"]}


def _time_spent() -> dict:
    """Dynamo's whole frame compilation (Inductor included) and Inductor's part of it, in seconds."""
    from torch._dynamo import utils

    try:
        spent = utils.calculate_time_spent()
    except Exception:  # noqa: BLE001 - a timer torch renamed: the split is left out
        return {}
    total = spent.get("entire_frame_compile", 0.0) or spent.get("_compile.compile_inner", 0.0)
    total += spent.get("fullgraph_capture", 0.0)  # (Dynamo's precompile: tracing a call to keep it)
    inductor = spent.get("inductor_compile", 0.0) or spent.get("backend_compile", 0.0)
    return {"dynamo": total, "inductor": inductor}


def run_child(options: dict, repo: str | None = None) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps(options)]
    env = dict(os.environ, PYTHONPATH=repo) if repo else None  # transfuse imported from that checkout
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if result.returncode != 0:
        raise SystemExit(f"the child failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compile_startup(args: argparse.Namespace) -> None:
    device = "auto" if args.gpu else "cpu"
    dtype = "bfloat16" if args.gpu else "float32"
    shapes = {}
    if args.gpu:
        shapes = dict(GPU_SHAPES)
        if args.tiny:
            shapes.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=2, vocab_size=256, head_dim=16)  # fmt: skip
    models = ["llama-3-8b-shapes"] if args.gpu else args.models
    for model in models:
        with tempfile.TemporaryDirectory() as root:
            cache = os.path.join(root, "transfuse-cache")
            options = {"model": model, "device": device, "dtype": dtype, "shapes": shapes, "cache_dir": cache}
            # Torch's own caches warm, and the transfuse cache filled, by a first process (of each
            # checkout: the key covers transfuse's sources, so each has an entry of its own).
            first = run_child(options)
            if args.warm_against:
                run_child(options, args.warm_against)
            kinds = ("empty", "warm") + (("baseline",) if args.baseline_repo else ()) + (("warm_against",) if args.warm_against else ())
            repos = {"baseline": args.baseline_repo, "warm_against": args.warm_against}
            rows = {kind: [] for kind in kinds}
            for _ in range(args.pairs):
                for kind in kinds:
                    fresh = os.path.join(root, f"empty-{time.monotonic_ns()}")
                    chosen = dict(options, cache_dir=cache if kind.startswith("warm") else fresh)
                    rows[kind].append(run_child(chosen, repos.get(kind)))
            print(f"\n{model} on {first['device']} ({dtype}), {args.pairs} runs of each, first process {first['generate_s']:.2f} s")
            columns = ("first_token_s", "generate_s", "compile_call_s", "dynamo_s", "inductor_s", "load_s", "inductor_load_s", "rest_s")
            print(f"  {'transfuse cache':16} {'first token s':>13} {'generate(16) s':>14} {'compile() s':>11} {'dynamo s':>9} {'inductor s':>10}"
                  f" {'load s':>7} {'of it Inductor':>14} {'rest s':>7}  fx hits/misses  transfuse cache  kept calls")
            medians = {}
            for kind, runs in rows.items():
                med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in columns}
                medians[kind] = med
                last = runs[-1]
                print(f"  {kind:16} {med['first_token_s']:13.2f} {med['generate_s']:14.2f} {med['compile_call_s']:11.2f} {med['dynamo_s']:9.2f}"
                      f" {med['inductor_s']:10.2f} {med['load_s']:7.2f} {med['inductor_load_s']:14.2f} {med['rest_s']:7.2f}"
                      f"  {last['fxgraph_hits']}/{last['fxgraph_misses']}  {last['transfuse_cache']}  {last.get('precompiled')}")
                each = ", ".join(f"{r['first_token_s']:.2f}/{r['generate_s']:.2f}" for r in runs)
                print(f"  {'':16} each run (first token/generate): {each}")
            for kind in [k for k in kinds if k != "warm"]:
                print(f"  warm / {kind}: first token {medians['warm']['first_token_s'] / medians[kind]['first_token_s']:.0%},"
                      f" generate {medians['warm']['generate_s'] / medians[kind]['generate_s']:.0%}"
                      f" (with compile(): {_total(medians['warm']) / _total(medians[kind]):.0%})")


def _total(med: dict) -> float:
    return med["generate_s"] + med["compile_call_s"]


def cli_startup(args: argparse.Namespace) -> None:
    helps = []
    for _ in range(args.pairs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "transfuse", "--help"], capture_output=True, check=True)
        helps.append(time.perf_counter() - start)
    firsts = []
    for _ in range(args.pairs):
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "transfuse", "explain", "llama"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        line = process.stderr.readline()
        firsts.append(time.perf_counter() - start)
        process.kill()
        process.wait()
    print(f"transfuse --help: median {statistics.median(helps):.2f} s ({', '.join(f'{t:.2f}' for t in helps)})")
    print(f"transfuse explain llama, first line {line.strip()!r}: median {statistics.median(firsts):.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["llama", "qwen3_moe"])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="Llama-3-8B shapes, 8 layers, bfloat16 on CUDA")
    parser.add_argument("--tiny", action="store_true", help="with --gpu: tiny shapes (a dry run)")
    parser.add_argument("--only", choices=("compile", "cli"), default=None)
    parser.add_argument("--baseline-repo", default=None,
                        help="also run processes with an empty cache that import transfuse from this checkout")
    parser.add_argument("--warm-against", default=None,
                        help="also run warm processes that import transfuse from this checkout (its own entry)")
    args = parser.parse_args()
    if args.child:
        options = json.loads(args.child)
        print(json.dumps(child(options)))
        return 0
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {' '.join(sys.argv)}")
    if args.only in (None, "cli"):
        cli_startup(args)
    if args.only in (None, "compile"):
        compile_startup(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
