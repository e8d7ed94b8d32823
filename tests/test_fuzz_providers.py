"""CI's share of the provider fuzzing (``tests/fuzz_providers.py``): 50 seeded cases of random
wrong providers, none kept. The big run is ``python -m tests.fuzz_providers --cases 500``."""

from __future__ import annotations

import random

import pytest

from tests.fuzz_providers import draw, run_case

_RNG = random.Random(20261205)
CASES = [draw(_RNG) for _ in range(50)]


@pytest.mark.parametrize("fault,dtype", CASES, ids=[f"{f.describe()}-{str(d)[6:]}" for f, d in CASES])
def test_a_random_wrong_provider_is_never_kept(fault, dtype):
    assert run_case(fault, dtype) == "refused", fault.describe()
