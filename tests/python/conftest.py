"""Fixtures of the Python package's tests: one moecl.Context on the device
MOECL_DEVICE (or moecl's default) picks, and fresh random generators whose
seed a failure reports."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

import moecl


@pytest.fixture(scope="session")
def ctx():
    with moecl.Context() as c:
        yield c


@pytest.fixture
def rng(request):
    """A generator on a fresh seed; MOECL_TEST_SEED replays one."""
    seed = int(os.environ.get("MOECL_TEST_SEED") or secrets.randbits(32))
    request.node.user_properties.append(("seed", seed))
    print("MOECL_TEST_SEED=%d" % seed)  # shown by pytest on failure
    return np.random.default_rng(seed)
