"""The CPU's kernel levels: which instruction-set level each kernel build targets, which of
them this CPU runs, and the one kvserve uses (the highest, unless forced lower).

A level is a named set of instructions the kernels may use, compiled with that level's
explicit flags (never -march=native, so one cache folder serves any machine of the level):

    avx2         x86-64-v3: AVX2, FMA, F16C, BMI2 (Haswell, Zen 1-3, Intel client chips)
    avx512       x86-64-v4: AVX-512 F, BW, VL, DQ (Skylake-SP, Cascade Lake)
    avx512-vnni  + VPDPBUSD (Cascade Lake, Ice Lake)
    avx512-bf16  + VDPBF16PS (Zen 4/5, Cooper Lake, Sapphire Rapids)
    amx          + AMX-BF16 tiles (Sapphire Rapids and later)

and on aarch64 (the same sources: core/neon/x86_vocabulary.h maps the core's vector
vocabulary onto NEON):

    neon          Armv8.0-A Advanced SIMD (every 64-bit ARM: Cortex-A53/A72, Graviton 1)
    neon-dotprod  + SDOT/UDOT (Armv8.2-A+dotprod: Apple M1, Graviton 2, Neoverse N1, Ampere Altra)
    neon-i8mm     + USDOT/SMMLA (Armv8.6-A I8MM: Apple M2 and later, Graviton 3/4, Neoverse V1/N2)

Forcing: `KVSERVE_CPU_ISA=LEVEL` or `--cpu-isa LEVEL` (the engine config) picks a lower
level than the CPU's own; a higher one than the CPU runs is a clear error, never an illegal
instruction. The CPU's features come from the kernel's view of them (/proc/cpuinfo flags),
which Linux clears for state the OS did not enable in XCR0 (AVX-512 or AMX tiles switched
off by the kernel or the hypervisor), so a listed flag is one this process may use. On ARM
Linux they are the "Features" line (the kernel's hwcaps, what getauxval(AT_HWCAP) reports);
on macOS, the `hw.optional` sysctls, named as Linux names them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path

from kvserve.errors import ConfigError

# each architecture's levels, lowest first; each level runs everything the ones before it run
X86_LEVELS: tuple[str, ...] = ("avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx")
ARM_LEVELS: tuple[str, ...] = ("neon", "neon-dotprod", "neon-i8mm")
ARCH_LEVELS: dict[str, tuple[str, ...]] = {"x86_64": X86_LEVELS, "aarch64": ARM_LEVELS}
LEVELS: tuple[str, ...] = X86_LEVELS + ARM_LEVELS  # every level's name (--cpu-isa's choices)

# the CPU flags (Linux's names) each level needs, on top of the levels below it
_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "popcnt"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "avx512-vnni": ("avx512_vnni",),
    "avx512-bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
    "neon": ("fp", "asimd"),
    "neon-dotprod": ("asimddp",),
    "neon-i8mm": ("i8mm",),
}

# macOS names the same features in sysctls (hw.optional.*); Linux's name for each
_DARWIN_SYSCTLS: dict[str, str] = {
    "hw.optional.floatingpoint": "fp",
    "hw.optional.AdvSIMD": "asimd",
    "hw.optional.arm.FEAT_DotProd": "asimddp",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
    "hw.optional.arm.FEAT_BF16": "bf16",
}


def machine_arch(machine: str | None = None) -> str | None:
    """This machine's architecture as the levels name it ("x86_64", "aarch64"), or None."""
    m = (machine or platform.machine()).lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m)


def level_arch(level: str) -> str:
    """The architecture whose level `level` is (a name from LEVELS)."""
    return next(arch for arch, levels in ARCH_LEVELS.items() if level in levels)


ENV_VAR = "KVSERVE_CPU_ISA"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them, read once."""
    if sys.platform == "darwin":
        return darwin_flags(_sysctl_int)
    try:
        return flags_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def flags_from_cpuinfo(text: str) -> frozenset[str]:
    """The first processor's flags: x86's "flags" line, or ARM's "Features" line."""
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("flags", "Features") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def darwin_flags(read_sysctl) -> frozenset[str]:
    """Linux's names for the features macOS reports as set; `read_sysctl(name)` gives a
    sysctl's integer or None where the OS has no such name (older macOS)."""
    return frozenset(flag for name, flag in _DARWIN_SYSCTLS.items() if read_sysctl(name))


