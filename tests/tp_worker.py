"""One rank of the tensor-parallel checks (``tests/test_tensor_parallel.py`` launches two over gloo).

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py DIR FAMILY ... [--ep FAMILY ...] \
        [--rewritten-first FAMILY ...] [--fully-sharded FAMILY ...]

DIR holds, per FAMILY, a tiny checkpoint ``DIR/FAMILY`` and its emitted form ``DIR/FAMILY-emitted``.
Each rank loads the checkpoint three ways (one process, stock TP, transfuse's drop-in with TP),
checks fusions, logits, a training step's gradients, ``save_pretrained`` and the emitted form,
and prints ``ok tp FAMILY`` (rank 0) when all hold; any failure raises. The families after ``--ep``
are loaded with expert parallelism over the two ranks instead (``ep_size=2``): every MoE block is
fused, computes this rank's experts, and the logits and a training step's gradients are one
process's (``ok ep FAMILY``). Those after ``--rewritten-first`` are rewritten in one process and
distributed afterwards: their merged projections hold each rank's rows as a model distributed
first does. Those after ``--fully-sharded`` are trained under FSDP2. The groups run in turn, in one
launch (each launch starts two processes that import torch, transformers and transfuse).
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist

import transfuse
from transfuse.ops import MergedProjection, MoE
from transfuse.ops.moe_layer import layer_expert_shards
from transfuse.ops.sharding import is_sharded


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _full(tensor):
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def _local(tensor):
    return tensor.to_local() if is_sharded(tensor) else tensor


def _check(root: str, family: str) -> None:
    from transformers import AutoModelForCausalLM

    path = f"{root}/{family}"
    single = AutoModelForCausalLM.from_pretrained(path).eval()
    stock = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    fused = transfuse.from_pretrained(path, tp_plan="auto")
    expected = transfuse.report(transfuse.rewrite(AutoModelForCausalLM.from_pretrained(path).eval())).counts()
    report = transfuse.report(fused)
    counts = report.counts()
    dense = {k: v for k, v in expected.items() if k in ("qkv", "gate_up")}
    assert dense and all(counts.get(k) == v for k, v in dense.items()), (family, counts, expected)
    # MoE blocks whose experts tensor parallelism shards are refused, with that reason; so are norms whose
    # forward the plan wrapped (it sums their weight's gradient over the ranks).
    # (gpt_oss's RoPE arithmetic is refused by name in one process too: ``rotary.form``.)
    assert all(s.tag in ("moe.sharded", "rms_norm.wrapped", "rotary.form") for s in report.skipped), (family, report.skipped)
    # Merged from shards exactly where the plan sharded the parts (gpt_oss's plan shards no layer).
    stock_modules = dict(stock.named_modules())
    merged = {n: m for n, m in fused.named_modules() if isinstance(m, MergedProjection)}
    assert merged, family
    for name, module in merged.items():
        part = stock_modules[f"{name.rpartition('.')[0]}.{module.parts[0]}"]
        assert (module.shards is not None) == is_sharded(part.weight), (family, name)
        if module.shards is not None:  # GQA: each part is sharded by its own heads
            assert module.split_sizes == tuple(s // dist.get_world_size() for s in module.shards.full_sizes)

    ids = torch.randint(0, single.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    tp_logits = _logits(stock, ids)
    # Equal to stock TP but for float32 roundings (deepseek_v3's flattened shared-expert activation
    # rounds once differently, as it does in one process); TP itself sums in another order.
    fused_error = (_logits(fused, ids) - tp_logits).abs().max().item()
    assert fused_error <= 1e-6, (family, fused_error)
    assert (tp_logits - _logits(single, ids)).abs().max().item() <= 1e-5, family

    # One training step: the loss, the input-side gradients (summed over the ranks through the
    # merged projections) and the merged weights' local gradients are those of stock TP.
    losses = []
    for model in (stock, fused):
        model.train()
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0), (family, losses)
    embed = [_full(m.get_input_embeddings().weight.grad) for m in (stock, fused)]
    assert torch.allclose(embed[0], embed[1], rtol=1e-5, atol=1e-7), family
    for name, module in merged.items():
        owner = name.rpartition(".")[0]
        parts = [_local(stock_modules[f"{owner}.{p}"].weight.grad) for p in module.parts]
        assert torch.allclose(_local(module.weight.grad), torch.cat(parts), rtol=1e-5, atol=1e-7), (family, name)
    # And every gradient within the fp32 rule of one process's (MoE experts that the plan shards by
    # features, computed by the fused layer, included).
    single.train()
    single(input_ids=ids, labels=ids).loss.backward()
    _check_gradients(fused, single)
    for model in (stock, fused, single):
        model.eval()

    # save_pretrained of the TP model writes the original checkpoint: full tensors, original keys.
    fused.zero_grad(set_to_none=True)
    fused.save_pretrained(f"{root}/{family}-saved-by-tp")
    dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(f"{root}/{family}-saved-by-tp").eval()
    assert reloaded.state_dict().keys() == single.state_dict().keys(), family
    for key, value in single.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), (family, key)

    # The emitted modeling file, loaded with tp_plan: its merges are made from the shards.
    emitted = AutoModelForCausalLM.from_pretrained(f"{root}/{family}-emitted", tp_plan="auto", trust_remote_code=True)
    emitted.eval()
    shards = [m.shards is not None for m in emitted.modules() if isinstance(m, MergedProjection)]
    assert shards == [m.shards is not None for m in merged.values()], family
    assert (_logits(emitted, ids) - tp_logits).abs().max().item() <= 1e-6, family
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"ok tp {family} {counts} (fused - stock TP logits: {fused_error:.1e})", flush=True)


def _check_expert_parallel(root: str, family: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    path = f"{root}/{family}"
    single = AutoModelForCausalLM.from_pretrained(path).eval()
    # Expert parallelism over the two ranks: ``ep_size`` in transformers 5.24, a flag over the TP ranks in 5.17.
    taken = inspect.signature(DistributedConfig).parameters
    ep = {"ep_size": 2} if "ep_size" in taken else {"enable_expert_parallel": True}
    stock = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**ep, tp_plan="auto"))
    fused = transfuse.from_pretrained(path, distributed_config=DistributedConfig(**ep, tp_plan="auto"))
    report = transfuse.report(fused)
    blocks = transfuse.report(transfuse.rewrite(AutoModelForCausalLM.from_pretrained(path).eval())).counts()["moe"]
    # Each rank holds half of the experts: every block is fused, and computes its experts on this rank.
    assert report.counts().get("moe") == blocks, (family, report.counts(), report.skipped)
    layers = [m for m in fused.modules() if isinstance(m, MoE)]
    assert len(layers) == blocks and all(layer_expert_shards(m, m.plan) is not None for m in layers), family
    ids = torch.randint(0, single.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    ep_logits = _logits(stock.eval(), ids)
    expected = _logits(single, ids)
    assert (ep_logits - expected).abs().max().item() <= 1e-5, family
    error = _within_fp32_rule(_logits(fused.eval(), ids), expected)

    # A training step: the loss and every gradient within the rule of one process's (an expert tensor's
    # as this rank's experts of one process's gradient).
    for model in (single, fused):
        model.train()
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        model.eval()
    _check_gradients(fused, single)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"ok ep {family} {report.counts()} (fused EP - one process logits: {error:.1e})", flush=True)


def _distribute(model, **config):
    """transformers' own distribution of a model already loaded: what ``from_pretrained`` does to a new
    model before it loads the weights (the plan's styles shard each parameter's rows in place)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    config, _, meshes = type(model).prepare_distribute_model(DistributedConfig(**config))
    return type(model).maybe_distribute_model(model, config, meshes)


