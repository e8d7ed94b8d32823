"""Decode time per token through ``generate``: transformers and transfuse side by side, one process.

    python benchmarks/bench_decode.py --out DIR [--model llama|qwen3_moe] [--batch 1 32]
        [--prompt 512] [--new 128] [--rounds 3] [--prefill 2048]

A model of Llama-3-8B layer shapes (8 layers, vocab 32000) or Qwen3-MoE shapes (4 layers),
random bf16 weights, greedy decoding with no end-of-sequence token. Variants:

  transformers dynamic   stock model, the default DynamicCache
  transformers static    stock model, cache_implementation="static" (transformers compiles it,
                         CUDA graphs through torch.compile's "reduce-overhead")
  transfuse eager        transfuse.rewrite + transfuse.decode_steps, DynamicCache, TRANSFUSE_STEP_GRAPHS=0 (the MoE
                         blocks of decode steps replayed as CUDA graphs: ops/graphs.py)
  transfuse eager, step graphs    TRANSFUSE_STEP_GRAPHS=1 (the default): generate's decode steps
                         replayed as CUDA graphs of the eager forward (compile/eager_steps.py)
  transfuse eager, no graphs      TRANSFUSE_DECODE_GRAPHS=0
  ..., streamed          a variant above (transformers dynamic, transfuse eager, transfuse eager
                         with step graphs, transfuse compiled) with transformers'
                         TextIteratorStreamer, as a chat interface streams (a tokenizer of the
                         model's vocabulary made in memory; batch 1 only)
  transfuse compiled     transfuse.rewrite + transfuse.compile, DynamicCache (a decode step is
                         one CUDA graph, its keys and values in a KVStore; in generate's closed
                         loop the whole call is replayed, Dynamo's guards checked at the first
                         replay of each generate call)
  transfuse compiled, Dynamo every step    replay=False (every step through Dynamo and its
                         guards to the step's graph; the lean loop still runs)
  transfuse compiled, transformers' loop    lean_loop=False (generate's steps run by
                         transformers' _sample rather than transfuse's lean loop)
  transfuse compiled, module guards off    the same with trust_modules=True (the whole call
                         replayed without entering Dynamo once Dynamo's remaining guards pass)
  transfuse compiled, module guards off, Dynamo every step    trust_modules=True, replay=False
  transfuse compiled, replayed, every guard    replay=True (the module guards on)
  transfuse compiled, graph per piece      the same with kv_store=False (attention eager between
                         graphed pieces)

Per-token time: (time of generate with --new tokens - time with 1 token) / (--new - 1), the
median over --rounds rounds in which the variants take turns. Every variant's tokens are
compared with transfuse eager's twice: the fraction of positions equal before the first
difference (bf16 near-ties flip a greedy choice, after which the texts part), and the fraction
of steps whose greedy choice is transfuse eager's token when that text is fed back at every
step (a logits processor records the choice and forces the token). The floor is the bytes of the
weights one token reads (all but the input embedding table) over the copy bandwidth measured in
the same run. With --prefill N: a forward over N tokens with no cache, transformers compiled
(torch.compile's default) against transfuse compiled, and each compiled variant's compile and
capture time (its first calls). Writes DIR/decode_<model>.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfuse  # noqa: E402
from bench_e2e import copy_bandwidth  # noqa: E402 (this directory is on the path of a script run from it)

SHAPES = {
    "llama": (
        "llama",
        dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=32000, max_position_embeddings=8192, num_hidden_layers=8),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             vocab_size=32000, max_position_embeddings=8192, num_hidden_layers=4),
    ),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=256, num_hidden_layers=2)),
}


def build(name: str, device: str, **overrides):
    """The model of ``SHAPES[name]`` (its configuration's values replaced by ``overrides``), bf16 random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = SHAPES[name]
    shape = dict(shape, **overrides)
    config = AutoConfig.for_model(model_type, **shape)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def weight_bytes(model) -> float:
    """Bytes of the weights one token reads: all but the input embedding table (unless it is the
    output head too), and of the routed experts only the top-k it is sent to."""
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    experts = getattr(model.config, "num_experts", None)
    active = getattr(model.config, "num_experts_per_tok", None)
    total = 0.0
    for name, p in model.named_parameters():
        if p is embed and not tied:
            continue
        share = active / experts if experts and active and ".experts." in name else 1.0
        total += p.numel() * p.element_size() * share
    return total


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, ids, new: int, _env: dict[str, str] | None = None, _streamed: bool = False, **extra):
    """Greedy ``generate`` of ``new`` tokens; ``_env``: environment variables set for the call;
    ``_streamed``: the tokens streamed through transformers' ``TextIteratorStreamer``."""
    saved = {name: os.environ.get(name) for name in _env or {}}
    os.environ.update(_env or {})
    if _streamed:
        from transformers import TextIteratorStreamer

        extra["streamer"] = TextIteratorStreamer(word_tokenizer(model.config.vocab_size))
    try:
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                    min_new_tokens=new, do_sample=False, **extra)
        if _streamed:
            "".join(extra["streamer"])  # (all of it is there by now)
        return tokens
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@functools.cache
def word_tokenizer(vocab: int):
    """A transformers tokenizer whose words are the ids (``t0`` ... ``t{vocab - 1}``), made in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words)


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class ForcedTokens:
    """A logits processor that records each step's greedy choice, then forces ``tokens``' next
    token: every step of every variant decodes the same text (teacher forcing), so one flipped
    near-tie does not part the texts, and agreement counts steps, not prefixes."""

    def __init__(self, tokens: torch.Tensor, prompt: int):
        self.tokens, self.prompt, self.choices = tokens, prompt, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.choices.append(scores.argmax(dim=-1))
        forced = self.tokens[:, input_ids.shape[1]]
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, forced[:, None], 0.0)


def forced_agreement(model, ids, want: torch.Tensor, new: int, **extra) -> float:
    """The fraction of steps at which the model's greedy choice is ``want``'s token, with
    ``want``'s tokens fed back at every step."""
    from transformers import LogitsProcessorList

    forced = ForcedTokens(want, ids.shape[1])
    fed = generate(model, ids, new, logits_processor=LogitsProcessorList([forced]), **extra)
    if not torch.equal(fed, want[:, : fed.shape[1]]):
        raise RuntimeError("the forced tokens were not the ones decoded")
    choices = torch.stack(forced.choices, dim=1)
    return (choices == want[:, ids.shape[1] : ids.shape[1] + choices.shape[1]]).float().mean().item()


