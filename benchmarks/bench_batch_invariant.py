"""Batch-invariant mode against the default mode: are a request's logits the same bits whatever else is batched with it, and what does that cost.

    python benchmarks/bench_batch_invariant.py --out DIR [--model llama qwen3_moe] [--paths eager steps compiled]
        [--prompts 8] [--batches 7 32] [--new 128] [--prefill 2048] [--rounds 3]
    python benchmarks/bench_batch_invariant.py --tiny --out DIR        # a dry run on a CPU, tiny shapes

Models of Llama-3-8B layer shapes (8 layers) and Qwen3-MoE shapes (4 layers), random bf16 weights
(``bench_decode.SHAPES``). For each mode (default, batch-invariant) and path (eager: a plain
rewrite; steps: ``transfuse.decode_steps``, whose decode steps are CUDA graphs of the eager forward;
compiled: ``transfuse.compile``), each of ``--prompts`` random prompts of random length is decoded
``--new`` greedy tokens alone (batch 1) and inside batches of each ``--batches`` size among other
random prompts of other lengths, left-padded, at a random place. Per path the report counts, per
prompt, the decode steps whose logits are bit-identical in every batch (and the steps before the
first difference), and compares the paths' logits of the prompts alone (bit-identical steps, the
largest difference). A training-mode forward (dropout off) gives each sample's loss alone and in
a batch. Cost: decode time per token at batch 1 and the largest batch (the time of ``--new``
tokens less the time of one, over ``--new - 1``; and "steady", the time of ``--new`` tokens less
that of half as many, which leaves out a loop's first steps, run eagerly and captured by the step
graphs; medians of ``--rounds``), and a forward over
``--prefill`` tokens, each mode side by side in the same run. Each model and mode runs in a fresh
process of its own (``--same-process``: all in this one), so that the graphs and captures one mode
compiled do not hold the device's memory while the next runs. Writes DIR/batch_invariant.md
and .json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transfuse  # noqa: E402
from bench_decode import SHAPES  # noqa: E402
from transfuse.ops import batch_invariant as bi  # noqa: E402

TINY_SHAPES = {
    "llama": SHAPES["tiny"],
    "qwen3_moe": (
        "qwen3_moe",
        dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_hidden_layers=2),
    ),
}  # fmt: skip
MODES = ("default", "invariant")


def build(name: str, device: str, tiny: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, shape = (TINY_SHAPES if tiny else SHAPES)[name]
    config = AutoConfig.for_model(model_type, **shape)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def prepared(stock, mode: str, path: str):
    """A copy of ``stock`` rewritten in ``mode`` and set up for ``path``."""
    model = copy.deepcopy(stock)
    invariant = mode == "invariant"
    transfuse.rewrite(model, batch_invariant=invariant)
    if path == "steps":
        transfuse.decode_steps(model)
    elif path == "compiled":
        transfuse.compile(model, batch_invariant=invariant)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def left_padded(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[0] :] = p
        mask[i, width - p.shape[0] :] = 1
    return ids, mask


def decode_logits(model, prompts: list[torch.Tensor], new: int) -> torch.Tensor:
    """Greedy decoding of the left-padded batch: the logits of every step, ``[batch, new, vocab]``."""
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return torch.stack(out.logits, dim=1)


def random_prompts(count: int, vocab: int, lengths: tuple[int, int], device: str, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).to(device) for n in sizes]


def contexts(model, targets, others, batches, new: int, seed: int) -> dict[str, torch.Tensor]:
    """Each target's logits ``[new, vocab]`` alone and in each batch size (among others, at a random place)."""
    g = torch.Generator().manual_seed(seed)
    found: dict[str, list[torch.Tensor]] = {"alone": [decode_logits(model, [t], new)[0] for t in targets]}
    for size in batches:
        rows = []
        for i, target in enumerate(targets):
            company = [others[(i * size + j) % len(others)] for j in range(size - 1)]
            at = int(torch.randint(0, size, (1,), generator=g))
            batch = company[:at] + [target] + company[at:]
            rows.append(decode_logits(model, batch, new)[at])
        found[f"batch {size}"] = rows
    return {name: torch.stack(rows) for name, rows in found.items()}


