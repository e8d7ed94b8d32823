"""Top-k routing on tied bfloat16 logits: torch's top-k against the Triton router, and the verdict
of the router's conformance check.

    python benchmarks/route_ties.py                # a GPU (or the CPU, Triton interpreted)
    python benchmarks/route_ties.py --experts 128 --top-k 8 --tokens 32 2048

Router logits in bfloat16 tie often. For each token count, random logits (normal, scale 2, as the
check draws them) are routed by ``torch.topk`` (the native definition) and by the Triton kernel;
the rows are counted where the two choose other experts, where they choose the same experts in
another order, and where they agree slot for slot. Then the op is called through dispatch, which
checks the Triton provider at that configuration, and its verdict is printed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 2048])
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from transfuse import ops
    from transfuse.ops import RoutingSpec, get_op
    from transfuse.ops.moe import moe_route, moe_route_native
    from transfuse.ops.triton import moe as triton_moe

    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for tokens in args.tokens:
        generator = torch.Generator(device).manual_seed(tokens)
        logits = (torch.randn(tokens, args.experts, device=device, generator=generator) * 2).to(torch.bfloat16)
        call = (logits, None, args.top_k, "softmax", True, False, 1, 1, True, None, None, None, None)
        _, native = moe_route_native(*call)
        _, kernel = triton_moe.moe_route(*call)
        same_slots = (native == kernel).all(-1)
        same_set = (native.sort(-1).values == kernel.sort(-1).values).all(-1)
        kth = logits.float().topk(args.top_k, -1).values[:, -1:]
        boundary_ties = ((logits.float() == kth).sum(-1) > (logits.float().topk(args.top_k, -1).values == kth).sum(-1))
        print(f"{tokens} tokens: rows with a tie at the k-th place {int(boundary_ties.sum())}; "
              f"other experts chosen {int((~same_set).sum())}; the same experts in another order "
              f"{int((same_set & ~same_slots).sum())}; slot for slot {int(same_slots.sum())}")
        with ops.trace() as calls:
            moe_route(logits, args.top_k, RoutingSpec("softmax"))
        verdicts = [v for found in get_op("moe_route")._verdicts.values() for v in found.values()]
        print(f"  dispatched to {[c.provider for c in calls]}; verdicts: "
              + "; ".join(f"{v.provider}: {'passed' if v.passed else v.reason}" for v in verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
