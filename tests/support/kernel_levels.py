"""The kernel ISA levels the tests run at: every level this CPU executes that has a build of
its own (kvserve/kernels/build.py; `avx512` runs `avx2`'s build, so testing avx2 tests it)."""

from __future__ import annotations

from kvserve.kernels.build import LEVEL_BUILD
from kvserve.kernels.isa import runnable_levels

KERNEL_LEVELS: list[str] = [lv for lv in runnable_levels() if LEVEL_BUILD[lv] == lv]
