"""The Triton MoE's tile tables and their fit to shared memory (plain Python: no GPU, no Triton)."""

from __future__ import annotations

import pytest
import torch

from transfuse.ops.triton.moe_configs import (
    CONFIGS, SHARED_MEMORY_MARGIN, TUNING_CANDIDATES, DecodeConfig, MoEConfig, config_for, fit, regime,
)  # fmt: skip

# The per-program shared memory of an H100/H200 (opt-in maximum), as Triton reported it on the H200.
HOPPER = 232448
EVERY_CONFIG = sorted({*CONFIGS.values(), *(c for cs in TUNING_CANDIDATES.values() for c in cs)}, key=str)


def _bytes(config, element_size: int, top_k: int) -> int:
    return config.num_stages * config.stage_bytes(element_size, top_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("limit", [HOPPER, 101376, 48 * 1024], ids=["hopper", "sm86", "fallback"])
def test_every_configuration_fits_the_shared_memory_once_fitted(dtype, limit):
    element_size = torch.empty((), dtype=dtype).element_size()
    for config in EVERY_CONFIG:
        for top_k in (1, 2, 8, 16):
            fitted = fit(config, element_size, top_k, limit)
            assert _bytes(fitted, element_size, top_k) <= limit - SHARED_MEMORY_MARGIN, (config, fitted)
            assert type(fitted) is type(config)
            if isinstance(config, MoEConfig):  # the token grouping is laid out for block_m
                assert fitted.block_m == config.block_m
            if limit == HOPPER and element_size == 2 and top_k <= 8:  # the tables are for 16-bit on Hopper
                assert fitted == config


def test_the_float32_tiles_that_failed_on_the_h200_are_shrunk():
    """M16 N64 K128 s4 in float32 needed 245760 bytes on the H200 (limit 232448); the estimate
    counts at least that much, and the fitted tiles fit."""
    failed = MoEConfig(16, 64, 128, 4, 4)
    assert _bytes(failed, 4, 2) >= 245760
    fitted = fit(failed, 4, 2, HOPPER)
    assert fitted.num_stages < failed.num_stages and _bytes(fitted, 4, 2) <= HOPPER - SHARED_MEMORY_MARGIN
    assert fit(failed, 2, 2, HOPPER) == failed


def test_shrinking_ends_at_the_smallest_configuration():
    for config in (MoEConfig(128, 128, 64, 8, 4), DecodeConfig(16, 256, 8, 128, 4, 3)):
        steps = [config]
        while steps[-1].smaller() != steps[-1]:
            steps.append(steps[-1].smaller())
        assert len(steps) < 12 and steps[-1].num_stages == 1


def test_the_regime_decides_the_path():
    assert isinstance(config_for(1, 8, 128), DecodeConfig) and isinstance(config_for(16, 8, 128), MoEConfig)
    # Never more pairs than experts on the decode path: 8 experts, top-2.
    assert [regime(t, 2, 8) for t in (4, 5)] == ["decode", "tiny"]
    assert [regime(t, 8, 128) for t in (1, 8, 16, 256, 1024, 4096)] == [
        "decode", "decode", "tiny", "small", "medium", "large",
    ]  # fmt: skip
