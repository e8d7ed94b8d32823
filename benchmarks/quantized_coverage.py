"""Merged projections over quantized weights, per scheme: how many merge in the scheme's own storage.

For each tiny model (llama, qwen3, qwen3_moe) and each quantization scheme that loads on CPU, the
stock quantized model and a rewritten copy are loaded from one checkpoint. An opportunity is a
merged projection the rewrite matched on an instance (qkv, gate_up: fused or refused on that
instance); it counts as fused only when the merged module is a ``QuantizedProjection`` whose parts
keep the stock model's weight types and quantized bytes. Then the logits on the same ids (max abs
difference to the stock model's), and the save round trip: ``save_pretrained`` of both models gives
the same safetensors (keys, dtypes, bytes) and quantization config, and a stock transformers load of
each gives the same tensors bit for bit.

    python benchmarks/quantized_coverage.py [--models llama qwen3 qwen3_moe] [--schemes ...]

quanto int4 needs optimum-quanto's C++ extension (built on first use, minutes): ``--schemes`` with
``quanto-int4`` to include it.

``fp8-blocks`` is transformers' fine-grained FP8 (e4m3 with 32x32 block scales, ``FP8Linear`` and, for
MoE models, ``FP8Experts``). transformers dequantises FP8 checkpoints when no GPU is present and
its FP8 kernels are CUDA only, so here both models are built by transformers' own replacement
(``replace_with_fp8_linear``) from the tiny model, their weights quantized per block, and the stock
model runs with transformers' ``fp8_linear`` computing the block-dequantised reference (the eager
experts loop). Its MoE blocks count as opportunities too (``moe``: fused into ``moe_experts_fp8`` on
the FP8 experts' own tensors). Round trip: the two ``save_pretrained`` outputs are compared; a stock
load would dequantise them, so loads are not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SCHEMES = [
    "torchao-int8", "torchao-int4", "torchao-float8", "bnb-int8", "bnb-nf4", "bnb-fp4", "bnb-nf4-double", "quanto-int8",
    "fp8-blocks",
]  # fmt: skip
MODELS = ["llama", "qwen3", "qwen3_moe"]


def config(scheme: str):
    from transformers import BitsAndBytesConfig, QuantoConfig, TorchAoConfig

    if scheme == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    if scheme == "torchao-int4":  # torchao's int4 weight-only for CPU (tinygemm's _weight_int4pack_mm_for_cpu)
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=32))
    if scheme == "torchao-float8":
        from torchao.quantization import Float8WeightOnlyConfig

        return TorchAoConfig(Float8WeightOnlyConfig())
    if scheme == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if scheme.startswith("bnb-"):
        kind = scheme.split("-")[1]
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=scheme.endswith("-double")
        )
    if scheme.startswith("quanto-"):
        return QuantoConfig(weights=scheme.split("-")[1])
    raise ValueError(scheme)


PACKAGE = {"torchao": "torchao", "bnb": "bitsandbytes", "quanto": "optimum", "fp8": "transformers"}
FP8_BLOCK = (32, 32)


def _fp8_model(path: Path):
    """The tiny model at ``path`` with transformers' FP8 layers and experts, its weights quantized per block."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations import finegrained_fp8 as fp8

    from transfuse.ops.quantized.fp8_blocks import quantize_blocks

    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    config = FineGrainedFP8Config(weight_block_size=FP8_BLOCK, modules_to_not_convert=["lm_head"])
    fp8.replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=config)
    for name, module in model.named_modules():
        pairs = {fp8.FP8Linear: [("weight", "weight_scale_inv")],
                 fp8.FP8Experts: [("gate_up_proj", "gate_up_proj_scale_inv"), ("down_proj", "down_proj_scale_inv")]}
        for tensor, scale in next((v for k, v in pairs.items() if isinstance(module, k)), []):
            q, s = quantize_blocks(weights[f"{name}.{tensor}"], FP8_BLOCK)
            setattr(module, tensor, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, scale, torch.nn.Parameter(s, requires_grad=False))
    model.config._experts_implementation = "eager"  # the grouped and batched FP8 experts are CUDA kernels
    model.config.quantization_config = config
    return model


def _dequantising_fp8_linear():
    """transformers' ``fp8_linear`` computing what transformers computes on FP8 weights it dequantises."""
    import torch.nn.functional as F
    from transformers.integrations import finegrained_fp8 as fp8

    from transfuse.ops.quantized.fp8_blocks import quantize_blocks

    def linear(input, weight, weight_scale_inv, block_size=None, bias=None, activation_scale=None, *args):
        out = F.linear(input, fp8._dequantize_fp8_weight(weight.clone(), weight_scale_inv, block_size, input.dtype))
        return out + bias if bias is not None else out

    fp8.fp8_linear = linear


def _flat(tensor):
    if isinstance(tensor, torch.nn.Parameter) or type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor.detach()]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _flat(getattr(tensor, name))]


