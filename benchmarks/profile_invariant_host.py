"""Where an eager decode step spends the host's time, batch-invariant mode against the default mode.

    python benchmarks/profile_invariant_host.py --out DIR [--model llama] [--steps 16] [--tiny]

A model of ``bench_decode.SHAPES`` (random bf16 weights), rewritten in each mode; a prompt of 64
tokens, then ``--steps`` eager decode steps of one token (the model's own forward and cache, no
step graphs), timed with the device synchronised, then the same steps under cProfile. Writes
DIR/invariant_host.md: ms a step in each mode, the mode's intercepted torch calls a step, and the
functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_batch_invariant import build, prepared, sync  # noqa: E402
from transfuse.ops import batch_invariant as bi  # noqa: E402


def steps(model, device: str, count: int):
    ids = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)

        def step():
            nonlocal token
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        yield step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama", choices=["llama", "qwen3_moe"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    stock = build(args.model, device, args.tiny)
    lines = [f"# Eager decode step on the host, {args.model} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'})", ""]
    lines += ["`python benchmarks/" + os.path.basename(__file__) + " " + " ".join(sys.argv[1:] if argv is None else argv) + "`", ""]
    for mode in ("default", "invariant"):
        model = prepared(stock, mode, "eager")
        for step in steps(model, device, args.steps):
            for _ in range(3):
                step()
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(device)
            per_step = (time.perf_counter() - start) / args.steps * 1e3
            calls = [0]
            original = bi.InvariantFunctions.__torch_function__

            def counted(self, *a, **k):
                calls[0] += 1
                return original(self, *a, **k)

            bi.InvariantFunctions.__torch_function__ = counted
            try:
                step()
            finally:
                bi.InvariantFunctions.__torch_function__ = original
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.steps):
                step()
            sync(device)
            profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        lines += [f"## {mode}: {per_step:.2f} ms a step; {calls[0]} torch calls through the mode a step", ""]
        lines += ["```", text.getvalue().strip(), "```", ""]
        print(lines[-4], flush=True)
        del model
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "invariant_host.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