def _within_fp32_rule(actual, expected, what=None) -> float:
    """The largest difference relative to the expected values' scale (at least 1): at most 1e-5."""
    error = (actual - expected).abs().max().item() / max(1.0, expected.abs().max().item())
    assert error <= 1e-5, (error, what)
    return error


def _check_gradients(model, single) -> None:
    """Every gradient of the distributed ``model`` within the fp32 rule of one process's: a merged
    projection's as this rank's rows of its parts' gradients, any other (sharded experts included) as
    the full tensor."""
    single_grads = {n: p.grad for n, p in single.named_parameters()}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, tensor = name.rpartition(".")
        module = modules[owner]
        if isinstance(module, MergedProjection):
            parent = owner.rpartition(".")[0]
            parts = [single_grads[f"{parent}.{part}.{tensor}"] for part in module.parts]
            if module.shards is not None:
                expected = torch.cat([module.shards.local(grad) for grad in parts])
                _within_fp32_rule(param.grad.to_local(), expected, name)
            else:
                _within_fp32_rule(param.grad, torch.cat(parts), name)
        else:
            _within_fp32_rule(_full(param.grad), single_grads[name], name)


def _check_rewritten_first(root: str, family: str) -> None:
    """A model rewritten in one process and distributed afterwards (the merged projections sharded by
    the plan's ``transfuse_merged_colwise`` entries) holds on each rank bitwise the weights of a model
    distributed first and merged from its shards; its logits, a training step's loss and gradients and
    its checkpoint are one process's."""
    from transformers import AutoModelForCausalLM

    path = f"{root}/{family}"
    single = AutoModelForCausalLM.from_pretrained(path).eval()
    later = transfuse.rewrite(AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval())
    first = transfuse.rewrite(AutoModelForCausalLM.from_pretrained(path).eval())
    plan = first.tp_plan
    first = _distribute(first, tp_plan="auto")
    counts = transfuse.report(first).counts()
    # The same merges (a norm the plan wraps is fused only where the rewrite came first: the plan then
    # wraps the fused norm).
    merges = {k: v for k, v in transfuse.report(later).counts().items() if k in ("qkv", "gate_up")}
    assert merges and all(counts.get(k) == v for k, v in merges.items()), (family, counts, merges)
    merged = {n: m for n, m in first.named_modules() if isinstance(m, MergedProjection)}
    later_modules = dict(later.named_modules())
    assert merged and any(style == "transfuse_merged_colwise" for style in plan.values()), (family, plan)
    for name, module in merged.items():
        other = later_modules[name]
        assert module.shards is not None and other.shards is not None, (family, name)
        assert module.split_sizes == other.split_sizes and module.shards.full_sizes == other.shards.full_sizes
        for tensor in ("weight", "bias"):
            mine, theirs = getattr(module, tensor), getattr(other, tensor)
            assert (mine is None) == (theirs is None), (family, name, tensor)
            if mine is not None:  # the same rows on this rank, bit for bit
                assert torch.equal(mine.to_local(), theirs.to_local()), (family, name, tensor)

    ids = torch.randint(0, single.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    logits_error = _within_fp32_rule(_logits(first, ids), _logits(single, ids))

    # A training step: the loss, and every parameter's gradient (a merged one's as this rank's rows of the
    # parts' gradients in one process) within the rule of one process's.
    for model in (single, first):
        model.train()
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    _check_gradients(first, single)
    for model in (single, first):
        model.eval()

    first.zero_grad(set_to_none=True)
    first.save_pretrained(f"{root}/{family}-saved-rewritten-first")
    dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(f"{root}/{family}-saved-rewritten-first").eval()
    assert reloaded.state_dict().keys() == single.state_dict().keys(), family
    for key, value in single.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), (family, key)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"ok rewritten-first {family} {counts} (logits - one process: {logits_error:.1e})", flush=True)


