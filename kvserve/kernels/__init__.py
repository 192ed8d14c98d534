"""Optional C++ CPU kernels (the .cpp files here, one per op family; kernels.h declares them and
their limits, api.py their Python signatures), built once per machine and checkout with torch's cpp_extension.

They are used only where they can be: an x86 CPU with AVX512-BF16, a C++ compiler, and
`KVSERVE_CPU_KERNELS` not set to 0. Anywhere else kvserve runs the plain-torch reference
path, which the kernels are tested against. The build (~30-60 s on 2 cores) lands in the kvserve cache
directory, keyed by the sources' hash, so it happens once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "bindings.cpp",  # the slowest to compile (pybind11): first, so ninja starts it first
        "gemv.cpp",
        "amx_linear.cpp",
        "decode_attention.cpp",
        "shared_prefix_attention.cpp",
        "cascade_attention.cpp",
        "prefill_attention.cpp",
        "norm_rope_act.cpp",
        "argmax.cpp",
        "quant_linear.cpp",
        "linear.cpp",
        "fused_decode.cpp",
    )
]
_HEADERS = [Path(__file__).with_name(n) for n in ("kernels.h", "amx_tiles.h", "vec_math.h")]
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has(flag: str) -> bool:
    """A /proc/cpuinfo flag of this CPU (e.g. avx512_vnni)."""
    return flag in _cpu_flags()


_build_failure: str | None = None  # why the last build failed, once cpu_ops() has tried


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here, or None if they can."""
    if _build_failure:
        return _build_failure
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return "disabled by KVSERVE_CPU_KERNELS=0"
    missing = [f for f in _REQUIRED_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler on PATH"
    return None


@functools.lru_cache(maxsize=1)
def cpu_ops():
    """The compiled module, or None (with the reason logged once)."""
    reason = unavailable_reason()
    if reason:
        logger.info("CPU kernels off: %s; using the plain-torch path", reason)
        return None
    from torch.utils.cpp_extension import load

    from kvserve.paths import cache_root

    # the sources' bytes and where they are: torch's build rewrites build.ninja with the source
    # paths, so two checkouts sharing a build folder rebuilt it at every switch between them
    # (a minute on 2 cores, every other start meanwhile waiting on the build's lock)
    where = str(_SOURCES[0].parent.resolve()).encode()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + where).hexdigest()[:12]
    name = f"kvserve_cpu_ops_{digest}"
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.warning("building kvserve CPU kernels (once per machine and checkout, ~30-60 s)")
    _wait_for_other_builds(build_dir / "lock")
    try:
        return load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # a broken toolchain must not stop the engine
        global _build_failure
        _build_failure = f"the kernels failed to build ({str(exc)[:200]})"
        logger.warning("CPU kernels failed to build (%s); using the plain-torch path", exc)
        return None


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
