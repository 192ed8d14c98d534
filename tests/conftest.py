from __future__ import annotations

import os

import pytest
import torch

from tests.support.tiny_models import TINY_VARIANTS, make_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: str(make_tiny_model(root / name, **kw)) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama-gqa"]


# ---- kernel builds beside the first tests -----------------------------------------------------

_prebuilds: list = []


def _prebuild(levels: list[str]) -> None:
    """Compile kernel levels in a low-priority process (kvserve/kernels/prebuild.py), on cores
    the tests leave idle; a test that needs a level first waits for its build (the build's
    lock), and the session's end stops what is left (prebuild.py stops cleanly)."""
    import subprocess
    import sys

    if levels and os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0":
        _prebuilds.append(subprocess.Popen(
            [sys.executable, "-m", "kvserve.kernels.prebuild", *levels],
            preexec_fn=lambda: os.nice(19), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip


def pytest_sessionstart(session) -> None:
    """The chosen level, which nearly every engine test needs, from the start: it compiles
    while the tests are collected (a fresh clone compiles about a minute of C++ a level)."""
    from kvserve.errors import ConfigError
    from kvserve.kernels.isa import chosen_level

    try:
        native = chosen_level()
    except ConfigError:  # KVSERVE_CPU_ISA names a level this CPU lacks: the tests say so themselves
        return
    _prebuild([native] if native else [])


def pytest_collection_finish(session) -> None:
    """Where the run tests kernels at every level, the other levels too."""
    from kvserve.kernels import isa
    from tests.support.kernel_levels import KERNEL_LEVELS

    if any("kernel_level" in getattr(item, "fixturenames", ()) for item in session.items):
        # the level each test forces, not KVSERVE_CPU_ISA's: KERNEL_LEVELS are all this CPU runs
        native = isa.native_level()
        _prebuild([lv for lv in KERNEL_LEVELS if lv != native])


def pytest_sessionfinish(session, exitstatus) -> None:
    for proc in _prebuilds:
        if proc.poll() is None:
            proc.terminate()
    for proc in _prebuilds:
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
