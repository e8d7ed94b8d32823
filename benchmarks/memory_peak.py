"""What is alive on the GPU at the peak of one training step, by where it was allocated.

    python benchmarks/memory_peak.py --variant transfuse-lce --model llama [--rows 25]

Builds the variant as ``bench_train.py`` does (same shapes, same seed; one variant per process,
since Liger patches transformers' classes), runs two warm-up steps, then records the caching
allocator's history over one forward + backward and replays it: at the step's highest allocated
total, every live block is attributed to the innermost Python frame in transfuse, transformers,
PEFT or Liger code that allocated it (blocks allocated by the autograd engine's thread have no
Python frame: they are listed by phase, "backward"). Blocks alive before the step (weights,
the optimizer's state) are one line. Prints a table, largest first.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

_OURS = ("transfuse/", "transformers/", "peft/", "liger_kernel/")


def _site(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in _OURS) and "/torch/" not in name:
            short = name[max(name.find(part) for part in _OURS if part in name) :]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "backward (no Python frame)" if not frames else "torch: " + frames[0].get("name", "?")


def peak_table(step, device: int = 0) -> tuple[int, list[tuple[str, int]]]:
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][device]
    current = best = 0
    best_index = -1
    live: dict[int, int] = {}
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])
        else:
            continue
        if current > best:
            best, best_index = current, i
    alive: dict[int, dict] = {}
    for event in events[: best_index + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_requested":
            alive.pop(event["addr"], None)
    sites: dict[str, int] = defaultdict(int)
    sites["before the step (weights, gradients kept, optimizer state)"] = before
    for event in alive.values():
        sites[_site(event.get("frames", []))] += event["size"]
    return before + best, sorted(sites.items(), key=lambda kv: -kv[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", required=True)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    model, _, ids, _ = bench_train._build(args.variant, args.model, False, "cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    peak, sites = peak_table(step)
    print(f"`python benchmarks/memory_peak.py --variant {args.variant} --model {args.model}`\n")
    print(f"{args.variant} ({args.model}): peak {peak / 2**30:.2f} GiB allocated\n")
    print("| allocated at | GiB |\n| --- | ---: |")
    for site, size in sites[: args.rows]:
        print(f"| `{site}` | {size / 2**30:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
