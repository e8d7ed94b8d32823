"""Which part of ``transfuse.compile`` makes a batch-invariant model's compiled decoding depend on
the batch: the compiled path with each of its parts turned off in turn, against the eager path.

    python benchmarks/invariant_compiled_probe.py --out DIR [--layers 2] [--new 16] [--batch 7]
    python benchmarks/invariant_compiled_probe.py --tiny --out DIR     # on a CPU, tiny shapes

A model of Llama-3-8B layer shapes (``--layers`` layers, bf16 random weights) in batch-invariant
mode decodes ``--prompts`` random prompts ``--new`` greedy tokens alone and inside a left-padded
batch of ``--batch`` other prompts, once eagerly and once compiled per variant of
``transfuse.compile``'s options (``VARIANTS``). Per variant: the fraction of decode steps whose
logits are bit-identical alone and in the batch, the first such step that differs, and the steps
equal to the eager path's (the prompts alone). A variant that fails reports its error. Writes
DIR/invariant_compiled_probe.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transfuse  # noqa: E402
from bench_batch_invariant import decode_logits, random_prompts  # noqa: E402
from bench_decode import build  # noqa: E402

# name -> transfuse.compile's options (batch_invariant=True in every one)
VARIANTS = {
    "default": {},
    "no whole-call replay": {"replay": False},
    "no kv store": {"kv_store": False},
    "kv store on any device": {"kv_store": True},
    "no CUDA graphs": {"cuda_graphs": False},
    "no Inductor": {"inductor": False},
    "no Inductor, no CUDA graphs": {"inductor": False, "cuda_graphs": False},
}


def alone_and_batched(model, targets, others, size: int, new: int):
    alone = torch.stack([decode_logits(model, [t], new)[0] for t in targets])
    batched = []
    for i, target in enumerate(targets):
        company = [others[(i * size + j) % len(others)] for j in range(size - 1)]
        at = (3 * i + 1) % size
        batched.append(decode_logits(model, company[:at] + [target] + company[at:], new)[at])
    return alone, torch.stack(batched)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    same = (a == b).all(-1)  # [prompts, steps]
    first = [int((~row).nonzero()[0]) if (~row).any() else None for row in same]
    return {"identical_steps": same.float().mean().item(), "first_difference": first,
            "max_abs_diff": (a.float() - b.float()).abs().max().item()}  # fmt: skip


_SEEN: dict = {"settings": [], "operators": {}}


def _explain() -> None:
    """Record what the compile backend gives Inductor: its settings and each piece's operators."""
    import torch._inductor.compile_fx as inductor

    from transfuse.compile import backend

    settings, compile_fx = backend._inductor_settings, inductor.compile_fx

    def seen_settings():
        found = settings()
        _SEEN["settings"].append(found)
        return found

    def seen_compile(piece, inputs, *rest, **kwargs):
        for node in piece.graph.nodes:
            if node.op == "call_function":
                name = str(node.target)
                _SEEN["operators"][name] = _SEEN["operators"].get(name, 0) + 1
        return compile_fx(piece, inputs, *rest, **kwargs)

    backend._inductor_settings = seen_settings
    inductor.compile_fx = seen_compile
    import torch._inductor.config as config

    _SEEN["config"] = {name: getattr(config, name, "absent") for name in ("emulate_precision_casts", "split_reductions", "batch_invariant")}
    print("inductor config before:", _SEEN["config"], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--batch", type=int, default=7)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--explain", action="store_true",
        help="also record, per variant, the Inductor settings the backend applied and the operators of the "
             "pieces Inductor compiled (reductions, transfuse's library ops): the json's 'explained'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.explain:
        _explain()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    stock = build("tiny" if args.tiny else "llama", device, num_hidden_layers=args.layers)
    vocab = stock.config.vocab_size
    lengths = (3, 9) if args.tiny else (16, 120)
    targets = random_prompts(args.prompts, vocab, lengths, device, seed=1)
    others = random_prompts(2 * args.batch, vocab, lengths, device, seed=2)

    eager = transfuse.rewrite(copy.deepcopy(stock), batch_invariant=True)
    eager_alone, eager_batched = alone_and_batched(eager, targets, others, args.batch, args.new)
    rows = [{"variant": "eager", "options": {}, "batch": compare(eager_alone, eager_batched), "vs eager": None}]
    print(rows[-1], flush=True)
    del eager
    for name in args.variants:
        options = VARIANTS[name]
        start = time.perf_counter()
        try:
            model = transfuse.rewrite(copy.deepcopy(stock), batch_invariant=True)
            transfuse.compile(model, batch_invariant=True, cache_dir=False, **options)
            alone, batched = alone_and_batched(model, targets, others, args.batch, args.new)
            row = {"variant": name, "options": options, "batch": compare(alone, batched),
                   "vs eager": compare(alone, eager_alone)}  # fmt: skip
        except Exception as e:  # a variant that cannot run says why, and the others still run
            row = {"variant": name, "options": options, "error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - start, 1)
        if args.explain:
            row["explained"] = {"settings": [dict(x) for x in _SEEN["settings"]], "operators": dict(_SEEN["operators"])}
            _SEEN["settings"].clear()
            _SEEN["operators"].clear()
        rows.append(row)
        print(row, flush=True)
        model = None
        gc.collect()
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "invariant_compiled_probe.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "rows": rows}, f, indent=1)  # fmt: skip
    lines = [f"Command: `python benchmarks/invariant_compiled_probe.py {' '.join(sys.argv[1:])}`", "",
             "| variant | options | steps bit-identical alone / batch | first difference | largest | steps equal to eager |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['options']} | error: {row['error']} | | | |")
            continue
        b, e = row["batch"], row["vs eager"]
        lines.append(f"| {row['variant']} | {row['options']} | {b['identical_steps']:.1%} | {b['first_difference']} "
                     f"| {b['max_abs_diff']:.3g} | {'-' if e is None else format(e['identical_steps'], '.1%')} |")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "invariant_compiled_probe.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
