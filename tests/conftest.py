"""Shared fixtures."""

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A generator with a fresh seed per test (printed, and recorded in the report, so a failure
    can be replayed with np.random.default_rng(seed))."""
    seed = np.random.SeedSequence().entropy % 2**32
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
