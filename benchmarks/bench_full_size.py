"""Whole models at their real depth: decode and prefill, transformers and transfuse side by side.

    python benchmarks/bench_full_size.py --out DIR --model llama3_8b [--batch 1 32] [--prompt 512]
        [--new 256] [--rounds 2] [--prefill 2048 8192] [--profile 16]
    python benchmarks/bench_full_size.py --out DIR --model tiny        # toy sizes: tests the script on a CPU

Models (random bf16 weights of the real shapes, built on the GPU from a config):

  llama3_8b     Llama-3-8B: 32 layers, hidden 4096, GQA 32/8, intermediate 14336, vocab 128256
  qwen3_30b     Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts (top 8, 768 wide), vocab 151936
  tiny, tiny_moe   toy sizes of each

One process, one copy of the weights (a 30B model has room for one copy, not two), so the variants
run in this order on the same weights:

  transformers dynamic   stock model, the default DynamicCache, eager
  transformers static    stock model, cache_implementation="static" (transformers compiles the
                         decode step, CUDA graphs through torch.compile's "reduce-overhead")
  transformers compiled  (prefill) torch.compile(model), its default mode
  -- transfuse.rewrite(model) in place, then transfuse.decode_steps(model) --
  transfuse eager        generate's decode steps replayed as CUDA graphs of the eager forward
  -- transfuse.compile(model) in place --
  transfuse compiled     (decode and prefill)

Decode per token: (time of generate with --new tokens - time with 1 token) / (--new - 1), the
median of --rounds rounds. Tokens: every variant's greedy tokens against transformers dynamic's
(the fraction of positions equal before the first difference), and the fraction of steps whose
greedy choice is transformers dynamic's token when that text is fed back at every step.

The floor of a decode step is the bytes it must read over the copy bandwidth measured in the same
run: every weight but the input embedding table (of routed experts, the ones the batch's tokens
are sent to: for a batch of B tokens each choosing k of E experts, E * (1 - (1 - k/E)^B) distinct
experts per layer, the expectation under uniform routing), plus the keys and values attended,
averaged over the decoded positions. With --profile N, N decode tokens of each variant at the
first batch size run under the profiler (less a profiled generate of one token: the prompt's
forward), and the device time of a decode step is split into matrix products (GEMM/GEMV),
attention, other kernels and the host's gaps (wall time with no kernel running).

Writes DIR/full_size_<model>.md and .json, rows as they complete (a run cut short keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfuse  # noqa: E402
from bench_decode import agreement, forced_agreement, generate, timed  # noqa: E402
from bench_e2e import copy_bandwidth  # noqa: E402

SHAPES = {
    "llama3_8b": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192 + 64, num_hidden_layers=32, rope_theta=500000.0,
        tie_word_embeddings=False)),
    "qwen3_30b": ("qwen3_moe", dict(
        hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, max_position_embeddings=8192 + 64, num_hidden_layers=48, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=256, num_hidden_layers=2, tie_word_embeddings=False)),
    "tiny_moe": ("qwen3_moe", dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=256, num_hidden_layers=2, decoder_sparse_step=1, mlp_only_layers=[],
                                   tie_word_embeddings=False)),
}  # fmt: skip


def build(name: str, device: str, layers: int | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = SHAPES[name]
    shape = dict(shape, **({"num_hidden_layers": layers} if layers else {}))
    config = AutoConfig.for_model(model_type, **shape)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def floor_bytes(model, batch: int, prompt: int, new: int) -> float:
    """Bytes one decode step must read at this batch (see the module's docstring)."""
    config = model.config
    embed = model.get_input_embeddings().weight
    experts = getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    share = 1.0
    if experts and top_k:
        share = (1 - (1 - top_k / experts) ** batch)  # distinct experts touched / all experts
    weights = 0.0
    for name, p in model.named_parameters():
        if p is embed and model.get_output_embeddings().weight is not embed:
            continue
        weights += p.numel() * p.element_size() * (share if ".experts." in name else 1.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mean_position = prompt + new / 2
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2 * mean_position * batch
    return weights + kv


KINDS = (("GEMM/GEMV", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|matmul|_mm_|sm90_|wgmma|grouped|moe", re.I)),
         ("attention", re.compile(r"flash|attention|attn|fmha|sdpa|decode_att|split_kv|_partial_kernel|_combine_kernel",
                                   re.I)))


def _profiled(fn) -> dict:
    """One profiled call of ``fn``: kernel ms by kind and by name, the union of kernel time, wall ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    split = {"GEMM/GEMV": 0.0, "attention": 0.0, "other kernels": 0.0}
    by_name: dict[str, float] = {}
    spans = []
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        kind = next((k for k, pattern in KINDS if pattern.search(event.name)), "other kernels")
        split[kind] += event.time_range.elapsed_us() / 1e3
        by_name[event.name] = by_name.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
        spans.append((event.time_range.start, event.time_range.end))
    spans.sort()
    busy, end = 0.0, None
    for s, e in spans:  # union of kernel intervals (streams may overlap)
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return {"split": split, "by_name": by_name, "busy": busy / 1e3, "wall": wall_ms}


def profile_split(fn, tokens: int, prompt_only=None) -> dict:
    """Device time per decode token by kind of kernel, the largest kernels, and the wall time under
    the profiler. ``fn`` generates ``tokens`` tokens; ``prompt_only`` (generating one) is profiled
    too and taken away, so that the prompt's forward is not spread over the decode tokens."""
    whole = _profiled(fn)
    base = _profiled(prompt_only) if prompt_only is not None else None
    steps = tokens - 1 if base is not None else tokens

    def less(key: str, name: str | None = None) -> float:
        if name is None:
            return whole[key] - (base[key] if base else 0.0)
        return whole[key].get(name, 0.0) - (base[key].get(name, 0.0) if base else 0.0)

    out = {k: less("split", k) / steps for k in whole["split"]}
    out["busy"] = less("busy") / steps
    out["wall under the profiler"] = less("wall") / steps
    names = {name: less("by_name", name) / steps for name in whole["by_name"]}
    top = sorted(names.items(), key=lambda item: -item[1])[:20]
    out["kernels"] = {name[:120]: ms for name, ms in top}  # ms per decode token, the largest first
    out["decode steps only"] = base is not None
    return out


class Run:
    def __init__(self, args, device: str):
        self.args, self.device = args, device
        self.command = "python benchmarks/bench_full_size.py " + shlex.join(sys.argv[1:])
        self.result: dict = {"command": self.command, "model": args.model, "decode": {}, "prefill": {},
                             "first_call_s": {}, "profile": {}}
        self.want: dict[int, torch.Tensor] = {}
        self.ids: dict[int, torch.Tensor] = {}

    def save(self) -> None:
        path = os.path.join(self.args.out, f"full_size_{self.args.model}")
        with open(path + ".json", "w") as f:
            json.dump(self.result, f, indent=1)
        with open(path + ".md", "w") as f:
            f.write("\n".join(self.table()) + "\n")

    def table(self) -> list[str]:
        r = self.result
        lines = [f"# Whole-model decode and prefill, {r['model']} ({r.get('device')}, torch {r.get('torch')}, "
                 f"transformers {r.get('transformers')})", "", f"`{r['command']}`", "",
                 f"{r.get('layers')} layers, {r.get('parameters', 0) / 1e9:.2f} B parameters, "
                 f"copy bandwidth {r.get('copy_bandwidth_gbs', 0):.0f} GB/s (read + write, measured in this run).", "",
                 "| batch | variant | ms per token (median) | floor ms | x floor | tokens equal to transformers "
                 "dynamic (before the first difference) | greedy choice equal, its tokens fed back | first calls (s) |",
                 "|---|---|---|---|---|---|---|---|"]
        for batch, rows in r["decode"].items():
            for variant, row in rows.items():
                lines.append(f"| {batch} | {variant} | {row['ms_per_token']:.3f} | {row['floor_ms']:.3f} | "
                             f"{row['ms_per_token'] / row['floor_ms']:.2f} | {row['agreement']:.3f} | "
                             f"{row['forced_agreement']:.3f} | {r['first_call_s'].get(variant, float('nan')):.1f} |")
        if r["prefill"]:
            lines += ["", "| prefill tokens | variant | ms (median of 5) | first call (s) |", "|---|---|---|---|"]
            for tokens, rows in r["prefill"].items():
                for variant, row in rows.items():
                    lines.append(f"| {tokens} | {variant} | {row['ms']:.2f} | {row['first_call_s']:.1f} |")
        if r["profile"]:
            kinds = ["GEMM/GEMV", "attention", "other kernels"]
            batch = str(self.args.batch[0])
            lines += ["", f"Profile of {self.args.profile} decode tokens at batch {batch}, ms per token: kernel time "
                      "by kind (under the profiler; a generate of one token, the prompt's forward, profiled too and "
                      "taken away), and the host's gaps: the measured time per token (above, not profiled) less the "
                      "time some kernel ran.", "",
                      "| variant | " + " | ".join(kinds) + " | host gaps | wall under the profiler |",
                      "|---|" + "---|" * (len(kinds) + 2)]
            for variant, split in r["profile"].items():
                measured = r["decode"].get(batch, {}).get(variant, {}).get("ms_per_token", float("nan"))
                gaps = max(measured - split["busy"], 0.0)
                lines.append(f"| {variant} | " + " | ".join(f"{split[k]:.3f}" for k in kinds)
                             + f" | {gaps:.3f} | {split['wall under the profiler']:.3f} |")
        for note in r.get("notes", []):
            lines += ["", note]
        return lines

    def decode(self, variant: str, model, extra: dict) -> None:
        args = self.args
        for batch in args.batch:
            ids = self.ids.setdefault(batch, torch.randint(0, model.config.vocab_size, (batch, args.prompt),
                                                           device=self.device,
                                                           generator=torch.Generator(self.device).manual_seed(batch)))
            seconds = timed(lambda: generate(model, ids, 2, **extra), self.device)
            self.result["first_call_s"].setdefault(variant, seconds)
            tokens = generate(model, ids, args.new, **extra)
            want = self.want.setdefault(batch, tokens)
            times = []
            for _ in range(args.rounds):
                short = timed(lambda: generate(model, ids, 1, **extra), self.device)
                full = timed(lambda: generate(model, ids, args.new, **extra), self.device)
                times.append((full - short) / (args.new - 1) * 1e3)
            floor_ms = floor_bytes(model, batch, args.prompt, args.new) / self.bandwidth * 1e3
            row = {"ms_per_token": statistics.median(times), "all_ms": times, "floor_ms": floor_ms,
                   "agreement": agreement(tokens, want, args.prompt),
                   "forced_agreement": forced_agreement(model, ids, want, args.new, **extra)}
            self.result["decode"].setdefault(str(batch), {})[variant] = row
            print(f"batch {batch} {variant}: {row['ms_per_token']:.3f} ms/token, floor {floor_ms:.3f} "
                  f"(x{row['ms_per_token'] / floor_ms:.2f}), first calls {seconds:.1f} s", flush=True)
            self.save()
        if args.profile and args.batch and self.device == "cuda":
            ids = self.ids[args.batch[0]]
            generate(model, ids, args.profile, **extra)
            self.result["profile"][variant] = profile_split(lambda: generate(model, ids, args.profile, **extra),
                                                            args.profile, lambda: generate(model, ids, 1, **extra))
            self.save()

    def prefill(self, variant: str, fn, vocab: int) -> None:
        for tokens in self.args.prefill:
            ids = torch.randint(0, vocab, (1, tokens), device=self.device,
                                generator=torch.Generator(self.device).manual_seed(tokens))
            with torch.no_grad():
                first = timed(lambda: fn(ids), self.device)
                fn(ids)
                runs = [timed(lambda: fn(ids), self.device) * 1e3 for _ in range(5)]
            self.result["prefill"].setdefault(str(tokens), {})[variant] = {"ms": statistics.median(runs),
                                                                          "first_call_s": first}
            print(f"prefill {tokens} {variant}: {statistics.median(runs):.2f} ms (first call {first:.1f} s)", flush=True)
            self.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama3_8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (when it does not fit)")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 32], help="decode batch sizes (none: prefill only)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--profile", type=int, default=0, help="profile N decode tokens of each variant")
    parser.add_argument("--variants", nargs="+", default=["transformers dynamic", "transformers static",
                                                          "transformers compiled", "transfuse eager",
                                                          "transfuse compiled"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    os.makedirs(args.out, exist_ok=True)
    import transformers

    run = Run(args, device)
    model = build(args.model, device, args.layers)
    run.bandwidth = copy_bandwidth(device)
    run.result.update(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                      transformers=transformers.__version__, layers=model.config.num_hidden_layers,
                      parameters=sum(p.numel() for p in model.parameters()), copy_bandwidth_gbs=run.bandwidth / 1e9,
                      notes=[])
    print(f"{args.model}: {run.result['parameters'] / 1e9:.2f} B parameters, copy bandwidth "
          f"{run.bandwidth / 1e9:.0f} GB/s", flush=True)
    wanted = set(args.variants)
    if args.batch and wanted & {"transformers dynamic", "transformers static", "transfuse eager", "transfuse compiled"}:
        run.decode("transformers dynamic", model, {})  # the reference tokens
    if "transformers static" in wanted:
        run.decode("transformers static", model, {"cache_implementation": "static"})
    if "transformers compiled" in wanted and args.prefill:
        compiled = torch.compile(model)
        run.prefill("transformers compiled", lambda ids: compiled(ids, use_cache=False, logits_to_keep=1),
                    model.config.vocab_size)
        del compiled
    torch._dynamo.reset()
    torch.cuda.empty_cache() if device == "cuda" else None
    start = time.perf_counter()
    transfuse.rewrite(model)
    transfuse.decode_steps(model)
    run.result["rewrite_s"] = time.perf_counter() - start
    print(f"rewrite: {run.result['rewrite_s']:.1f} s", flush=True)
    if "transfuse eager" in wanted:
        run.decode("transfuse eager", model, {})
    if "transfuse compiled" in wanted:
        transfuse.compile(model)
        run.decode("transfuse compiled", model, {})
        if args.prefill:
            run.prefill("transfuse compiled", lambda ids: model(ids, use_cache=False, logits_to_keep=1),
                        model.config.vocab_size)
    if device == "cuda":
        run.result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    run.result["notes"].append(
        "Variants run one after another on one copy of the weights (stock first, then rewritten in place, "
        "then compiled in place); prefill computes the logits of the last position only (logits_to_keep=1), "
        "as generate's prefill does.")
    run.save()
    print("\n".join(run.table()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
