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

_prebuild = None


def pytest_collection_finish(session) -> None:
    """Where the run tests kernels at several levels, compile those builds in a low-priority
    process now (kvserve/kernels/prebuild.py), on cores the first tests leave idle, instead
    of one after another when the kernel tests reach each level (a fresh clone compiles about
    two minutes of C++ per level on 2 cores)."""
    global _prebuild
    from tests.support.kernel_levels import KERNEL_LEVELS

    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0" or not any(
        "kernel_level" in getattr(item, "fixturenames", ()) for item in session.items
    ):
        return
    import subprocess
    import sys

    from kvserve.kernels.isa import chosen_level

    native = chosen_level()
    levels = sorted(KERNEL_LEVELS, key=lambda lv: lv != native)  # the one every engine test needs first
    if levels:
        _prebuild = subprocess.Popen(
            [sys.executable, "-m", "kvserve.kernels.prebuild", *levels],
            preexec_fn=lambda: os.nice(19), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip


def pytest_sessionfinish(session, exitstatus) -> None:
    if _prebuild is not None and _prebuild.poll() is None:
        _prebuild.terminate()  # it stops its compilers and gives back its build's lock (prebuild.py)
        try:
            _prebuild.wait(timeout=30)
        except Exception:
            _prebuild.kill()
