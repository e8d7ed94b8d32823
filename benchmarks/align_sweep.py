"""The MoE grouped path's one-program alignment (``_align_small_kernel``) at small pair counts:
launch variants timed side by side, each checked to place every pair where the first does.

    python benchmarks/align_sweep.py [--pairs 8 16 64 128 256] [--experts 128]
    TRITON_INTERPRET=1 python benchmarks/align_sweep.py --pairs 8 40   # the CPU: the check only

Variants: the one-hot tile height (``SUB``: pairs a step), the block chunk (``BLOCKS_CHUNK``) and
the warp count; ``fitted tiles, 1 warp`` is what ``moe._align`` launches. Each call is timed inside
a CUDA graph (``bench_ops.time_graph``, median of 10 replays of 20 calls); the routing ids are random.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transfuse.ops.triton import moe  # noqa: E402


def _pow2_at_least(n: int, low: int, high: int) -> int:
    return max(low, min(high, moe._next_pow2(n)))


def variants(pairs: int, experts: int, max_blocks: int) -> dict[str, dict]:
    sub, chunk = moe._sub(experts), moe._BLOCKS_CHUNK
    fit_sub, fit_chunk = _pow2_at_least(pairs, 16, sub), _pow2_at_least(max_blocks, 16, chunk)
    return {
        "full tiles": dict(SUB=sub, BLOCKS_CHUNK=chunk, num_warps=4),
        "full tiles, 8 warps": dict(SUB=sub, BLOCKS_CHUNK=chunk, num_warps=8),
        "full tiles, 2 warps": dict(SUB=sub, BLOCKS_CHUNK=chunk, num_warps=2),
        "fitted tiles": dict(SUB=fit_sub, BLOCKS_CHUNK=fit_chunk, num_warps=4),
        "fitted tiles, 8 warps": dict(SUB=fit_sub, BLOCKS_CHUNK=fit_chunk, num_warps=8),
        "fitted tiles, 2 warps": dict(SUB=fit_sub, BLOCKS_CHUNK=fit_chunk, num_warps=2),
        "fitted tiles, 1 warp (launched)": dict(SUB=fit_sub, BLOCKS_CHUNK=fit_chunk, num_warps=1),
    }


def placed(meta: torch.Tensor, max_blocks: int, block_m: int) -> list:
    """What the GEMMs read of the workspace: each block's expert and end, and its rows up to the end."""
    experts, ends = meta[:max_blocks].tolist(), meta[max_blocks : 2 * max_blocks].tolist()
    rows = meta[2 * max_blocks : 2 * max_blocks + max_blocks * block_m].view(max_blocks, block_m)
    return [(e, end, rows[b, : max(0, end - b * block_m)].tolist() if e >= 0 else []) for b, (e, end) in enumerate(zip(experts, ends))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[8, 16, 64, 128, 256])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--block-m", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        from bench_ops import time_graph
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreted: the check only)'}, torch {torch.__version__}")
    for block_m in args.block_m:
        for pairs in args.pairs:
            g = torch.Generator().manual_seed(pairs)
            ids = torch.randint(0, args.experts, (pairs,), generator=g).to(device)
            max_blocks = pairs // block_m + min(pairs, args.experts) + 1
            size = moe._workspace_size(pairs, args.experts, block_m, max_blocks)
            reference = None
            line = []
            for name, options in variants(pairs, args.experts, max_blocks).items():
                meta = torch.full((size,), -7, dtype=torch.int32, device=device)

                def call(meta=meta, options=options):
                    moe._align_small_kernel[(1,)](ids, meta, pairs, max_blocks, E_PAD=moe._next_pow2(args.experts),
                                                  BLOCK_M=block_m, **options)  # fmt: skip

                call()
                got = placed(meta.cpu(), max_blocks, block_m)
                if sorted(r for _, _, rows in got for r in rows) != list(range(pairs)):
                    raise SystemExit(f"{name}: the blocks do not hold every pair once")
                reference = got if reference is None else reference
                same = "=" if got == reference else "DIFFERS"
                us = f"{time_graph(call, [()], repeats=10):.2f} us" if cuda else "-"
                line.append(f"{name} {us} {same}")
            print(f"block_m {block_m}, {pairs} pairs: " + " | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
