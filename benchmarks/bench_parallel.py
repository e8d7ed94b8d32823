"""Tensor and expert parallelism over two processes: stock transformers and transfuse side by side.

    torchrun --nproc-per-node 2 benchmarks/bench_parallel.py --out DIR [--model llama qwen3_moe]
        [--new 64] [--rounds 3] [--train-tokens 2048]
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_parallel.py --out DIR --tiny --backend gloo

Models (random bf16 weights on GPUs, fp32 with --tiny on CPU), written once by rank 0 and loaded by
every rank:

  llama      Llama-3-8B layer shapes, 8 layers, tensor parallelism over the two ranks
             (``tp_plan="auto"``). Variants: transformers TP eager; transfuse distributed first
             (``transfuse.from_pretrained(..., tp_plan="auto")``, merged from each rank's shards);
             transfuse rewritten first and distributed afterwards (the plan's
             ``transfuse_merged_colwise`` entries; only with ``transformers.distributed``, 5.20 and
             later: on 5.17 the variant is left out).
  qwen3_moe  Qwen3-MoE layer shapes, 4 layers, expert parallelism (``ep_size=2``, ``tp_plan="auto"``).
             Variants: transformers EP; transfuse EP (the fused MoE layer computes this rank's
             experts and sums the ranks' outputs). Every MoE block must be fused.

Measured per variant: decode time per token through ``generate`` (batch 1, greedy, (time with --new
tokens - time with 1 token) / (--new - 1), the median over --rounds rounds in which the variants take
turns); for qwen3_moe also a training step (forward and backward of --train-tokens tokens). The
logits of each variant on one prompt are compared with one process's (rank 0 loads the model
alone): the largest difference relative to the logit scale. Which decode path ran is written down
(``transfuse.compile.eager_steps.refusal``: the eager decode steps refuse sharded weights).

Rank 0 writes DIR/parallel.json (numbers, the command, versions, the device) and prints a table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

SHAPES = {
    "llama": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, num_hidden_layers=8, vocab_size=32000, rope_theta=500000.0,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=4, num_experts=128,
        num_experts_per_tok=8, vocab_size=32000, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}  # fmt: skip
TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=2, vocab_size=256),
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                      vocab_size=256),
}  # fmt: skip


def _say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def _write_model(name: str, root: str, tiny: bool, dtype: torch.dtype) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(root, f"{name}{'-tiny' if tiny else ''}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        shapes = {**SHAPES[name], **(TINY[name] if tiny else {})}
        config = AutoConfig.for_model(**shapes)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    dist.barrier()
    return path


def _ep_config(**extra):
    from transformers.distributed.configuration_utils import DistributedConfig

    taken = inspect.signature(DistributedConfig).parameters
    ep = {"ep_size": 2} if "ep_size" in taken else {"enable_expert_parallel": True}
    return DistributedConfig(**ep, **extra)


def _distribute_after(model):
    """transformers' distribution of a model already loaded (``transformers.distributed``); None where this
    transformers has none."""
    from transformers.distributed.configuration_utils import DistributedConfig

    if not hasattr(type(model), "maybe_distribute_model"):
        return None
    config, _, meshes = type(model).prepare_distribute_model(DistributedConfig(tp_plan="auto"))
    return type(model).maybe_distribute_model(model, config, meshes)


def _variants(name: str, path: str, dtype, device) -> dict:
    """name -> (model, note) for every variant of the model ``name``."""
    import transfuse
    from transformers import AutoModelForCausalLM

    load = dict(dtype=dtype)
    found = {}
    if name == "llama":
        found["transformers TP eager"] = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", **load)
        found["transfuse TP, distributed first"] = transfuse.from_pretrained(path, tp_plan="auto", **load)
        single = AutoModelForCausalLM.from_pretrained(path, **load).to(device).eval()
        first = _distribute_after(transfuse.rewrite(single))
        if first is not None:
            found["transfuse TP, rewritten first"] = transfuse.decode_steps(first)
    else:
        found["transformers EP"] = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=_ep_config(tp_plan="auto"), **load
        )
        found["transfuse EP"] = transfuse.from_pretrained(path, distributed_config=_ep_config(tp_plan="auto"), **load)
    return {k: m.eval() for k, m in found.items()}


def _path_of(model) -> str:
    import transfuse

    if not transfuse.is_rewritten(model):
        return "transformers eager"
    from transfuse.compile import eager_steps

    with torch.no_grad():  # as generate asks
        refused = eager_steps.refusal(model)
    return "transfuse eager decode steps" if refused is None else f"transfuse eager forward (decode steps: {refused})"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _generate_time(model, ids, new: int, device) -> float:
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        _sync(device)
        long = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        _sync(device)
        short = time.perf_counter() - start
    return (long - short) / (new - 1)


def _train_time(model, tokens: int, vocab: int, device) -> float:
    ids = torch.randint(0, vocab, (1, tokens), device=device, generator=None)
    model.train()
    _sync(device)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    _sync(device)
    took = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    model.eval()
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", nargs="+", default=["llama", "qwen3_moe"], choices=sorted(SHAPES))
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--train-tokens", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run: CPU and gloo)")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    args = parser.parse_args()
    if args.tiny:
        args.new, args.rounds, args.train_tokens, args.prompt = min(args.new, 4), 1, 32, 8

    cuda = args.backend == "nccl"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(args.backend)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    os.makedirs(args.out, exist_ok=True)
    import transformers

    from transformers import AutoModelForCausalLM

    results = {
        "command": " ".join(["torchrun --nproc-per-node", str(dist.get_world_size()), *sys.argv]),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "backend": args.backend, "models": {},
    }  # fmt: skip
    for name in args.model:
        path = _write_model(name, args.out, args.tiny, dtype)
        variants = _variants(name, path, dtype, device)
        vocab = next(iter(variants.values())).config.vocab_size
        ids = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(device)
        single = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        with torch.no_grad():
            reference = single(input_ids=ids).logits.float()
        del single
        rows = {}
        for label, model in variants.items():
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
            report = None
            import transfuse

            if transfuse.is_rewritten(model):
                report = transfuse.report(model).counts()
            rows[label] = {
                "logits_vs_one_process": (logits - reference).abs().max().item() / reference.abs().max().item(),
                "fusions": report,
                "decode_path": _path_of(model),
                "decode_s_per_token": [],
                "train_step_s": [],
            }
        for label, model in variants.items():  # warm-up, not timed
            _generate_time(model, ids, 2, device)
            if name == "qwen3_moe":
                _train_time(model, args.train_tokens, vocab, device)
        for _ in range(args.rounds):
            for label, model in variants.items():
                rows[label]["decode_s_per_token"].append(_generate_time(model, ids, args.new, device))
                if name == "qwen3_moe":
                    rows[label]["train_step_s"].append(_train_time(model, args.train_tokens, vocab, device))
        base = next(iter(rows))
        for label, row in rows.items():
            row["decode_median"] = statistics.median(row["decode_s_per_token"])
            row["decode_speedup_vs_stock"] = statistics.median(rows[base]["decode_s_per_token"]) / row["decode_median"]
            if row["train_step_s"]:
                row["train_median"] = statistics.median(row["train_step_s"])
                row["train_speedup_vs_stock"] = statistics.median(rows[base]["train_step_s"]) / row["train_median"]
            _say(f"{name:10s} {label:34s} decode {row['decode_median'] * 1e3:8.3f} ms/token "
                 f"x{row['decode_speedup_vs_stock']:.2f}  logits {row['logits_vs_one_process']:.1e}  "
                 f"{row['decode_path']}  {row['fusions']}"
                 + (f"  train {row['train_median'] * 1e3:.1f} ms x{row['train_speedup_vs_stock']:.2f}"
                    if row["train_step_s"] else ""))  # fmt: skip
        results["models"][name] = rows
        del variants
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "parallel.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
