"""kvserve's C++ CPU kernels: one build per ISA level (build.py), the level chosen at run time
(isa.py), each op family's Python signature in api.py and the shape limits in kernels.h.

`cpu_ops()` loads the build of the chosen level (the CPU's highest, or the one forced by
`--cpu-isa` / `KVSERVE_CPU_ISA`), building it first if this machine and checkout have not:
about a minute on 2 cores, into the kvserve cache folder, keyed by the sources' hash and the
level, so it happens once. Only the chosen level's build is compiled; tests build the others.
Where no level runs (a CPU below x86-64-v3, neither x86-64 nor aarch64, no C++ compiler,
`KVSERVE_CPU_KERNELS=0`) kvserve runs the plain-torch reference path, which the kernels are
tested against.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

from kvserve.kernels.build import OPENMP_LINK, build_for
from kvserve.kernels.isa import bf16_pair_dots, chosen_level, cpu_flags, cpu_has  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

_build_failures: dict[str, str] = {}  # level -> why its build failed, once cpu_ops() has tried


def kernels_disabled() -> bool:
    """KVSERVE_CPU_KERNELS=0: the plain-torch path everywhere."""
    return os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0"


def unavailable_reason(level: str | None = None) -> str | None:
    """Why the kernels cannot be used here (at `level`, default the chosen one), or None if they can."""
    if kernels_disabled():
        return "disabled by KVSERVE_CPU_KERNELS=0"
    level = level or chosen_level()
    if level is None:
        return "the CPU runs none of the kernel levels (x86-64-v3 with AVX2, FMA and F16C, or aarch64 with NEON)"
    if level in _build_failures:
        return _build_failures[level]
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler on PATH"
    return None


def cpu_ops(level: str | None = None):
    """The compiled module of `level` (default: the chosen level, isa.chosen_level), or None
    with the reason logged once. A forced level the CPU lacks raises ConfigError."""
    return _load(level or chosen_level())


@functools.lru_cache(maxsize=None)
def _load(level: str | None):
    reason = unavailable_reason(level)
    if reason:
        logger.info("CPU kernels off: %s; using the plain-torch path", reason)
        return None
    from torch.utils.cpp_extension import load

    from kvserve.paths import cache_root

    build = build_for(level)
    name = build.module_name()
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.warning("building kvserve CPU kernels for %s (once per machine and checkout, ~1 min)", build.level)
    _wait_for_other_builds(build_dir / "lock")
    try:
        module = load(
            name=name,
            sources=[str(p) for p in build.compile_units(build_dir)],
            extra_cflags=build.ninja_cflags,
            extra_ldflags=list(OPENMP_LINK),
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # a broken toolchain must not stop the engine
        _build_failures[level] = f"the {build.level} kernels failed to build ({str(exc)[:200]})"
        logger.warning("CPU kernels (%s) failed to build (%s); using the plain-torch path", build.level, exc)
        return None
    # the bf16 GEMM's compute format where the level has pair dots (KernelSupport.decide sets it
    # again for an engine that runs every row on the VNNI tiles: --deterministic)
    module.set_bf16_pair_dots(bf16_pair_dots(level=build.level, tiles_serve_every_row=build.level != "amx")[0])
    return module


# A build takes about a minute; a lock this old belongs to a build that was killed
# (torch's own wait on it never gives up, so every later start would hang)
_STALE_LOCK_S = 15 * 60


def _wait_for_other_builds(lock: Path) -> None:
    """Wait while another process builds these kernels (it holds `lock`, torch's build
    baton); remove the lock of a build that died instead of waiting on it for ever."""
    import time

    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > _STALE_LOCK_S:
            logger.warning("removing %s, left %.0f min ago by a kernel build that did not finish", lock, age / 60)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)
