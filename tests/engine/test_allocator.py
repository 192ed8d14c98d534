"""The engine fixes glibc's malloc thresholds once (kvserve/memory.py), unless told not to."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _tuned(env_changes: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env_changes
    code = "from kvserve.memory import tune_malloc; print(tune_malloc())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_glibc_takes_the_thresholds():
    assert _tuned({}) == "True"


@pytest.mark.parametrize("env", [{"KVSERVE_MALLOC_TUNING": "0"}, {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_the_switch_or_the_users_own_malloc_settings_leave_glibc_alone(env):
    assert _tuned(env) == "False"
