"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TRACES


@pytest.fixture
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.skip("shared traces folder not present beside the repository")
    return TRACES
