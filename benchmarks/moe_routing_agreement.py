"""Where a fused MoE model's bf16 output departs from the original's: routing or arithmetic?

For each MoE block of a tiny random model (bf16, on the GPU), the original block's input is
recorded; the original router's choice of experts is compared with transfuse's ``moe_route``
on the same router logits, and for every token whose chosen set differs the gap between the
k-th and (k+1)-th routing probability is printed. A set that differs only where that gap is
below bf16's resolution is a tie broken the other way, not a wrong routing; the block's
output is then compared on the tokens whose routing agrees.

    python benchmarks/moe_routing_agreement.py [--model mixtral]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transfuse  # noqa: E402
from transfuse.ops import MoE  # noqa: E402
from transfuse.tiny import tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mixtral")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    original = tiny_model(args.model, dtype=torch.bfloat16).to(device)
    fused = tiny_model(args.model, dtype=torch.bfloat16).to(device)
    transfuse.rewrite(fused, fusions=["moe"])
    ids = torch.randint(0, original.config.vocab_size, (2, 33), device=device, generator=None)

    inputs: dict[str, torch.Tensor] = {}
    paths = [p for p, m in fused.named_modules() if isinstance(m, MoE)]
    hooks = [
        original.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: inputs.__setitem__(p, a[0].detach()))
        for p in paths
    ]
    with torch.no_grad():
        logits_original = original(input_ids=ids).logits.float()
        logits_fused = fused(input_ids=ids).logits.float()
    for h in hooks:
        h.remove()
    scale = logits_original.abs().max()
    print(f"{args.model}: logits differ by {((logits_fused - logits_original).abs().max() / scale).item():.4f} of scale")

    for path in paths:
        layer = fused.get_submodule(path)
        hidden = inputs[path]
        tokens = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            logits, _, chosen = layer._route(hidden, tokens)
            k = chosen.shape[-1]
            probs = torch.softmax(logits.float(), dim=-1)
            top = probs.topk(k + 1, dim=-1).values
            reference = probs.topk(k, dim=-1).indices.sort(-1).values
        differ = (chosen.sort(-1).values != reference).any(-1)
        gaps = (top[:, k - 1] - top[:, k])[differ]
        print(f"  {path}: {int(differ.sum())} of {len(differ)} tokens routed differently from softmax-then-top-k "
              f"on the same logits; probability gap k-th to (k+1)-th there: {[round(g, 6) for g in gaps.tolist()]}; "
              f"smallest gap anywhere: {(top[:, k - 1] - top[:, k]).min().item():.6f}")

if __name__ == "__main__":
    main()
