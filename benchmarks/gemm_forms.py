"""The matrix products of a Llama training step, each in the forms that give the same result.

The eager training step is bound by its matrix products, and cuBLAS picks its kernel from the
shapes and the memory layouts it is handed: the same product asked for transposed (C^T = B^T A^T,
then a transposed view), split along its inner dimension, or accumulated into a transposed
buffer may run at another rate. This times, for every product of one decoder layer and of the
loss's blocks at Llama-3-8B's shapes (tokens = batch x sequence, bf16), the layouts autograd and
our ops use today beside those alternatives, with CUDA events (median), and prints TFLOP/s:
where a product runs below the chip's rate and whether another form of it is faster.

    python benchmarks/gemm_forms.py [--tokens 8192] [--block 1024 2048 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_e2e import time_fn  # noqa: E402  (median of CUDA events)

HIDDEN, QKV, INTER, VOCAB = 4096, 6144, 14336, 128256


def _rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02


def _linear_cases(tokens: int, out: int, inp: int, name: str) -> list[tuple[str, float, object]]:
    """The three products of ``y = x W^T`` with x [tokens, inp], W [out, inp], and their other forms."""
    x, w, g = _rand(tokens, inp), _rand(out, inp), _rand(tokens, out)
    flops = 2.0 * tokens * out * inp
    return [
        (f"{name} forward   x W^T (as F.linear)", flops, lambda: torch.mm(x, w.t())),
        (f"{name} forward   (W x^T)^T", flops, lambda: torch.mm(w, x.t()).t()),
        (f"{name} grad in   g W (as autograd)", flops, lambda: torch.mm(g, w)),
        (f"{name} grad in   (W^T g^T)^T", flops, lambda: torch.mm(w.t(), g.t()).t()),
        (f"{name} grad in   two halves of K", flops,
         lambda: torch.mm(g[:, : out // 2], w[: out // 2]).addmm_(g[:, out // 2:], w[out // 2:])),
        (f"{name} grad W    g^T x (as autograd)", flops, lambda: torch.mm(g.t(), x)),
        (f"{name} grad W    (x^T g)^T", flops, lambda: torch.mm(x.t(), g).t()),
        (f"{name} grad W    (x^T g)^T, made contiguous", flops, lambda: torch.mm(x.t(), g).t().contiguous()),
    ]


def _loss_cases(tokens: int, block: int) -> list[tuple[str, float, object]]:
    """The loss's products over blocks of ``block`` tokens: logits, their input gradient, and the
    head's weight gradient accumulated block by block (as ``addmm_`` today, or transposed)."""
    x, w, d = _rand(tokens, HIDDEN), _rand(VOCAB, HIDDEN), _rand(block, VOCAB)
    acc, acc_t = torch.zeros(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16), torch.zeros(
        HIDDEN, VOCAB, device="cuda", dtype=torch.bfloat16)
    blocks = range(0, tokens, block)
    flops = 2.0 * tokens * VOCAB * HIDDEN

    def logits():
        for s in blocks:
            torch.mm(x[s:s + block], w.t())

    def grad_in():
        for s in blocks:
            torch.mm(d, w)

    def grad_w(into, transposed):
        def run():
            for i, s in enumerate(blocks):
                if transposed:
                    into.addmm_(x[s:s + block].t(), d) if i else torch.mm(x[s:s + block].t(), d, out=into)
                else:
                    into.addmm_(d.t(), x[s:s + block]) if i else torch.mm(d.t(), x[s:s + block], out=into)
        return run

    return [
        (f"loss blocks of {block}: logits", flops, logits),
        (f"loss blocks of {block}: grad in", flops, grad_in),
        (f"loss blocks of {block}: grad W, addmm_ (today)", flops, grad_w(acc, False)),
        (f"loss blocks of {block}: grad W, addmm_ into W^T", flops, grad_w(acc_t, True)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    t = args.tokens
    cases = (_linear_cases(t, QKV, HIDDEN, "qkv    ") + _linear_cases(t, HIDDEN, HIDDEN, "o      ")
             + _linear_cases(t, 2 * INTER, HIDDEN, "gate_up") + _linear_cases(t, HIDDEN, INTER, "down   "))
    for block in args.block:
        cases += _loss_cases(t, block)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.version.cuda and torch.__version__}, tokens {t}, bf16",
             "", "| product | ms | TFLOP/s |", "|---|---:|---:|"]
    for name, flops, fn in cases:
        ms = time_fn(fn, "cuda")
        lines.append(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"`python benchmarks/gemm_forms.py --tokens {t} --block {' '.join(map(str, args.block))}`\n\n")
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
