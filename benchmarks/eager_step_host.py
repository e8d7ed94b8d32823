"""Eager decode step time of a tiny model, with each default fusion kind left out in turn.

    python benchmarks/eager_step_host.py [--model llama] [--layers 8] [--device cpu] [--rounds 3]

A tiny model (``transfuse.tiny``: hidden 64) does almost no arithmetic, so its eager decode step
(one token through a ``DynamicCache``) is the host's work: the model's Python, each op's dispatch,
each kernel's launch. That is the cost a host-bound eager decode pays per token whatever the model
size. Variants: stock, the default rewrite, and the default rewrite less one kind for each kind,
taking turns ``--rounds`` times in one process; the median step of each round is printed (the
first steps of each prompt dropped). One thread on the CPU, so that the numbers are the host's own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transfuse  # noqa: E402
from transfuse.fusers import default_kinds  # noqa: E402
from transfuse.tiny import tiny_model  # noqa: E402


def step_us(model, device: str, prompts: int = 6, steps: int = 60) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    with torch.no_grad():
        for _ in range(prompts):
            cache = model(ids, use_cache=True).past_key_values
            token = ids[:, -1:]
            for i in range(steps):
                sync()
                start = time.perf_counter()
                model(token, past_key_values=cache, use_cache=True)
                sync()
                if i >= 5:  # the prompt's first steps warm caches
                    times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    kinds = default_kinds()
    variants = {"stock": False, "default rewrite": None}
    for kind in kinds:
        rest = [k for k in kinds if k != kind]
        if "rms_norm" not in rest and "add_rms_norm" in rest:  # add_rms_norm builds on rms_norm
            rest.remove("add_rms_norm")
        variants[f"without {kind}"] = rest
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, fusions in variants.items():
            model = tiny_model(args.model, num_hidden_layers=args.layers).to(args.device).eval()
            if fusions is not False:
                transfuse.rewrite(model, fusions=fusions)
            results.setdefault(name, []).append(step_us(model, args.device))
    print(f"`python benchmarks/eager_step_host.py --model {args.model} --layers {args.layers} --device {args.device} "
          f"--rounds {args.rounds}` (torch {torch.__version__})\n")
    print("| variant | median step, us (each round) |\n|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.0f} ({', '.join(f'{v:.0f}' for v in values)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
