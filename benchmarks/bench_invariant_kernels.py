"""The batch-invariant mode's GPU kernels alone, against what the default mode runs, at Llama-3-8B shapes.

    python benchmarks/bench_invariant_kernels.py --out DIR [--tiles default 64,128,64,4,4,1024 ...]
        [--rows 1 32 2048] [--profile] [--skip-gemm | --skip-attention]

GEMM: ``invariant.bmm`` for each weight of a Llama-3-8B layer and the output head, at each
``--rows`` count, against ``F.linear`` (cuBLAS), for each tile choice of ``--tiles``
(``block_m,block_n,block_k,warps,stages,chunk``; ``default`` is ``invariant.gemm_tiles``). The
launch the row count chooses (one program a tile, or split by chunks) and both forced. Each call is
timed inside a CUDA graph of 20 calls (the decode paths replay graphs), median of 5 replays. Bits:
row 0 alone against row 0 inside every larger row count, and split against one launch; they must
be equal; and row 0 against the first tile choice with the same ``block_k`` and chunk (tiles that
differ only in the outputs a program covers). Per tile choice, the sum over one decode token (8
layers and the head) and over a 2048-token prefill.

Attention: ``invariant_attention`` over a causal 2048-token prompt (32 heads, 8 key/value heads,
dim 128) against ``F.scaled_dot_product_attention``; the mode's ``decode_attention`` against the
default provider at batch 1 and 32 over 512 cached keys, reading only and writing the step's key.

``--profile``: the 8-layer Llama model of ``bench_batch_invariant`` decoding 32 tokens through step
graphs, each mode, under ``torch.profiler``: the kernels that take the most device time.

Writes DIR/invariant_kernels.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ops import time_graph  # noqa: E402
from transfuse.ops.triton import invariant  # noqa: E402

HIDDEN, HEADS, KV_HEADS, DIM, FFN, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 8
DEVICE = "cuda"
WEIGHTS = {  # name: (out features, in features, times a token)
    "qkv": ((HEADS + 2 * KV_HEADS) * DIM, HIDDEN, LAYERS),
    "o": (HIDDEN, HEADS * DIM, LAYERS),
    "gate_up": (2 * FFN, HIDDEN, LAYERS),
    "down": (HIDDEN, FFN, LAYERS),
    "head": (VOCAB, HIDDEN, 1),
}


def timed(fn, reps: int = 20, rounds: int = 5) -> float:
    """Microseconds a call, from a CUDA graph of ``reps`` calls replayed ``rounds`` times (median)."""
    return time_graph(fn, [()], repeats=rounds, per_graph=reps)


def parse_tiles(text: str):
    if text == "default":
        return None
    return invariant.Tiles(*(int(v) for v in text.split(",")))


def gemm(tiles_texts: list[str], rows: list[int]) -> list[dict]:
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5 for name, (n, k, _) in WEIGHTS.items()}
    # Each row count's rows are the first rows of one tensor: row 0 is the same row in every call.
    full = {k: torch.randn(max(rows), k, device=DEVICE, dtype=torch.bfloat16) for (_, k, _) in WEIGHTS.values()}
    inputs = {(k, m): full[k][:m] for k in full for m in rows}
    default_tiles = invariant.gemm_tiles
    results = []
    cublas = {}
    # Row 0 as the first tile choice with the same reduction (BLOCK_K and chunk) computed it: tiles
    # that differ only in the block of outputs a program takes must give it the same bits.
    reference: dict[tuple, torch.Tensor] = {}
    for name, w in weights.items():
        n, k, _ = WEIGHTS[name]
        for m in rows:
            x = inputs[(k, m)]
            cublas[(name, m)] = timed(lambda: F.linear(x, w), **(dict(reps=20, rounds=5) if m <= 64 else dict(reps=3, rounds=3)))
    for text in tiles_texts:
        chosen = parse_tiles(text)
        invariant.gemm_tiles = default_tiles if chosen is None else (lambda n, k, *_, t=chosen: t)
        try:
            for name, w in weights.items():
                n, k, _ = WEIGHTS[name]
                first = None
                for m in rows:
                    x = inputs[(k, m)]
                    a, b = x[None], w.t()[None]
                    auto = invariant.bmm(a, b, None, x.dtype)
                    one = invariant.bmm(a, b, None, x.dtype, split=False)
                    split = invariant.bmm(a, b, None, x.dtype, split=True)
                    if first is None:
                        first = auto[0, 0]
                    t = invariant.gemm_tiles(n, k, m)
                    same_sum = reference.setdefault((name, t.block_k, t.chunk), auto[0, 0])
                    few = m <= 64  # both launches timed where the choice between them is made
                    reps = dict(reps=20, rounds=5) if few else dict(reps=3, rounds=3)
                    results.append(
                        dict(
                            tiles=text, weight=name, n=n, k=k, rows=m,
                            cublas_us=cublas[(name, m)],
                            auto_us=timed(lambda: invariant.bmm(a, b, None, x.dtype), **reps),
                            one_launch_us=timed(lambda: invariant.bmm(a, b, None, x.dtype, split=False)) if few else None,
                            split_us=timed(lambda: invariant.bmm(a, b, None, x.dtype, split=True)) if few else None,
                            split_equals_one_launch=bool(torch.equal(one, split)),
                            row0_equals_alone=bool(torch.equal(auto[0, 0], first)),
                            row0_equals_first_tiles_of_its_reduction=bool(torch.equal(auto[0, 0], same_sum)),
                            max_diff_vs_cublas=float((auto[0].float() - F.linear(x, w).float()).abs().max()),
                        )
                    )  # fmt: skip
                    print(json.dumps(results[-1]), flush=True)
        finally:
            invariant.gemm_tiles = default_tiles
    return results


def attention() -> list[dict]:
    from transfuse.ops.triton import decode_attention as triton_decode

    torch.manual_seed(0)
    out = []
    length = 2048
    q = torch.randn(1, HEADS, length, DIM, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1, KV_HEADS, length, DIM, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(length, length, dtype=torch.bool, device=DEVICE).tril()[None, None]
    kr, vr = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
    chosen = invariant.attention_tiles
    tiles = chosen(length, DIM)
    got = invariant.invariant_attention(q, kr, vr, mask)
    invariant.attention_tiles = lambda *_: (64, tiles[1], 4)  # the decode step's blocks of rows
    try:
        small = invariant.invariant_attention(q, kr, vr, mask)
        small_us = timed(lambda: invariant.invariant_attention(q, kr, vr, mask), reps=3, rounds=3)
    finally:
        invariant.attention_tiles = chosen
    out.append(
        dict(
            case=f"prefill {length}, causal mask", tiles=list(tiles),
            invariant_us=timed(lambda: invariant.invariant_attention(q, kr, vr, mask), reps=3, rounds=3),
            default_us=timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps=3, rounds=3),
            rows_of_64_us=small_us, same_bits_as_rows_of_64=bool(torch.equal(got, small)),
        )
    )  # fmt: skip
    print(json.dumps(out[-1]), flush=True)
    for batch in (1, 32):
        cached = 512
        query = torch.randn(batch, HEADS, 1, DIM, device=DEVICE, dtype=torch.bfloat16)
        keys, values = (torch.randn(batch, KV_HEADS, cached, DIM, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        bias = torch.zeros(batch * KV_HEADS, 1, cached, device=DEVICE)
        bias[..., cached // 2 :] = float("-inf")
        scaling = DIM**-0.5
        out.append(
            dict(
                case=f"decode, batch {batch}, {cached} cached keys (half masked)",
                invariant_us=timed(lambda: invariant.decode_attention(query, keys, values, bias, scaling)),
                default_us=timed(lambda: triton_decode.decode_attention(query, keys, values, bias, scaling)),
            )
        )  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
        # A decode step over a store: the token's key and value written at the first masked place.
        new = [torch.randn(batch, KV_HEADS, 1, DIM, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
        position = torch.tensor([cached // 2], device=DEVICE)
        out.append(
            dict(
                case=f"decode step writing its key, batch {batch}, {cached} cached keys (half masked)",
                invariant_us=timed(lambda: invariant.decode_attention(query, keys, values, bias, scaling, *new, position)),
                default_us=timed(lambda: triton_decode.decode_attention(query, keys, values, bias, scaling, *new, position)),
            )
        )  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def profile(tokens: int = 32) -> dict:
    import transfuse
    from bench_batch_invariant import build, left_padded, random_prompts

    stock = build("llama", "cuda", tiny=False)
    found = {}
    for mode in ("default", "invariant"):
        import copy

        model = copy.deepcopy(stock)
        transfuse.rewrite(model, batch_invariant=mode == "invariant")
        transfuse.decode_steps(model)
        prompts = random_prompts(1, model.config.vocab_size, (64, 65), "cuda", seed=1)
        ids, mask = left_padded(prompts)
        kwargs = dict(attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        with torch.no_grad():
            model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model.generate(ids, **kwargs)
                torch.cuda.synchronize()
        table = []
        for event in prof.key_averages():
            device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if device_us:
                table.append(dict(kernel=event.key[:120], calls=event.count, device_us=device_us))
        table.sort(key=lambda e: -e["device_us"])
        found[mode] = dict(total_device_us=sum(e["device_us"] for e in table), top=table[:20])
        print(mode, json.dumps(found[mode]["top"][:8]), flush=True)
        del model
        torch.cuda.empty_cache()
    return found


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(result: dict, args) -> str:
    lines = [
        "# Batch-invariant kernels against the default mode's (Llama-3-8B shapes)",
        "",
        "```",
        "python benchmarks/bench_invariant_kernels.py " + shlex.join(sys.argv[1:]),
        "```",
        "",
        f"{result['device']}, torch {torch.__version__}. Microseconds a call inside a CUDA graph.",
        "",
        "| tiles | weight | rows | cuBLAS | invariant (chosen) | one launch | split | split = one launch | row alone = in batch "
        "| row = first tiles of its reduction |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for r in result["gemm"]:
        lines.append(
            f"| {r['tiles']} | {r['weight']} {r['n']}x{r['k']} | {r['rows']} | {r['cublas_us']:.1f} | {r['auto_us']:.1f} | "
            f"{_us(r['one_launch_us'])} | {_us(r['split_us'])} | {r['split_equals_one_launch']} | {r['row0_equals_alone']} | "
            f"{r.get('row0_equals_first_tiles_of_its_reduction', '-')} |"
        )  # fmt: skip
    lines += ["", "Per token (8 layers and the head), microseconds:", "", "| tiles | rows | cuBLAS | invariant | ratio |", "| --- | ---: | ---: | ---: | ---: |"]
    for text in args.tiles:
        for m in args.rows:
            picked = [r for r in result["gemm"] if r["tiles"] == text and r["rows"] == m]
            ours = sum(r["auto_us"] * WEIGHTS[r["weight"]][2] for r in picked)
            theirs = sum(r["cublas_us"] * WEIGHTS[r["weight"]][2] for r in picked)
            if picked:
                lines.append(f"| {text} | {m} | {theirs:.0f} | {ours:.0f} | {ours / theirs:.2f}x |")
    lines += ["", "| attention | invariant | default |", "| --- | ---: | ---: |"]
    for r in result["attention"]:
        lines.append(f"| {r['case']} | {r['invariant_us']:.1f} | {r['default_us']:.1f} |")
        if "rows_of_64_us" in r:
            lines.append(f"| (the same in programs of 64 rows: same bits {r['same_bits_as_rows_of_64']}) | {r['rows_of_64_us']:.1f} | |")
    for mode, found in result.get("profile", {}).items():
        lines += ["", f"Decode profile, {mode} mode: {found['total_device_us'] / 1000:.1f} ms of device time", "",
                  "| kernel | calls | device ms |", "| --- | ---: | ---: |"]  # fmt: skip
        for e in found["top"]:
            lines.append(f"| `{e['kernel']}` | {e['calls']} | {e['device_us'] / 1000:.2f} |")
    for name, error in result["errors"].items():
        lines += ["", f"{name} failed: `{error[:300]}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiles", nargs="+", default=["default"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32, 2048])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), gemm=[], attention=[], errors={})
    parts = [] if args.skip_gemm else [("gemm", lambda: gemm(args.tiles, args.rows))]
    parts += [] if args.skip_attention else [("attention", attention)]
    parts += [("profile", profile)] if args.profile else []
    for name, part in parts:
        try:  # a part that fails is reported; the others still run
            result[name] = part()
        except Exception as e:  # noqa: BLE001
            result["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {result['errors'][name]}", flush=True)
    with open(os.path.join(args.out, "invariant_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result, args)
    with open(os.path.join(args.out, "invariant_kernels.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
