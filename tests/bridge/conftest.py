"""Fixtures shared by the bridge tests."""

import pytest

import jaxtorch
from tests._dtypes import enable_x64


@pytest.fixture
def env():
    """jaxtorch's dispatch modes on (`jaxtorch.default_env()`) for the test."""
    with jaxtorch.default_env():
        yield


@pytest.fixture
def x64():
    """JAX's 64-bit mode on for the test."""
    with enable_x64():
        yield
