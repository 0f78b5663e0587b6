"""Fixtures of the runtime tests: the launcher to run a lab with, and a mark for its processes."""
from __future__ import annotations

import uuid

import pytest

from proctools import processes_marked


@pytest.fixture(params=["pool", "torchrun"])
def launcher(request):
    """Each test that takes it runs once per launcher."""
    return request.param


@pytest.fixture
def mark():
    """A fresh mark for the test's processes; none may be alive when the test ends."""
    value = uuid.uuid4().hex
    yield value
    assert processes_marked(value) == [], "processes of the lab survived it"
