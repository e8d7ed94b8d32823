"""Tensor parallelism keeps the fusions: two CPU processes over gloo, ``from_pretrained(..., tp_plan="auto")``.

The checks run in ``tests/tp_worker.py`` (one process per rank, launched with torch.distributed.run);
here: merged projections built from each rank's shards, without DTensors, and the launch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import transfuse
from transfuse.rewriter.emit import emit
from transfuse.tiny import tiny_model

FAMILIES = ["llama", "qwen3", "qwen2", "gemma2", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
EXPERT_PARALLEL_FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]
REWRITTEN_FIRST_FAMILIES = ["llama", "qwen3", "qwen3_moe"]
FULLY_SHARDED_FAMILIES = ["llama"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch of ``tests/tp_worker.py`` over two processes for every test below (a launch starts
    two processes that import torch, transformers and transfuse): each test reads its own lines."""
    root = tmp_path_factory.mktemp("tp")
    for family in FAMILIES:
        tiny_model(family).save_pretrained(root / family)
        emit(transfuse.rewrite(tiny_model(family)), root / f"{family}-emitted")
    worker = os.path.join(os.path.dirname(__file__), "tp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFUSE_PROGRESS": "0"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker, str(root),
         *FAMILIES, "--ep", *EXPERT_PARALLEL_FAMILIES, "--rewritten-first", *REWRITTEN_FIRST_FAMILIES,
         "--fully-sharded", *FULLY_SHARDED_FAMILIES],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip


def _passed(launched, mode: str) -> list[str]:
    """The families whose ``mode`` checks passed (rank 0's ``ok MODE FAMILY`` lines), in order."""
    lines = [line.split() for line in launched.stdout.splitlines() if line.startswith("ok ")]
    return [words[2] for words in lines if words[1] == mode]


@pytest.mark.slow
def test_tp_over_two_processes_keeps_the_fusions_with_stock_tp_numbers(launched):
    assert _passed(launched, "tp") == FAMILIES, (launched.stdout + launched.stderr)[-6000:]


@pytest.mark.slow
def test_expert_parallelism_over_two_processes_keeps_the_fused_moe_with_one_process_numbers(launched):
    """Under ``ep_size=2`` each rank holds half of the experts: every MoE block is fused, its layer
    computes this rank's experts with the grouped kernels and sums the ranks' outputs; the logits and
    a training step's gradients are one process's (within the fp32 rule)."""
    assert _passed(launched, "ep") == EXPERT_PARALLEL_FAMILIES, (launched.stdout + launched.stderr)[-6000:]


@pytest.mark.slow
def test_a_model_rewritten_first_and_distributed_afterwards_is_sharded_like_one_merged_from_shards(launched):
    """The plan's ``transfuse_merged_colwise`` entries shard the merged projections of a model rewritten
    in one process, each rank keeping its q and k/v heads (its gate and up rows): bitwise the weights a
    model distributed first and merged from its shards holds; logits, gradients and the checkpoint
    are one process's."""
    passed = _passed(launched, "rewritten-first")
    assert passed == REWRITTEN_FIRST_FAMILIES, (launched.stdout + launched.stderr)[-6000:]


@pytest.mark.slow
def test_fully_sharded_training_of_a_rewritten_model_over_two_processes(launched):
    """FSDP2's ``fully_shard`` of a rewritten llama's layers and of the model, one sequence per rank: the
    loss and every gradient are one process's on both sequences (within the fp32 rule)."""
    passed = _passed(launched, "fully-sharded")
    assert passed == FULLY_SHARDED_FAMILIES, (launched.stdout + launched.stderr)[-6000:]
    assert launched.returncode == 0, (launched.stdout + launched.stderr)[-6000:]


def test_merging_refuses_row_parallel_parts_and_mixed_parts_with_reasons(monkeypatch):
    """The rules, on a one-rank gloo mesh in this process: column-parallel parts merge; a row-parallel
    (Shard(1)) part or a plain part among DTensors is refused with its reason."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        _check_rules(init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def _check_rules(mesh):
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from transfuse.rewriter.weights import MergeError, merge_linears

    def parent(placements):
        torch.manual_seed(0)
        module = nn.Module()
        for name, placement in zip(("a", "b"), placements):
            lin = nn.Linear(8, 6, bias=False)
            if placement is not None:
                lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [placement]))
            setattr(module, name, lin)
        return module

    x = torch.randn(3, 8)
    module = parent([Shard(0), Shard(0)])
    expected = torch.cat([module.a.weight.to_local(), module.b.weight.to_local()])
    merged = merge_linears(module, "ab", ["a", "b"])
    assert merged.shards is not None and merged.split_sizes == (6, 6)
    assert torch.equal(merged(x), x @ expected.T)
    assert torch.equal(module.a.weight.full_tensor(), expected[:6])  # the part, a DTensor view of its rows
    state = module.state_dict()
    assert sorted(state) == ["a.weight", "b.weight"] and torch.equal(state["b.weight"].full_tensor(), expected[6:])
    with pytest.raises(MergeError, match=r"a\.weight is sharded as \(Shard\(dim=1\),\): only column-parallel"):
        merge_linears(parent([Shard(1), Shard(0)]), "ab", ["a", "b"])
    with pytest.raises(MergeError, match=r"b\.weight is a plain tensor while other parts are DTensors"):
        merge_linears(parent([Shard(0), None]), "ab", ["a", "b"])


def test_expert_shardings_the_fused_moe_computes_and_those_it_refuses(monkeypatch):
    """On a one-rank gloo mesh in this process: whole experts per rank (``Shard(0)``) over ranks holding
    the same tokens, and features split as a tensor-parallel plan splits them, are computed; the same
    experts over ranks that may hold other tokens, or sharded another way, are refused with a reason."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from transfuse.ops.sharding import expert_shards

    assert not dist.is_initialized()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w13, w2 = torch.randn(4, 12, 8), torch.randn(4, 8, 6)  # [E, 2I, H], [E, H, I]

        def shards(a, b, shared_batch=True, bias=None):
            return expert_shards(
                distribute_tensor(w13, mesh, [a]), distribute_tensor(w2, mesh, [b]), bias, None,
                interleaved=False, w13_transposed=False, w2_transposed=False, shared_batch=shared_batch,
            )  # fmt: skip

        assert expert_shards(w13, w2, None, None, interleaved=False, w13_transposed=False, w2_transposed=False,
                             shared_batch=None) is None  # fmt: skip
        whole = shards(Shard(0), Shard(0))
        assert whole.whole_experts and whole.local_experts == 4
        features = shards(_StridedShard(1, split_factor=2), Shard(2), shared_batch=None)
        assert not features.whole_experts and features.local_experts == 4
        with pytest.raises(ValueError, match="may hold different tokens"):
            shards(Shard(0), Shard(0), shared_batch=False)
        with pytest.raises(ValueError, match="configuration is unknown"):
            shards(Shard(0), Shard(0), shared_batch=None)
        with pytest.raises(ValueError, match="sharded as"):
            shards(Shard(1), Shard(2))  # gate and up rows not each split by their own halves
        with pytest.raises(ValueError, match="with biases"):
            bias = distribute_tensor(torch.randn(4, 12), mesh, [Replicate()])
            shards(_StridedShard(1, split_factor=2), Shard(2), bias=bias)
        # Whole experts: the routes to other ranks' experts are masked, the gradients summed over the ranks.
        rows, weights, ids = whole.local_routes(torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[0, 3]] * 3))
        assert torch.equal(ids, torch.tensor([[0, 3]] * 3)) and bool((weights > 0).all())
    finally:
        dist.destroy_process_group()

