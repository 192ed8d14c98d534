"""`python -m kvserve.kernels.prebuild`: builds levels ahead of use, refuses a level the CPU
lacks with a message, and stopped mid-build leaves no lock behind (a later process would
otherwise wait on it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.kernels import cpu_ops
from kvserve.kernels.isa import LEVELS, chosen_level, runnable_levels

needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="no kernel level runs here")


def _prebuild(*levels: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.kernels.prebuild", *levels], capture_output=True, text=True,
                          timeout=600, **kw)  # fmt: skip


@needs_kernels
def test_a_built_level_is_found_and_loaded():
    done = _prebuild(chosen_level())
    assert done.returncode == 0, done.stderr


def test_a_level_the_cpu_lacks_is_refused_by_name():
    missing = [lv for lv in LEVELS if lv not in runnable_levels()]
    for level in [*missing[:1], "sse2"]:
        done = _prebuild(level)
        assert done.returncode == 2 and f"'{level}'" in done.stderr and "Traceback" not in done.stderr


@needs_kernels
def test_stopped_mid_build_it_leaves_no_lock(tmp_path):
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.kernels.prebuild", chosen_level()], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    kernels = tmp_path / "kernels"
    deadline = time.monotonic() + 60
    while not list(kernels.glob("*/lock")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(kernels.glob("*/lock")), "the build never started"
    time.sleep(1)  # ninja and its compilers under way
    proc.send_signal(signal.SIGTERM)  # as the test session stops it
    assert proc.wait(timeout=30) != 0
    assert list(kernels.glob("*/lock")) == [] and list(kernels.glob("*/*.so")) == []
    # no ninja or compiler of that build left running (they run in its folder)
    left = [p.name for p in Path("/proc").glob("[0-9]*") if _cwd(p).startswith(str(kernels))]
    assert left == []


def _cwd(proc: Path) -> str:
    try:
        return os.readlink(proc / "cwd")
    except OSError:
        return ""
