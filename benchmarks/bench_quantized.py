"""Decode through ``generate`` on quantized weights: stock quantized model against transfuse, one process.

    python benchmarks/bench_quantized.py --out DIR [--schemes fp8-block int4-wo] [--batch 1 32]
        [--prompt 128] [--new 64] [--rounds 3] [--moe] [--tiny]

Models of Llama-3-8B layer shapes (8 layers, vocab 32000) and with ``--moe`` Qwen3-MoE shapes
(Qwen3-30B-A3B's layers, 4 of them, batch 1), random bf16 weights, quantized in memory:

  fp8-block   every linear of the decoder layers (and with --moe the experts' linears where the
              experts are modules) replaced by transformers' ``FP8Linear``: e4m3 weights with one
              float32 scale per 128 x 128 block, dynamic activation quantization (transformers'
              DeepGEMM or Triton block-FP8 kernel on CUDA)
  int4-wo     torchao ``Int4WeightOnlyConfig`` (group 128, tile-packed for ``aten._weight_int4pack_mm``,
              which needs no kernel package beside torch): needs torchao and CUDA
  int8-wo     torchao ``Int8WeightOnlyConfig``, runs on CPU (the dry run's)
  nf4         bitsandbytes 4-bit NF4 through ``BitsAndBytesConfig``, runs on CPU

Variants: stock eager (DynamicCache); stock with ``cache_implementation="static"`` (transformers
compiles the decode step on CUDA); transfuse (``transfuse.rewrite`` + ``transfuse.decode_steps``).
Per-token time: (generate with --new tokens - generate with 1 token) / (--new - 1), the median over
--rounds rounds in which the variants take turns. The floor: quantized bytes one token reads (every
parameter's and buffer's stored bytes but the input embedding table; inner tensors of tensor
subclasses) over the copy bandwidth measured in the same run. Tokens are compared with stock eager's
(the fraction of positions equal before the first difference). A variant that fails is reported
with its error, and the others still run.

Packages: torch, transformers; for fp8-block, transformers' FP8 kernel (recent transformers load it
from the Hub through the ``kernels`` package: offline, the stock FP8 rows fail with transformers'
ImportError and so does the rewrite, whose analysis runs the stock layers); torchao for int4-wo and
int8-wo, bitsandbytes for nf4. ``--tiny``: small shapes (block 128 kept), 2 layers, for
a dry run on CPU (``--schemes int8-wo nf4``; FP8 and int4 have no CPU kernel in transformers or torchao).
Writes DIR/quantized.md and DIR/quantized.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transfuse  # noqa: E402
from bench_e2e import copy_bandwidth  # noqa: E402

BLOCK = (128, 128)


def dense_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)  # fmt: skip
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000, rope_theta=500000.0, max_position_embeddings=4096)  # fmt: skip


def moe_config(tiny: bool):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                              num_experts_per_tok=2, vocab_size=512, max_position_embeddings=1024)  # fmt: skip
    return Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_hidden_layers=4,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip


def fp8_blocks(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` of the decoder layers as transformers' ``FP8Linear`` with 128 x 128 blocks."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from transfuse.ops.quantized.fp8_blocks import new_fp8_linear, quantize_blocks

    for layer in model.model.layers:
        for name, child in list(layer.named_modules()):
            if type(child) is not nn.Linear:
                continue
            owner, _, attr = name.rpartition(".")
            fp8 = new_fp8_linear(FP8Linear, child.in_features, child.out_features, BLOCK, child.bias is not None)
            w = child.weight.detach()
            q, scale = quantize_blocks(w, BLOCK)
            fp8.weight = nn.Parameter(q, requires_grad=False)
            fp8.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
            if child.bias is not None:
                fp8.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(layer.get_submodule(owner) if owner else layer, attr, fp8.to(w.device))
    return model


def build(scheme: str, config, device: str, path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

    if scheme == "fp8-block":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
        return fp8_blocks(model).eval()
    if scheme in ("int4-wo", "int8-wo"):
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

        quantization = TorchAoConfig(Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d") if scheme == "int4-wo" else Int8WeightOnlyConfig())
    elif scheme == "nf4":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        raise ValueError(scheme)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=quantization, device_map=device).eval()


def stored_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer as stored (inner tensors of subclasses), but the input embedding."""
    skip = {id(p) for p in model.get_input_embeddings().parameters()}

    def inner(t):
        if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
            return [t]
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in inner(getattr(t, n))]

    total, seen = 0, set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in skip:
            continue
        for t in inner(tensor):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        state = getattr(tensor, "quant_state", None)  # bitsandbytes 4-bit: the absmax beside the codes
        if state is not None and state.absmax.data_ptr() not in seen:
            seen.add(state.absmax.data_ptr())
            total += state.absmax.numel() * state.absmax.element_size()
    return total