def identical_steps(runs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Over the targets: the fraction of steps whose logits are bit-identical in every context, and
    of steps before the first difference."""
    alone = runs["alone"]
    same = torch.ones(alone.shape[:2], dtype=torch.bool, device=alone.device)
    for name, got in runs.items():
        same &= (got == alone).all(-1)
    prefix = same.int().cumprod(-1).sum(-1).float()
    worst = max(((got.float() - alone.float()).abs().max().item() for got in runs.values()), default=0.0)
    return {
        "identical_steps": same.float().mean().item(),
        "identical_prefix": (prefix / alone.shape[1]).mean().item(),
        "max_abs_diff": worst,
    }


def across_paths(alone: dict[str, torch.Tensor]) -> list[dict]:
    names = list(alone)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            x, y = alone[a], alone[b]
            rows.append({
                "paths": f"{a} / {b}",
                "identical_steps": (x == y).all(-1).float().mean().item(),
                "max_abs_diff": (x.float() - y.float()).abs().max().item(),
            })  # fmt: skip
    return rows


def training_losses(model, vocab: int, device: str, length: int, invariant: bool) -> dict:
    """Each sample's loss in a training-mode forward (dropout off) alone and in a batch of 4."""
    g = torch.Generator().manual_seed(5)
    batch = torch.randint(1, vocab, (4, length), generator=g).to(device)
    model.train()
    try:

        def losses(ids):
            logits = model(ids).logits
            ctx = bi.InvariantFunctions() if invariant else _nothing()
            with ctx:
                per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:], reduction="none")
                return per_token.mean(-1).detach()

        together = losses(batch)
        alone = torch.stack([losses(batch[i : i + 1])[0] for i in range(batch.shape[0])])
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    return {"identical_samples": (alone == together).float().mean().item(),
            "max_abs_diff": (alone - together).abs().max().item()}  # fmt: skip


def _mode_lines(model) -> str:
    """The report's batch-invariant section (what the mode says it cannot make invariant)."""
    text = str(transfuse.report(model))
    section = text.split("batch-invariant mode:", 1)[-1].split("\n\n", 1)[0]
    return "batch-invariant mode:" + section


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def per_token(model, prompt: torch.Tensor, batch: int, new: int, rounds: int, device: str) -> tuple[float, float]:
    """Seconds a decode token: (over a whole ``generate``, the time of ``new`` tokens less that of
    one, over ``new - 1``; between two lengths, the time of ``new`` tokens less that of ``new // 2``,
    over the difference). The step-graph path runs a loop's first step eagerly and captures the
    second: the first figure spreads that over the loop's tokens, the second leaves it out (both
    lengths hold it). Medians of ``rounds``."""
    ids = prompt[None].repeat(batch, 1)
    mask = torch.ones_like(ids)

    def run(tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        sync(device)
        return time.perf_counter() - start

    run(new)  # warm-up (compilation, captures)
    half = max(2, new // 2)
    whole, steady = [], []
    for _ in range(rounds):
        one, middle, full = run(1), run(half), run(new)
        whole.append((full - one) / (new - 1))
        steady.append((full - middle) / max(1, new - half))
    return statistics.median(whole), statistics.median(steady)


def prefill(model, vocab: int, tokens: int, rounds: int, device: str) -> float:
    ids = torch.randint(1, vocab, (1, tokens), device=device)
    times = []
    for _ in range(rounds + 1):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(ids)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_model(name: str, args, device: str) -> dict:
    stock = build(name, device, args.tiny)
    vocab = stock.config.vocab_size
    lengths = (args.min_prompt, args.max_prompt)
    targets = random_prompts(args.prompts, vocab, lengths, device, seed=1)
    others = random_prompts(max(args.batches) * 2, vocab, lengths, device, seed=2)
    result: dict = {"model": name, "modes": {}}
    for mode in args.modes:
        per_mode: dict = {"paths": {}, "cost": {}}
        alone: dict[str, torch.Tensor] = {}
        for path in args.paths:
            model = prepared(stock, mode, path)
            start = time.perf_counter()
            runs = contexts(model, targets, others, args.batches, args.new, seed=3)
            stats = identical_steps(runs)
            stats["seconds"] = time.perf_counter() - start
            alone[path] = runs["alone"]
            if path == "eager":
                stats["training"] = training_losses(model, vocab, device, args.train_length, mode == "invariant")
                per_mode["report"] = _mode_lines(model) if mode == "invariant" else ""
            cost = {}
            for batch in (1, max(args.batches)):
                whole, steady = per_token(model, targets[0], batch, args.new, args.rounds, device)
                cost[f"decode ms/token, batch {batch}"] = 1e3 * whole
                cost[f"steady ms/token, batch {batch}"] = 1e3 * steady
            if path in ("eager", "compiled") and args.prefill:
                cost[f"prefill {args.prefill} ms"] = 1e3 * prefill(model, vocab, args.prefill, args.rounds, device)
            per_mode["paths"][path] = stats
            per_mode["cost"][path] = cost
            print(f"{name} {mode} {path}: {stats} {cost}", flush=True)
            del model
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        per_mode["across_paths"] = across_paths(alone)
        result["modes"][mode] = per_mode
    return result


def in_children(name: str, args, argv: list[str]) -> dict:
    """``run_model`` for each mode in a fresh process of its own (the same arguments otherwise)."""
    import subprocess
    import tempfile

    kept, skip = [], False
    for arg in argv:  # drop the options each child is given anew
        if arg in ("--model", "--modes", "--out"):
            skip = True
            continue
        if skip and arg.startswith("--"):
            skip = False
        if not skip:
            kept.append(arg)
    result: dict = {"model": name, "modes": {}}
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, os.path.abspath(__file__), *kept, "--model", name, "--modes", mode, "--out", out]
            subprocess.run(command, check=True)
            with open(os.path.join(out, "batch_invariant.json")) as f:
                result["modes"].update(json.load(f)["results"][0]["modes"])
    return result


def markdown(results: list[dict], args, device: str) -> str:
    lines = [
        "# Batch-invariant mode against the default mode",
        "",
        f"Command: `python benchmarks/bench_batch_invariant.py {shlex.join(sys.argv[1:])}`",
        f"Device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"{args.prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.new} greedy tokens, "
        f"alone and in batches of {', '.join(map(str, args.batches))} (left-padded), bf16 random weights.",
        "",
    ]
    for result in results:
        lines += [f"## {result['model']}", "", "| mode | path | steps bit-identical in every batch | before first difference "
                  "| largest difference | training losses bit-identical | " + " | ".join(_cost_names(result)) + " |"]
        lines.append("|" + " --- |" * (6 + len(_cost_names(result))))
        for mode, per_mode in result["modes"].items():
            for path, stats in per_mode["paths"].items():
                cost = per_mode["cost"][path]
                train = stats.get("training", {}).get("identical_samples")
                cells = [mode, path, f"{stats['identical_steps']:.1%}", f"{stats['identical_prefix']:.1%}",
                         f"{stats['max_abs_diff']:.3g}", "-" if train is None else f"{train:.0%}"]
                cells += [f"{cost[c]:.2f}" if c in cost else "-" for c in _cost_names(result)]
                lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Across paths (the prompts alone):", "", "| mode | paths | steps bit-identical | largest difference |",
                  "| --- | --- | --- | --- |"]
        for mode, per_mode in result["modes"].items():
            for row in per_mode["across_paths"]:
                lines.append(f"| {mode} | {row['paths']} | {row['identical_steps']:.1%} | {row['max_abs_diff']:.3g} |")
        report = result["modes"].get("invariant", {}).get("report")
        if report:
            lines += ["", "The invariant model's report: " + report.replace("\n", "; ")]
        lines.append("")
    return "\n".join(lines)