def _sysctl_int(name: str) -> int | None:
    libc = ctypes.CDLL(None)
    value, size = ctypes.c_int64(0), ctypes.c_size_t(8)
    if libc.sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    return value.value


def level_flags(level: str) -> tuple[str, ...]:
    """The CPU flags `level` needs on top of the levels below it."""
    return _FLAGS[level]


def cpu_has(flag: str) -> bool:
    """A /proc/cpuinfo flag of this CPU (e.g. avx512_vnni)."""
    return flag in cpu_flags()


def missing_flags(level: str, flags: frozenset[str] | None = None) -> list[str]:
    """The flags `level` needs that the CPU lacks (its own and every lower level's of its
    architecture)."""
    flags = cpu_flags() if flags is None else flags
    levels = ARCH_LEVELS[level_arch(level)]
    need = [f for lv in levels[: levels.index(level) + 1] for f in _FLAGS[lv]]
    return [f for f in need if f not in flags]


def runnable_levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Every level this CPU executes, lowest first (empty on another architecture, or below
    x86-64-v3)."""
    arch = machine_arch()
    if arch is None:
        return ()
    return tuple(lv for lv in ARCH_LEVELS[arch] if not missing_flags(lv, flags))


def native_level(flags: frozenset[str] | None = None) -> str | None:
    """The highest level this CPU runs, or None."""
    levels = runnable_levels(flags)
    return levels[-1] if levels else None


def check_level(level: str, source: str) -> str:
    """`level` if it names a level this CPU runs; else a ConfigError naming `source`."""
    if level not in LEVELS:
        raise ConfigError(source, f"unknown CPU kernel level {level!r}; the levels are {', '.join(LEVELS)}")
    arch = machine_arch()
    missing = missing_flags(level) if arch == level_arch(level) else []
    if missing or arch != level_arch(level):
        runs = native_level()
        why = f"lacks {', '.join(missing)}" if missing else f"is {platform.machine()}, not {level_arch(level).replace('_', '-')}"
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


BF16_DOTS_ENV = "KVSERVE_BF16_DOTS"


def vendor_from_cpuinfo(text: str) -> str | None:
    """The first processor's vendor_id ("GenuineIntel", "AuthenticAMD"), None where there is none (ARM)."""
    for line in text.splitlines():
        if line.split(":", 1)[0].strip() == "vendor_id" and ":" in line:
            return line.split(":", 1)[1].strip() or None
    return None


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str | None:
    try:
        return vendor_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def bf16_pair_dots(
    vendor: str | None = None, env: str | None = None, level: str | None = None, tiles_serve_every_row: bool = True,
) -> tuple[bool, str]:
    """Whether the bf16 GEMM on the VNNI tiles takes VDPBF16PS pair dots at the levels that
    have them (avx512-bf16, amx), and why; one choice per process, so a row's bits never
    depend on its call. By measurement (python -m benchmarks.kernel_levels --only "gemm_vnni
    bf16"): on Zen 4 the pair dots ran about twice the rate of weights widened to fp32 FMAs; on
    an Intel Xeon (Sapphire Rapids) at 0.54-0.73x of it from 4 rows up, and 1.0-1.17x at one
    row. So on Intel the tiles widen where they serve every row count (`tiles_serve_every_row`:
    the avx512-bf16 level, or --deterministic at any level), and keep the pair dots at `amx`,
    where they serve only the GEMV's few rows (AMX tiles the rest) and batch 1 is their case.
    Other vendors keep the pair dots. $KVSERVE_BF16_DOTS=pair|widen overrides."""
    env = os.environ.get(BF16_DOTS_ENV, "") if env is None else env
    env = env.strip().lower()
    if env:
        if env not in ("pair", "widen"):
            raise ConfigError(BF16_DOTS_ENV, f"must be 'pair' or 'widen', got {env!r}")
        return env == "pair", f"{BF16_DOTS_ENV}={env}"
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor == "GenuineIntel" and (level != "amx" or tiles_serve_every_row):
        return False, "widened to fp32 FMAs (VDPBF16PS ran at 0.54-0.73x of them on an Intel core from 4 rows)"
    return True, "VDPBF16PS pair dots"


def cpu_supports_bf16() -> bool:
    """Whether oneDNN (torch's CPU matmuls) computes bf16 natively here: the plain-torch
    path's test for bf16 weights where no kernel level runs."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False
