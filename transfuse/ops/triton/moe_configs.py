"""Tile configurations of the Triton fused MoE: which path and tiles a batch gets, fitted to shared memory.

``transfuse.ops.triton.moe`` has two paths for ``moe_experts``:

* **decode** (``DecodeConfig``), for a few (token, slot) pairs: no token grouping; one kernel
  whose programs are (pair, block of intermediate features) and one whose programs are
  (token, block of output features) and add up the token's k pairs. It reads each pair's
  expert weights once, with many programs in flight; re-reads of an expert that two
  tokens share grow with the batch, hence the bound ``DECODE_MAX_PAIRS``.
* **grouped** (``MoEConfig``), for everything else: pairs grouped by expert into blocks of
  ``block_m`` rows, then two grouped GEMMs.

``config_for`` picks the regime's entry of ``CONFIGS``. ``benchmarks/bench_moe.py`` times the
``TUNING_CANDIDATES`` of each regime on the GPU and writes a replacement for ``CONFIGS`` (and
for ``DECODE_MAX_PAIRS``) into its report, to paste here.

Shared memory: Triton keeps up to ``num_stages`` tiles of each pipelined load in shared memory,
so the same tiles take twice the bytes in float32 as in bfloat16. ``fit`` shrinks a configuration
until ``num_stages`` times the bytes one stage loads fits the device's limit (fewer stages first,
then smaller K and N blocks; never ``block_m``, for which the token grouping is laid out).
Counting all ``num_stages`` stages (Triton allocates one fewer) leaves room for the scratch of
the epilogue's reductions and layout conversions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace

__all__ = [
    "CONFIGS", "DECODE_MAX_PAIRS", "INVARIANT_CONFIG", "TUNING_CANDIDATES", "DecodeConfig", "MoEConfig", "config_for",
    "fit", "invariant_config", "k_pad", "regime", "shared_memory_limit", "token_thresholds", "using_config",
]  # fmt: skip


def k_pad(top_k: int) -> int:
    """The slots of a token as a power-of-two tile (at least 2)."""
    return max(2, 1 << (top_k - 1).bit_length())


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of the grouped path's two GEMMs (the gate/up kernel loads an A tile and two B tiles)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def describe(self) -> str:
        return f"M{self.block_m} N{self.block_n} K{self.block_k} w{self.num_warps} s{self.num_stages}"

    def stage_bytes(self, element_size: int, top_k: int) -> int:
        return (self.block_m * self.block_k + 2 * self.block_k * self.block_n) * element_size

    def smaller(self) -> MoEConfig:
        """One step down: a stage, else half of K, else half of N (each kept at 32 and more)."""
        if self.num_stages > 2:
            return replace(self, num_stages=self.num_stages - 1)
        if self.block_k > 32:
            return replace(self, block_k=self.block_k // 2)
        if self.block_n > 32:
            return replace(self, block_n=self.block_n // 2)
        return replace(self, num_stages=1) if self.num_stages > 1 else self


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes of the decode path: the gate/up kernel's block of intermediate features and of
    the hidden size it reduces over; the down kernel's block of output features and of the
    intermediate size it reduces over (for all k slots of a token at once)."""

    gate_up_n: int
    gate_up_k: int
    down_n: int
    down_k: int
    num_warps: int
    num_stages: int

    def describe(self) -> str:
        return (
            f"decode gate/up N{self.gate_up_n} K{self.gate_up_k}, down N{self.down_n} K{self.down_k}, "
            f"w{self.num_warps} s{self.num_stages}"
        )

    def down_block_k(self, top_k: int) -> int:
        """The down kernel's K block for ``top_k`` slots: the tile [slots, N, K] keeps the size it has at 8 slots."""
        return max(16, min(self.down_k, self.down_k * 8 // k_pad(top_k)))

    def stage_bytes(self, element_size: int, top_k: int) -> int:
        gate_up = (2 * self.gate_up_n + 1) * self.gate_up_k
        down = k_pad(top_k) * (self.down_n + 1) * self.down_block_k(top_k)
        return max(gate_up, down) * element_size

    def smaller(self) -> DecodeConfig:
        """One step down: a stage, else half of the larger K block (each kept at 32 and more)."""
        if self.num_stages > 1:
            return replace(self, num_stages=self.num_stages - 1)
        if self.gate_up_k >= self.down_k and self.gate_up_k > 32:
            return replace(self, gate_up_k=self.gate_up_k // 2)
        if self.down_k > 32:
            return replace(self, down_k=self.down_k // 2)
        return self


Config = MoEConfig | DecodeConfig

# (token, slot) pairs up to which the decode path runs (and never more pairs than experts: past
# that, pairs share experts and per-pair programs would read those experts' weights again). At 64
# pairs (8 tokens at top-8 of 128 experts) ~52 experts are touched, so ~1/4 of the weights are read
# twice, mostly while the first read is still in L2; the grouped path instead pays a grouping
# kernel, a combining kernel and mostly-empty blocks of rows.
DECODE_MAX_PAIRS = 64

# Defaults per regime, for bf16 on an H100/H200 (float32 is fitted to shared memory by ``fit``).
# decode: weight bandwidth: small N blocks for many programs (1 token, top-8, intermediate 768:
#   8 x 48 gate/up programs, 256 down programs), a long K run per row of weights, each program's
#   16 KB of loads per step in flight with those of the other 2-3 programs on its SM. Its loads
#   feed no tl.dot, so they are pipelined only through the loop's stage count: four stages were
#   fastest in the H200 sweep.
# tiny / small: still weight-bound, one or a few rows per expert: small M, wide K, deep pipeline.
# medium / large: compute-bound: tiles large enough to reuse each weight tile across rows.
CONFIGS: dict[str, Config] = {
    "decode": DecodeConfig(16, 128, 8, 64, 4, 4),  # H200 sweep (benchmarks/results/h200_moe_tile_sweep_2026-11-29.md): fastest at 1 token
    "tiny": MoEConfig(16, 32, 256, 4, 3),
    "small": MoEConfig(32, 128, 64, 4, 4),  # H200 sweep: fastest at 256 tokens
    "medium": MoEConfig(64, 128, 64, 4, 3),
    "large": MoEConfig(128, 128, 64, 8, 3),
}

# Alternatives per regime that the benchmark times next to the default (benchmarks/bench_moe.py).
TUNING_CANDIDATES: dict[str, tuple[Config, ...]] = {
    "decode": (
        DecodeConfig(16, 256, 8, 128, 4, 3),
        DecodeConfig(8, 512, 8, 128, 4, 2),
        DecodeConfig(16, 128, 8, 64, 4, 4),
        DecodeConfig(32, 128, 16, 64, 4, 3),
        DecodeConfig(16, 256, 16, 64, 8, 1),
        DecodeConfig(32, 256, 4, 256, 8, 2),
    ),
    "tiny": (
        MoEConfig(16, 64, 128, 4, 4),
        MoEConfig(16, 128, 64, 4, 4),
        MoEConfig(16, 32, 128, 4, 4),
        MoEConfig(16, 64, 256, 8, 3),
    ),
    "small": (
        MoEConfig(16, 64, 128, 4, 4),
        MoEConfig(32, 128, 64, 4, 4),
        MoEConfig(32, 32, 256, 4, 3),
        MoEConfig(64, 64, 64, 4, 4),
    ),
    "medium": (
        MoEConfig(32, 64, 128, 4, 4),
        MoEConfig(64, 64, 64, 4, 4),
        MoEConfig(128, 128, 64, 8, 3),
    ),
    "large": (
        MoEConfig(128, 128, 64, 8, 4),
        MoEConfig(64, 128, 64, 4, 4),
        MoEConfig(128, 64, 64, 4, 4),
        MoEConfig(128, 128, 32, 8, 4),
        MoEConfig(64, 128, 64, 8, 3),
    ),
}

# Batch-invariant mode (``dispatch.batch_invariant_mode``): the grouped path with these tiles for
# every token count. A pair's products are summed along the hidden (and intermediate) size in
# steps of ``block_k`` into one float32 accumulator, whatever block of rows the pair sits in and
# whatever else is in it; the slots of a token are added in slot order. So a token's output does
# not depend on the batch. The decode path sums each row another way (elementwise products, then a
# reduction across the K block) and is not used there. Of the tile sets measured with block_k 64
# (every one gave a token the same bits alone and among 8 to 2048 others), this one was fastest or
# near it at most token counts on an H100 with Qwen3-MoE expert shapes
# (``benchmarks/results/h100_invariant_moe_218feb1_2026-12-07.md``).
INVARIANT_CONFIG = MoEConfig(64, 64, 64, 4, 3)

_FORCED: list[Config] = []


# The bounds of the grouped regimes in (token, slot) pairs per expert: "tiny" up to the first, etc.
_PER_EXPERT = (("tiny", 2), ("small", 24), ("medium", 96))


def token_thresholds(top_k: int, experts: int) -> tuple[int, ...]:
    """The token counts at which ``regime`` changes: the first count of each next regime."""
    bounds = [min(DECODE_MAX_PAIRS, experts) // top_k] + [limit * experts // top_k for _, limit in _PER_EXPERT]
    return tuple(sorted({b + 1 for b in bounds if b >= 0}))


def regime(tokens: int, top_k: int, experts: int) -> str:
    """The regime of ``tokens`` tokens routed to ``top_k`` of ``experts`` experts: "decode" for
    the decode path, else the grouped path's by pairs per expert."""
    pairs = tokens * top_k
    if pairs <= min(DECODE_MAX_PAIRS, experts):
        return "decode"
    per_expert = pairs / max(experts, 1)
    return next((name for name, limit in _PER_EXPERT if per_expert <= limit), "large")


def config_for(tokens: int, top_k: int, experts: int) -> Config:
    """The path and tiles for this batch: the innermost ``using_config``, else ``CONFIGS`` by regime."""
    return _FORCED[-1] if _FORCED else CONFIGS[regime(tokens, top_k, experts)]


def invariant_config() -> Config:
    """The path and tiles of every batch in batch-invariant mode: the innermost ``using_config``
    (for tuning), else ``INVARIANT_CONFIG``."""
    return _FORCED[-1] if _FORCED else INVARIANT_CONFIG


@contextlib.contextmanager
def using_config(config: Config) -> Iterator[None]:
    """Run every ``moe_experts`` call inside the block with ``config`` (and so its path), for tuning."""
    _FORCED.append(config)
    try:
        yield
    finally:
        _FORCED.pop()


# Per-block shared memory every CUDA GPU grants without opting in: the limit when the device's
# own cannot be read.
FALLBACK_SHARED_MEMORY = 48 * 1024
# Kept free below the device's limit, for Triton's own scratch that the estimate does not count.
SHARED_MEMORY_MARGIN = 8 * 1024


@functools.cache
def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one program may use on this CUDA device (the opt-in maximum Triton checks)."""
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except (AttributeError, KeyError, RuntimeError, TypeError):  # an older or different Triton driver
        pass
    try:
        import torch

        return int(torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin)
    except (AttributeError, RuntimeError, AssertionError):
        return FALLBACK_SHARED_MEMORY


@functools.lru_cache(maxsize=256)
def fit(config: Config, element_size: int, top_k: int, limit: int) -> Config:
    """``config``, shrunk until ``num_stages`` stages of its loads fit ``limit`` bytes less the margin."""
    budget = limit - SHARED_MEMORY_MARGIN
    while config.num_stages * config.stage_bytes(element_size, top_k) > budget:
        smaller = config.smaller()
        if smaller == config:
            break
        config = smaller
    return config