def _cost_names(result: dict) -> list[str]:
    names: list[str] = []
    for per_mode in result["modes"].values():
        for cost in per_mode["cost"].values():
            names += [c for c in cost if c not in names]
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", nargs="+", default=["llama", "qwen3_moe"], choices=["llama", "qwen3_moe"])
    parser.add_argument("--paths", nargs="+", default=None, choices=["eager", "steps", "compiled"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[7, 32])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--train-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on a CPU, few tokens: a dry run")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--same-process", action="store_true",
        help="run every model and mode in this process (default: each model and mode in a fresh process, so that "
             "one mode's compiled graphs and captures do not hold memory while the next runs)",
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.prompts, args.batches, args.new = min(args.prompts, 2), [3, 5], min(args.new, 5)
        args.min_prompt, args.max_prompt, args.prefill, args.train_length, args.rounds = 3, 9, 32, 8, 1
        # (compiling in the mode on a CPU takes minutes: ask for it with --paths)
        args.paths = args.paths or ["eager", "steps"]
    args.paths = args.paths or ["eager", "steps", "compiled"]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    os.makedirs(args.out, exist_ok=True)
    if args.same_process or len(args.model) * len(args.modes) == 1:
        results = [run_model(name, args, device) for name in args.model]
    else:
        results = [in_children(name, args, argv if argv is not None else sys.argv[1:]) for name in args.model]
    with open(os.path.join(args.out, "batch_invariant.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "results": results}, f, indent=1)
    text = markdown(results, args, device)
    with open(os.path.join(args.out, "batch_invariant.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