def timed_generate(model, ids, new: int, static: bool, device: str) -> tuple[float, torch.Tensor]:
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    same = (a == b).all(dim=0)
    first = int((~same).nonzero()[0]) if (~same).any() else len(same)
    return first / len(same)


def bench(model_kind: str, scheme: str, batch: int, args, device: str, path: Path, bandwidth: float) -> dict:
    config = (moe_config if model_kind == "qwen3_moe" else dense_config)(args.tiny)
    stock = build(scheme, config, device, path)
    rewritten = build(scheme, config, device, path)
    row = {"model": model_kind, "scheme": scheme, "batch": batch, "errors": {}}
    try:
        transfuse.rewrite(rewritten)
        transfuse.decode_steps(rewritten)
        counts = transfuse.report(rewritten).counts()
        row["fused"] = {k: counts.get(k, 0) for k in ("qkv", "gate_up", "moe")}
        row["refused"] = sorted({f"{s.kind}: {s.tag}" for s in transfuse.report(rewritten).skipped})
    except Exception as exc:  # noqa: BLE001 (reported, the stock variants still run)
        row["errors"]["transfuse"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    variants = {"stock eager": (stock, False), "stock static": (stock, True), "transfuse": (rewritten, False)}
    ids = torch.randint(1, config.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(0)).to(device)
    times = {name: [] for name in variants}
    tokens = {}
    for _ in range(args.rounds):
        for name, (model, static) in variants.items():
            if name in row["errors"] or (name == "transfuse" and "transfuse" in row["errors"]):
                continue
            try:
                one, _ = timed_generate(model, ids, 1, static, device)
                full, out = timed_generate(model, ids, args.new, static, device)
            except Exception as exc:  # noqa: BLE001
                row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            times[name].append((full - one) / (args.new - 1) * 1e3)
            tokens[name] = out[:, args.prompt :]
    row["ms_per_token"] = {name: statistics.median(t) for name, t in times.items() if t}
    row["agreement"] = {n: agreement(t, tokens["stock eager"]) for n, t in tokens.items() if "stock eager" in tokens}
    row["quantized_bytes"] = stored_bytes(stock)
    row["floor_ms"] = row["quantized_bytes"] / bandwidth * 1e3 if bandwidth == bandwidth else None
    del stock, rewritten
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", nargs="+", default=["fp8-block", "int4-wo"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--moe", action="store_true", help="also Qwen3-MoE shapes with FP8 experts, batch 1")
    parser.add_argument("--tiny", action="store_true", help="small shapes for a dry run (CPU)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth(device)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = [("llama", s, b) for s in args.schemes for b in args.batch]
    if args.moe:
        runs.append(("qwen3_moe", "fp8-block", 1))
    for model_kind, scheme, batch in runs:
        needs = {"int4-wo": "torchao", "int8-wo": "torchao", "nf4": "bitsandbytes"}.get(scheme)
        if needs and importlib.util.find_spec(needs) is None:
            rows.append({"model": model_kind, "scheme": scheme, "batch": batch, "errors": {"all": f"{needs} not installed"}})
            continue
        path = args.out / f"checkpoint_{model_kind}"
        if not path.exists():
            torch.manual_seed(0)
            config = (moe_config if model_kind == "qwen3_moe" else dense_config)(args.tiny)
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        rows.append(bench(model_kind, scheme, batch, args, device, path, bandwidth))
        print(json.dumps(rows[-1]), flush=True)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lines = [f"# Quantized decode ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'})", "", f"`{command}`", "",
             f"torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s", "",
             "| model | scheme | batch | stock eager ms/tok | stock static ms/tok | transfuse ms/tok | x eager | x static | "
             "floor ms | fused | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        t = r.get("ms_per_token", {})
        fmt = lambda name: f"{t[name]:.3f}" if name in t else "-"  # noqa: E731
        ratio = lambda name: f"{t[name] / t['transfuse']:.2f}" if name in t and "transfuse" in t else "-"  # noqa: E731
        floor = f"{r['floor_ms']:.3f}" if r.get("floor_ms") else "-"
        lines.append(
            f"| {r['model']} | {r['scheme']} | {r['batch']} | {fmt('stock eager')} | {fmt('stock static')} | "
            f"{fmt('transfuse')} | {ratio('stock eager')} | {ratio('stock static')} | {floor} | {r.get('fused', '-')} | "
            f"{'; '.join(f'{k}: {v}' for k, v in r['errors'].items()) or '-'} |"
        )
    (args.out / "quantized.md").write_text("\n".join(lines) + "\n")
    (args.out / "quantized.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
