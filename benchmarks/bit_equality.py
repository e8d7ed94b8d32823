"""Which fusions give the stock model's logits bit for bit: each kind alone, then all, per family and dtype.

For tiny random models of each family, the stock model and a copy rewritten with one fusion kind
(``add_rms_norm`` with the ``rms_norm`` it needs; ``all``: the default kinds) run the same token
ids; each cell is ``=`` where the logits are equal bit for bit, else their largest difference over
the largest logit, and ``-`` where the kind made no fusion in that model.

    python benchmarks/bit_equality.py                                  # the families below, float32 and bfloat16
    python benchmarks/bit_equality.py --types llama qwen3 --set intermediate_size=688

Prints a Markdown table (its command and versions first).
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import warnings

import torch
import transformers

import transfuse
from transfuse.tiny import tiny_model

TYPES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "ernie4_5",
    "cohere", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granitemoe", "phimoe",
    "ernie4_5_moe", "jamba",
]  # fmt: skip
KINDS = {"rms_norm": ["rms_norm"], "add_rms_norm": ["rms_norm", "add_rms_norm"], "qkv": ["qkv"],
         "gate_up": ["gate_up"], "rotary": ["rotary"], "moe": ["moe"], "all": None}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cell(model_type: str, dtype: torch.dtype, fusions: list[str] | None, overrides: dict, ids: torch.Tensor) -> str:
    stock = tiny_model(model_type, dtype=dtype, **overrides).eval()
    with torch.no_grad():
        expected = stock(ids).logits
    fused = transfuse.rewrite(stock, fusions=fusions)
    if not transfuse.report(fused).fusions:
        return "-"
    with torch.no_grad():
        got = fused(ids).logits
    if torch.equal(got, expected):
        return "="
    return f"{(got.float() - expected.float()).abs().max().item() / expected.float().abs().max().item():.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=TYPES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=INT", help="configuration values, e.g. intermediate_size=688")
    args = parser.parse_args()
    overrides = {key: int(value) for key, value in (item.split("=", 1) for item in args.set)}
    warnings.filterwarnings("ignore")
    logging.getLogger("transfuse").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"`python benchmarks/bit_equality.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{platform.processor() or platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; token ids of shape 2 x 24\n")  # fmt: skip
    print("| type | dtype | " + " | ".join(KINDS) + " |")
    print("| --- | --- |" + " :---: |" * len(KINDS))
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    for model_type in args.types:
        for name in args.dtypes:
            cells = [cell(model_type, DTYPES[name], fusions, overrides, ids) for fusions in KINDS.values()]
            print(f"| {model_type} | {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
