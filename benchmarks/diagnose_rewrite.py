"""Where a rewrite of a large model spends its time: stacks of every thread every ``--every`` seconds.

    python benchmarks/diagnose_rewrite.py --model llama --every 40
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_train import _config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama")
    parser.add_argument("--every", type=float, default=40)
    parser.add_argument("--fusions", nargs="*", default=None)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.every, repeat=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoModelForCausalLM

    import transfuse

    config, _, _, _ = _config(args.model, False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    start = time.perf_counter()
    transfuse.rewrite(model, fusions=args.fusions)
    print(f"rewrite {time.perf_counter() - start:.1f} s", transfuse.report(model).counts(), flush=True)
    print(transfuse.report(model))


if __name__ == "__main__":
    main()
