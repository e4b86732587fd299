"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
from store_faults import Rig


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()
