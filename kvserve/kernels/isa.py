"""The CPU's kernel levels: which instruction-set level each kernel build targets, which of
them this CPU runs, and the one kvserve uses (the highest, unless forced lower).

A level is a named set of instructions the kernels may use, compiled with that level's
explicit flags (never -march=native, so one cache folder serves any machine of the level):

    avx2         x86-64-v3: AVX2, FMA, F16C, BMI2 (Haswell, Zen 1-3, Intel client chips)
    avx512       x86-64-v4: AVX-512 F, BW, VL, DQ (Skylake-SP, Cascade Lake)
    avx512-vnni  + VPDPBUSD (Cascade Lake, Ice Lake)
    avx512-bf16  + VDPBF16PS (Zen 4/5, Cooper Lake, Sapphire Rapids)
    amx          + AMX-BF16 tiles (Sapphire Rapids and later)

Forcing: `KVSERVE_CPU_ISA=LEVEL` or `--cpu-isa LEVEL` (the engine config) picks a lower
level than the CPU's own; a higher one than the CPU runs is a clear error, never an illegal
instruction. The CPU's features come from the kernel's view of them (/proc/cpuinfo flags),
which Linux clears for state the OS did not enable in XCR0 (AVX-512 or AMX tiles switched
off by the kernel or the hypervisor), so a listed flag is one this process may use.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from kvserve.errors import ConfigError

# lowest first; each level runs everything the ones before it run
LEVELS: tuple[str, ...] = ("avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx")

# /proc/cpuinfo flags each level needs (on top of the levels below it)
_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "popcnt"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "avx512-vnni": ("avx512_vnni",),
    "avx512-bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}

ENV_VAR = "KVSERVE_CPU_ISA"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them, read once."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has(flag: str) -> bool:
    """A /proc/cpuinfo flag of this CPU (e.g. avx512_vnni)."""
    return flag in cpu_flags()


def missing_flags(level: str, flags: frozenset[str] | None = None) -> list[str]:
    """The flags `level` needs that the CPU lacks (its own and every lower level's)."""
    flags = cpu_flags() if flags is None else flags
    need = [f for lv in LEVELS[: LEVELS.index(level) + 1] for f in _FLAGS[lv]]
    return [f for f in need if f not in flags]


def runnable_levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Every level this CPU executes, lowest first (empty off x86 or below x86-64-v3)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    return tuple(lv for lv in LEVELS if not missing_flags(lv, flags))


def native_level(flags: frozenset[str] | None = None) -> str | None:
    """The highest level this CPU runs, or None."""
    levels = runnable_levels(flags)
    return levels[-1] if levels else None


def check_level(level: str, source: str) -> str:
    """`level` if it names a level this CPU runs; else a ConfigError naming `source`."""
    if level not in LEVELS:
        raise ConfigError(source, f"unknown CPU kernel level {level!r}; the levels are {', '.join(LEVELS)}")
    missing = missing_flags(level)
    if missing or platform.machine().lower() not in ("x86_64", "amd64"):
        runs = native_level()
        why = f"lacks {', '.join(missing)}" if missing else f"is {platform.machine()}, not x86-64"
        raise ConfigError(
            source,
            f"CPU kernel level {level!r} needs instructions this CPU does not have: it {why}"
            + (f" (the highest level it runs is {runs!r})" if runs else " (it runs none of the kernel levels)"),
        )
    return level


def chosen_level(forced: str | None = None) -> str | None:
    """The level kvserve's kernels run at: `forced` (--cpu-isa), else $KVSERVE_CPU_ISA, else
    the CPU's highest; None where the CPU runs no level. A forced level the CPU lacks raises."""
    if forced:
        return check_level(forced, "cpu_isa")
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return check_level(env, ENV_VAR)
    return native_level()


def cpu_supports_bf16() -> bool:
    """Whether oneDNN (torch's CPU matmuls) computes bf16 natively here: the plain-torch
    path's test for bf16 weights where no kernel level runs."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False
