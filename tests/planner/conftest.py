"""Shared fixtures for planner tests: the seed's §6 setup and a throwaway cache dir."""

from __future__ import annotations

import pytest

from kvserve.planner.examples import seed_70b_inputs


@pytest.fixture
def seed_inputs():
    """§5–§6: 70B int8 on 16 seed chips, 2 GB reserved, S=8192, 12 ms target."""
    return seed_70b_inputs()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
