"""CI's share of the fuzzing (``tests/fuzz.py``): a fixed, seeded run of generated modules, each
fused with the original's numbers or refused with a tag. The big run is
``python -m tests.fuzz --examples 2000``."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, seed, settings

from tests.fuzz import FAILURES, examples, run_example

CI_EXAMPLES = 300


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fuzz"))


@seed(20261201)
@settings(max_examples=CI_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(example=examples())
def test_every_generated_module_is_fused_exactly_or_refused_with_a_tag(example, directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcome = run_example(example, directory)
    assert outcome.verdict not in FAILURES, f"{outcome.verdict}: {outcome.detail}\n{example.describe()}"