def _differ(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = _flat(a[key]), _flat(b[key])
        same = type(a[key]) is type(b[key]) and len(x) == len(y)
        same = same and all(
            p.dtype == q.dtype and p.shape == q.shape and torch.equal(p.reshape(-1).view(torch.uint8), q.reshape(-1).view(torch.uint8))
            for p, q in zip(x, y)
        )
        if not same:
            bad.append(key)
    return bad


def measure(model_type: str, scheme: str, workdir: Path) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import transfuse
    from transfuse.ops.quantized import QuantizedProjection
    from transfuse.tiny import tiny_model

    path = workdir / model_type
    if not path.exists():
        tiny_model(model_type).save_pretrained(path)
    load = lambda p=path, **kw: AutoModelForCausalLM.from_pretrained(p, device_map="cpu", **kw).eval()  # noqa: E731
    fp8 = scheme == "fp8-blocks"
    if fp8:
        _dequantising_fp8_linear()
        stock, model = _fp8_model(path), _fp8_model(path)
    else:
        stock, model = load(quantization_config=config(scheme)), load(quantization_config=config(scheme))
    stock_parts = {name: m for name, m in stock.named_modules()}
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the rewrite runs the model too (bitsandbytes repacks 4-bit layers on a first run)
        want = stock(ids).logits
    transfuse.rewrite(model)
    report = transfuse.report(model)
    kinds = ("qkv", "gate_up")
    refused = [s for s in report.skipped if s.kind in kinds]
    kept, storage, quantized_bytes = 0, set(), 0
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedProjection):
            continue
        owner = name.rpartition(".")[0]
        parts = [stock_parts[f"{owner}.{p}"] for p in module.parts]
        same_types = all(type(getattr(model.get_submodule(owner), p).weight) is type(s.weight) for p, s in zip(module.parts, parts))
        stock_bytes = sum(t.numel() * t.element_size() for s in parts for t in module.scheme.tensors(s))
        if same_types and module.quantized_bytes() == stock_bytes:
            kept += 1
            storage.add(module.storage)
            quantized_bytes += module.quantized_bytes()
    opportunities = sum(report.counts().get(k, 0) for k in kinds) + len(refused)
    moe_refused = [s for s in report.skipped if s.kind == "moe"]
    with torch.no_grad():
        got = model(ids).logits
    row = {
        "model": model_type,
        "scheme": scheme,
        "fused": kept,
        "opportunities": opportunities,
        "storage": ", ".join(sorted(storage)) or "-",
        "bytes": quantized_bytes,
        "max_logit_diff": (got.float() - want.float()).abs().max().item(),
        "refusals": sorted({f"{s.tag}: {s.reason[:110]}" for s in refused + moe_refused}),
        "moe": f"{report.counts().get('moe', 0)}/{report.counts().get('moe', 0) + len(moe_refused)}",
    }
    try:
        stock.save_pretrained(workdir / "stock")
        model.save_pretrained(workdir / "rewritten")
    except ValueError as exc:  # transformers cannot save some schemes (quanto) at all
        row["round_trip"] = f"n/a (stock cannot save either: {str(exc)[:60]})"
        return row
    files = sorted(p.name for p in (workdir / "stock").glob("*.safetensors"))
    bad = [] if files == sorted(p.name for p in (workdir / "rewritten").glob("*.safetensors")) else ["file names"]
    for name in files:
        bad += _differ(load_file(workdir / "stock" / name), load_file(workdir / "rewritten" / name))
    configs = [json.loads((workdir / d / "config.json").read_text()).get("quantization_config") for d in ("stock", "rewritten")]
    bad += [] if configs[0] == configs[1] else ["quantization_config"]
    if fp8:
        row["round_trip"] = "saved same (loads dequantise on CPU)" if not bad else f"differs: {bad[:3]}"
        return row
    bad += _differ(load(workdir / "stock").state_dict(), load(workdir / "rewritten").state_dict())
    row["round_trip"] = "ok" if not bad else f"differs: {bad[:3]}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--schemes", nargs="+", default=SCHEMES)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    rows = []
    for scheme in args.schemes:
        if importlib.util.find_spec(PACKAGE[scheme.split("-")[0]]) is None:
            print(f"{scheme}: package not installed", file=sys.stderr)
            continue
        for model_type in args.models:
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(measure(model_type, scheme, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(
        "| scheme | model | fused / opportunities | storage kept (type) | quantized bytes kept | moe fused | "
        "max logit diff | round trip |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scheme']} | {r['model']} | {r['fused']}/{r['opportunities']} | {r['storage']} | {r['bytes']} | "
            f"{r['moe']} | {r['max_logit_diff']:.3g} | {r['round_trip']} |"
        )
    print()
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        fused = sum(r["fused"] for r in rows if r["scheme"] == scheme)
        total = sum(r["opportunities"] for r in rows if r["scheme"] == scheme)
        print(f"- {scheme}: {fused}/{total} ({100 * fused / max(total, 1):.0f}%) merged in the scheme's own storage")
    refusals = sorted({f"{r['scheme']}: {x}" for r in rows for x in r["refusals"]})
    if refusals:
        print("\nRefusals:")
        print("\n".join(f"- {x}" for x in refusals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
