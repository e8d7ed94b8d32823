"""Where an eager decode step spends the host's time, batch-invariant mode against the default mode.

    python benchmarks/profile_invariant_host.py --out DIR [--model llama] [--steps 16] [--tiny]
    python benchmarks/profile_invariant_host.py --out DIR --model qwen3_moe --first-steps

A model of ``bench_decode.SHAPES`` (random bf16 weights), rewritten in each mode; a prompt of 64
tokens decoded greedily through ``generate`` (the model's own forward and cache, no step graphs):
ms a decode step (a ``--steps``-token ``generate`` less a 1-token one, the device synchronised),
the torch calls the mode intercepts a step, and, under cProfile, the functions with the most time
of their own over a ``--steps``-token ``generate``. Writes DIR/invariant_host.md.

``--first-steps``: the step-graph path instead (``transfuse.decode_steps``), where a ``generate``
runs its first decode step eagerly through the store, captures the second and replays the rest:
the time of ``generate`` for 1-4 and 8 new tokens (medians of 5), so the marginal cost of the
first step, of the capture and of a replay, and under cProfile the host's functions over a
3-token ``generate`` (the prompt, the eager step, the capture). Writes DIR/invariant_first_steps.md.
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


def generate(model, ids: torch.Tensor, tokens: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    sync(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama", choices=["llama", "qwen3_moe"])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--first-steps", action="store_true")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    stock = build(args.model, device, args.tiny)
    if args.first_steps:
        return first_steps(stock, args, device, argv)
    lines = _heading(f"Eager decode step on the host, {args.model}", device, argv)
    for mode in ("default", "invariant"):
        model = prepared(stock, mode, "eager")
        ids = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        generate(model, ids, args.steps, device)  # warm-up
        per_step = (generate(model, ids, args.steps + 1, device) - generate(model, ids, 1, device)) / args.steps * 1e3
        calls = [0]
        original = bi.InvariantFunctions.__torch_function__

        def counted(self, *a, **k):
            calls[0] += 1
            return original(self, *a, **k)

        bi.InvariantFunctions.__torch_function__ = counted
        try:
            generate(model, ids, args.steps + 1, device)
        finally:
            bi.InvariantFunctions.__torch_function__ = original
        calls[0] //= args.steps + 1  # the prompt's forward counted as a step
        profile = cProfile.Profile()
        profile.enable()
        generate(model, ids, args.steps, device)
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


def _heading(title: str, device: str, argv) -> list[str]:
    """The results file's title (with the device) and the command that wrote it."""
    command = " ".join(sys.argv[1:] if argv is None else argv)
    return [f"# {title} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'})", "",
            f"`python benchmarks/{os.path.basename(__file__)} {command}`", ""]  # fmt: skip


def first_steps(stock, args, device: str, argv) -> int:
    import statistics

    from transfuse.compile import eager_steps

    lines = _heading(f"The step-graph path's first steps, {args.model}", device, argv)
    lines += ["| mode | generate(1) ms | +1st step (eager, store) | +2nd (capture) | +3rd (replay) | 8 tokens: a later step | replays |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    profiles = []
    for mode in ("default", "invariant"):
        model = prepared(stock, mode, "steps")
        ids = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        generate(model, ids, 16, device)  # warm-up
        ms = {n: 1e3 * statistics.median(generate(model, ids, n, device) for _ in range(5)) for n in (1, 2, 3, 4, 8)}
        replays = eager_steps.stats(model).get("replays")
        lines.append(
            f"| {mode} | {ms[1]:.2f} | {ms[2] - ms[1]:.2f} | {ms[3] - ms[2]:.2f} | {ms[4] - ms[3]:.2f} | "
            f"{(ms[8] - ms[4]) / 4:.3f} | {replays} |"
        )  # fmt: skip
        print(lines[-1], flush=True)
        profile = cProfile.Profile()
        profile.enable()
        generate(model, ids, 3, device)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        profiles += [f"## {mode}: a 3-token generate under cProfile", "", "```", text.getvalue().strip(), "```", ""]
        del model
    lines += [""] + profiles
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "invariant_first_steps.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
