"""Does a bf16 logit difference come from a token routed to other experts? A tiny model of one type,
rewritten, run twice in bf16: with every op native, then with one op's Triton provider; the expert
ids each MoE layer chose are compared token by token, and the logits' difference is given per token.

    python benchmarks/routing_flips.py --type minimax_m3_vl_text            # CPU: Triton interpreted
    python benchmarks/routing_flips.py --type minimax_m3_vl_text --device cuda

A near-tie between two experts' scores breaks either way under any change of rounding (the
interpreter rounds float32 to bf16 toward zero; a GPU kernel adds in another order), and the token
it falls on then differs by far more than bf16 noise while every other token agrees.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--op", default="moe_experts", help="the op whose Triton provider is compared with native")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    import transfuse
    import transfuse.ops.moe_layer as moe_layer
    from transfuse import ops
    from transfuse.tiny import tiny_model

    model = tiny_model(args.type).to(args.device, torch.bfloat16).eval()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0)).to(args.device)
    transfuse.rewrite(model)
    chosen: list = []
    route = moe_layer.moe_route

    def recorded(*a, **k):
        weights, experts = route(*a, **k)
        chosen.append(experts.sort(-1)[0].clone())
        return weights, experts

    moe_layer.moe_route = recorded
    runs = {}
    for provider in ("native", "triton"):
        chosen.clear()
        ops.set_priority([provider], args.op)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits.float()
        runs[provider] = (logits, list(chosen))
    ops.set_priority(None, args.op)
    (native, native_ids), (triton, triton_ids) = runs["native"], runs["triton"]
    for layer, (a, b) in enumerate(zip(native_ids, triton_ids)):
        flipped = (a != b).any(-1).nonzero().flatten().tolist()
        print(f"MoE layer {layer}: {len(flipped)} of {a.shape[0]} tokens routed to other experts {flipped}")
    per_token = (triton - native).abs().amax(-1).flatten() / native.abs().max()
    print("logit difference per token, relative to the logits' scale:")
    print(" ".join(f"{v:.3f}" for v in per_token.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
