"""Host time of the eager decode path's admission, made at the start of every ``generate`` loop.

    python benchmarks/eager_steps_admission.py [--layers 8 80] [--calls 20] [--rounds 5]

``transfuse/compile/eager_steps.py`` decides at each closed loop's start whether the loop's steps
may run as graphs (``_admission``): the module tree walked for hooks, the configs found, the
weights' devices read. On a CPU the answer is a refusal at its last check (the weights are not on
CUDA), so everything is walked, as on a GPU. A tiny Llama (``transfuse.tiny``) of each depth,
rewritten; the median over rounds of the mean of ``--calls`` calls, one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transfuse  # noqa: E402
from transfuse.compile import eager_steps  # noqa: E402
from transfuse.tiny import tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 80])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ[eager_steps.ENV] = "1"
    for layers in args.layers:
        model = transfuse.decode_steps(transfuse.rewrite(tiny_model("llama", num_hidden_layers=layers).eval()))
        modules = sum(1 for _ in model.modules())
        rounds = []
        with torch.no_grad():
            eager_steps._admission(model)
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    eager_steps._admission(model)
                rounds.append((time.perf_counter() - start) / args.calls * 1e6)
            why = eager_steps.refusal(model)
        print(f"{layers} layers ({modules} modules): {statistics.median(rounds):.0f} us an admission ({why!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
