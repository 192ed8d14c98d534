"""Every kernel test runs at every ISA level this CPU executes (tests/support/kernel_levels.py).

Each test module that tests kernels keeps its `ops = cpu_ops()` (the native level's build,
for its collection-time marks); its tests are parametrised by level, and this fixture rebinds
that global to the level's build for each test and sets KVSERVE_CPU_ISA, so engines a test
builds run at the same level. A test marked `needs_amx` is skipped at levels without AMX tiles.
"""

from __future__ import annotations

import pytest

from kvserve.kernels import cpu_ops
from tests.support.kernel_levels import KERNEL_LEVELS


def pytest_generate_tests(metafunc) -> None:
    if "kernel_level" in metafunc.fixturenames and hasattr(metafunc.module, "ops") and KERNEL_LEVELS:
        metafunc.parametrize("kernel_level", KERNEL_LEVELS, indirect=True)


@pytest.fixture(autouse=True)
def kernel_level(request, monkeypatch):
    level = getattr(request, "param", None)
    if level is None:
        yield None
        return
    level_ops = cpu_ops(level)
    assert level_ops is not None, f"the {level} kernels failed to build on a CPU that runs them (see the log)"
    if request.node.get_closest_marker("needs_amx") and not level_ops.amx_available():
        pytest.skip(f"AMX tiles: not part of the {level} level" if level != "amx" else "AMX not granted to this process")
    monkeypatch.setattr(request.module, "ops", level_ops)
    monkeypatch.setenv("KVSERVE_CPU_ISA", level)
    yield level