def _check_fully_sharded(root: str, family: str) -> None:
    """FSDP2 (``fully_shard`` of each decoder layer and of the model) of a model rewritten in each
    process, one sequence per rank: the loss averaged over the ranks and every gradient (gathered)
    within the fp32 rule of one process's on both sequences."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    path = f"{root}/{family}"
    single = AutoModelForCausalLM.from_pretrained(path)
    model = transfuse.rewrite(AutoModelForCausalLM.from_pretrained(path).eval())
    counts = transfuse.report(model).counts()
    assert counts.get("qkv") and counts.get("gate_up"), (family, counts)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, single.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    mine = ids[dist.get_rank() : dist.get_rank() + 1]
    single.train()
    model.train()
    expected_loss = single(input_ids=ids, labels=ids).loss
    expected_loss.backward()
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    averaged = loss.detach().clone()
    dist.all_reduce(averaged)
    _within_fp32_rule(averaged / dist.get_world_size(), expected_loss.detach())
    single_grads = {n: p.grad for n, p in single.named_parameters()}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, tensor = name.rpartition(".")
        module = modules[owner]
        if isinstance(module, MergedProjection):
            parent = owner.rpartition(".")[0]
            expected = torch.cat([single_grads[f"{parent}.{part}.{tensor}"] for part in module.parts])
        else:
            expected = single_grads[name]
        _within_fp32_rule(_full(param.grad), expected, name)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"ok fully-sharded {family} {counts} (FSDP2 loss {averaged.item() / dist.get_world_size():.6f})", flush=True)


CHECKS = {
    "--ep": _check_expert_parallel,
    "--rewritten-first": _check_rewritten_first,
    "--fully-sharded": _check_fully_sharded,
}


def main() -> int:
    root, check = sys.argv[1], _check
    for arg in sys.argv[2:]:
        if arg in CHECKS:
            check = CHECKS[arg]
        else:
            check(root, arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