def agreement(got: torch.Tensor, want: torch.Tensor, prompt: int) -> float:
    got, want = got[:, prompt:], want[:, prompt:]
    equal = (got == want).int().cumprod(dim=1)  # 1 until the first difference in each row
    return equal.sum().item() / want.numel()


def profile(fn, device: str, tokens: int) -> str:
    """Host and device time of ``fn`` under the profiler: device busy time per token, then the
    top operators by self host time and by device time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    from torch.autograd import DeviceType

    # Kernels are counted once, through the host-side events that launched them (as the
    # profiler's own table totals them).
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3
    head = (f"wall {wall * 1e3 / tokens:.3f} ms per token under the profiler; device busy "
            f"{busy / tokens:.3f} ms per token (kernels' self time)")
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=30)
    by_device = events.table(sort_by="self_device_time_total", row_limit=20) if device == "cuda" else ""
    return f"{head}\n\n{by_host}\n\n{by_device}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0,
                        help="also profile N decode tokens of each variant at the first batch size")
    parser.add_argument("--profile-variants", nargs="*", default=[], help="the variants to profile (default: all)")
    parser.add_argument("--variants", nargs="+",
                        default=["transformers dynamic", "transformers static", "transfuse eager", "transfuse compiled"])
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Both compiled variants compile the same transformers functions: give them room.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/bench_decode.py " + shlex.join(argv if argv is not None else sys.argv[1:])

    stock = build(args.model, device)
    fused = transfuse.decode_steps(transfuse.rewrite(copy.deepcopy(stock)))
    compiled_options = {
        "transfuse compiled": {},
        "transfuse compiled, Dynamo every step": {"replay": False},
        "transfuse compiled, transformers' loop": {"lean_loop": False},
        "transfuse compiled, module guards off": {"trust_modules": True},
        "transfuse compiled, module guards off, Dynamo every step": {"trust_modules": True, "replay": False},
        "transfuse compiled, replayed, every guard": {"replay": True},
        "transfuse compiled, graph per piece": {"kv_store": False},
    }
    models = {
        "transformers dynamic": (stock, {}),
        "transformers static": (stock, {"cache_implementation": "static"}),
        "transfuse eager": (fused, {"_env": {"TRANSFUSE_STEP_GRAPHS": "0"}}),
        "transfuse eager, step graphs": (fused, {"_env": {"TRANSFUSE_STEP_GRAPHS": "1"}}),
        "transfuse eager, no graphs": (fused, {"_env": {"TRANSFUSE_STEP_GRAPHS": "0", "TRANSFUSE_DECODE_GRAPHS": "0"}}),
    }
    for name, options in compiled_options.items():
        if name in args.variants or (name == "transfuse compiled" and f"{name}, streamed" in args.variants):
            models[name] = (transfuse.compile(transfuse.rewrite(copy.deepcopy(stock)), **options), {})
    for name in ("transformers dynamic", "transfuse eager", "transfuse eager, step graphs", "transfuse compiled"):
        if name in models:
            model, extra = models[name]
            models[f"{name}, streamed"] = (model, {**extra, "_streamed": True})
    variants = [v for v in args.variants if v in models]
    floor_ms = weight_bytes(stock) / copy_bandwidth(device) * 1e3  # batch 1
    vocab = stock.config.vocab_size
    result: dict = {"command": command, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "floor_ms": floor_ms, "batches": {}}
    first_call: dict[str, float] = {}
    for batch in args.batch:
        torch.manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, args.prompt), device=device)
        # (transformers' streamers take one row)
        running = [v for v in variants if batch == 1 or not v.endswith(", streamed")]
        if running != variants:
            print(f"batch {batch}: the streamed variants stream one row only, and are left out", flush=True)
        tokens, times = {}, {v: [] for v in running}
        for variant in running:  # first calls: compile and capture (for the compiled ones)
            model, extra = models[variant]
            seconds = timed(lambda: generate(model, ids, 2, **extra), device)
            first_call.setdefault(variant, seconds)
            tokens[variant] = generate(model, ids, args.new, **extra)
            print(f"batch {batch} {variant}: first calls {seconds:.1f} s", flush=True)
        for _ in range(args.rounds):
            for variant in running:
                model, extra = models[variant]
                short = timed(lambda: generate(model, ids, 1, **extra), device)
                full = timed(lambda: generate(model, ids, args.new, **extra), device)
                times[variant].append((full - short) / (args.new - 1) * 1e3)
        want = tokens.get("transfuse eager", next(iter(tokens.values())))
        rows = {}
        for variant in running:
            rows[variant] = {
                "ms_per_token": statistics.median(times[variant]),
                "min_ms_per_token": min(times[variant]),
                "all_ms": times[variant],
                "agreement_with_transfuse_eager": agreement(tokens[variant], want, args.prompt),
                "forced_agreement_with_transfuse_eager": forced_agreement(
                    models[variant][0], ids, want, args.new, **models[variant][1]
                ),
            }
            print(f"batch {batch} {variant}: {rows[variant]['ms_per_token']:.3f} ms/token", flush=True)
        result["batches"][str(batch)] = rows
    result["first_call_s"] = first_call
    if args.profile:
        ids = torch.randint(0, vocab, (args.batch[0], args.prompt), device=device)
        chosen = [v for v in variants if v in args.profile_variants or not args.profile_variants]
        for variant in [v for v in chosen if args.batch[0] == 1 or not v.endswith(", streamed")]:
            model, extra = models[variant]
            text = profile(lambda: generate(model, ids, args.profile, **extra), device, args.profile)
            name = variant.replace(",", "").replace(" ", "_")
            with open(os.path.join(args.out, f"profile_{args.model}_{name}.txt"), "w") as f:
                f.write(f"{command}\n{variant}, batch {args.batch[0]}, {args.profile} tokens\n\n{text}")
            print(f"profile {variant}: " + text.splitlines()[0], flush=True)
    if args.prefill:
        ids = torch.randint(0, vocab, (1, args.prefill), device=device)
        stock_compiled = torch.compile(stock)
        compiled = models.get("transfuse compiled", (None,))[0] or transfuse.compile(transfuse.rewrite(copy.deepcopy(stock)))
        prefill = {}
        for name, fn in (("transformers compiled", lambda: stock_compiled(ids, use_cache=False)),
                         ("transfuse compiled", lambda: compiled(ids, use_cache=False))):
            with torch.no_grad():
                first = timed(fn, device)
                fn()
                runs = [timed(fn, device) * 1e3 for _ in range(10)]
            prefill[name] = {"ms": statistics.median(runs), "first_call_s": first}
            print(f"prefill {args.prefill} {name}: {prefill[name]['ms']:.2f} ms (first call {first:.1f} s)", flush=True)
        result["prefill"] = prefill
    from transfuse.compile import backend

    result["backend_stats"] = backend.stats()
    # Whole-call replays (``transfuse/compile/replay.py``) and why a signature was not captured.
    result["call_graphs"] = {
        name: {"replays": graphs.replays, "refused": graphs.refused, "failed": graphs.failed}
        for name, (model, _) in models.items()
        if (graphs := getattr(getattr(model, "_transfuse_compiled", None), "call_graphs", None)) is not None
    }
    result["eager_steps"] = transfuse.compile.eager_steps.stats(fused)
    with open(os.path.join(args.out, f"decode_{args.model}.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Decode per token, {args.model} shapes ({result['device']}, torch {result['torch']})", "",
             f"`{command}`", "", f"Floor at batch 1 (weights one token reads / copy bandwidth): {floor_ms:.3f} ms", "",
             "| batch | variant | ms per token (median of rounds) | fastest round | tokens equal to transfuse eager "
             "(before the first difference) | greedy choice equal, its tokens fed back | first calls (s) |",
             "|---|---|---|---|---|---|---|"]
    for batch, rows in result["batches"].items():
        for variant, row in rows.items():
            lines.append(f"| {batch} | {variant} | {row['ms_per_token']:.3f} | {row['min_ms_per_token']:.3f} | "
                         f"{row['agreement_with_transfuse_eager']:.3f} | {row['forced_agreement_with_transfuse_eager']:.3f} | "
                         f"{first_call.get(variant, float('nan')):.1f} |")
    if args.prefill:
        lines += ["", f"Prefill of {args.prefill} tokens (no cache): "
                  + "; ".join(f"{k} {v['ms']:.2f} ms (first call {v['first_call_s']:.1f} s)" for k, v in result["prefill"].items())]
    lines += ["", f"Backend counters: {result['backend_stats']}", "", f"Whole-call replays: {result['call_graphs']}",
              "", f"Eager steps (transfuse eager's generate loops with step graphs): {result['eager_steps']}"]
    with open(os.path.join(args.out, f"decode_{args.model}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
