"""Why is torch.compile's silu_and_mul kernel 15-40 ns faster than ours at 1-16 rows?

    python benchmarks/act_variants.py --out DIR [--tokens 1 16 256]

The launch-shape sweep (``sweep_triton_ops.py``) rules the launch shape out: at compile's own
shape (blocks of 128 elements, 4 warps, at one row) our kernel takes 1.22 us and compile's 1.18.
So this script times kernel variants that differ from ours in one respect each, against
torch.compile of the Hugging Face code, in alternating CUDA-graph replays
(``bench_ops.time_paired``; hidden 4096, bf16):

- ``ours``: the triton provider as shipped (2-D grid of rows by blocks, the activation rounded to
  bf16 before the multiply as eager does). The row width and stride are compile-time
  constants, as in ``flat``;
- ``flat``: one kernel with the width a compile-time constant and contiguous rows, whose flags
  switch on, one at a time, compile's choices: a 1-D grid over all outputs (``grid_1d``), no
  rounding of the activation (``no_round``), libdevice's exp (``libdevice``), and compile's launch
  shape (``compile_shape``);
- ``inductor``: all of compile's choices at once, which should time like compile itself.

Each variant is checked against native first (the share of bit-identical outputs is reported: the
variants without the rounding differ from eager by design). Writes DIR/act_variants.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_ops  # noqa: E402

from transfuse.ops.triton import act_and_mul as triton_act  # noqa: E402


@triton.jit
def _flat_kernel(
    x_ptr, out_ptr,
    D: tl.constexpr, BLOCK: tl.constexpr, GRID_1D: tl.constexpr, ROUND: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    if GRID_1D:  # compile's indexing: one flat range over all outputs, row and column derived
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        row = offs // D
        col = offs % D
    else:
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(x_ptr + row * (2 * D) + col).to(tl.float32)
    up = tl.load(x_ptr + row * (2 * D) + D + col).to(tl.float32)
    if LIBDEVICE:
        act = gate / (1.0 + libdevice.exp(-gate))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    if ROUND:
        act = act.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * D + col, (act * up).to(x_ptr.dtype.element_ty))


def _flat(x, block, num_warps, grid_1d=False, round_=True, libdevice_exp=False):
    d = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], d))
    rows = x.numel() // (2 * d)
    grid = (rows * d // block,) if grid_1d else (rows, d // block)
    _flat_kernel[grid](
        x, out, D=d, BLOCK=block, GRID_1D=grid_1d, ROUND=round_, LIBDEVICE=libdevice_exp, num_warps=num_warps
    )
    return out


def _ours(block=None, num_warps=None):
    tuning = {k: v for k, v in (("block", block), ("num_warps", num_warps)) if v is not None}

    def call(x):
        triton_act.TUNING.clear()
        triton_act.TUNING.update(tuning)  # read at launch; under graph replay only the capture counts
        try:
            return triton_act.silu_and_mul(x)
        finally:
            triton_act.TUNING.clear()

    return call


# torch.compile's kernel at these sizes kept (sweep_triton_ops.py --paired, inductor.md):
# XBLOCK 128 at one row, 512 at 16 rows, 512 with 8 warps at 256 rows.
COMPILE_SHAPE = {1: (128, 4), 16: (512, 4), 256: (512, 8)}
# Our default and our best shape in the sweep, per token count.
OUR_SHAPE = {1: (256, 4), 16: (1024, 8), 256: (1024, 8)}


def variants(tokens: int) -> dict:
    ours_block, ours_warps = OUR_SHAPE[tokens]
    cblock, cwarps = COMPILE_SHAPE[tokens]
    return {
        "ours (default launch)": _ours(),
        "ours (best sweep shape)": _ours(ours_block, ours_warps),
        "ours (compile's shape)": _ours(cblock, cwarps),
        "flat": lambda x: _flat(x, ours_block, ours_warps),
        "flat grid_1d": lambda x: _flat(x, ours_block, ours_warps, grid_1d=True),
        "flat no_round": lambda x: _flat(x, ours_block, ours_warps, round_=False),
        "flat libdevice": lambda x: _flat(x, ours_block, ours_warps, libdevice_exp=True),
        "flat compile_shape": lambda x: _flat(x, cblock, cwarps),
        "flat compile_shape grid_1d": lambda x: _flat(x, cblock, cwarps, grid_1d=True),
        "inductor (all of compile's choices)": lambda x: _flat(
            x, cblock, cwarps, grid_1d=True, round_=False, libdevice_exp=True
        ),
    }


def run_case(tokens: int, hidden: int) -> list[dict]:
    case = bench_ops.build_case("silu_and_mul", tokens, hidden, torch.bfloat16)
    example = case.make_inputs()
    sets = bench_ops._input_sets(case.make_inputs, case.min_bytes)
    compiled, native = case.variants["hf compile"], case.variants["native"]
    rows = []
    for name, fn in variants(tokens).items():
        got, ref = fn(*example), native(*example)
        same = (got == ref).float().mean().item()
        close = torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=1e-2)
        pair = bench_ops.time_paired(fn, compiled, sets) if close else None
        rows.append({"tokens": tokens, "variant": name, "bit_identical": same, "close": close, "paired": pair})
        print(f"{tokens:>5} {name:<38} " + (f"{pair['ratio']:.3f}" if pair else "WRONG"), flush=True)
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# silu_and_mul kernel variants against torch.compile (alternating graph replays, bf16, hidden 4096)",
        "",
        f"Command: `{command}`",
        "",
        "| tokens | variant | ours us | compile us | ratio | slower rounds | bit-identical to eager |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        p = r["paired"]
        if p is None:
            lines.append(f"| {r['tokens']} | {r['variant']} | | | | | wrong ({r['bit_identical']:.1%}) |")
            continue
        lines.append(
            f"| {r['tokens']} | {r['variant']} | {p['us']:.3f} | {p['baseline_us']:.3f} | {p['ratio']:.3f} | "
            f"{p['slower_rounds']}/{p['rounds']} | {r['bit_identical']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256], choices=sorted(COMPILE_SHAPE))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python3 " + " ".join([f"benchmarks/{Path(__file__).name}", *(argv or sys.argv[1:])])
    torch.manual_seed(0)
    rows, started = [], time.perf_counter()
    with torch.no_grad():
        for tokens in args.tokens:
            rows += run_case(tokens, args.hidden)
            (args.out / "act_variants.md").write_text(markdown(rows, command))
            (args.out / "act_variants.json").write_text(json.dumps(rows, indent=1))
            print(f"@{tokens} done ({time.perf_counter() - started:.0f} s)", flush=True)
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
