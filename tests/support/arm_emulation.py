"""What the ARM tests need on this host: an x86-64 CPU with AVX2 for the native reference run,
the aarch64 cross compiler and qemu-user (`make test` installs the two as root)."""

from __future__ import annotations

import platform
import shutil

from kvserve.kernels.isa import machine_arch, runnable_levels

ARM_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


def why_not(*tools: str, native: bool = True) -> str | None:
    """Why these ARM tests cannot run here (None when they can): not an x86-64 host, a tool of
    `tools` missing, or (`native`: a native avx2 binary runs beside them) a CPU below avx2."""
    if machine_arch() != "x86_64":
        return f"needs an x86-64 host for the native reference run (this is {platform.machine()})"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if native and "avx2" not in runnable_levels():
        return "this x86 CPU lacks AVX2/FMA/F16C, which the native reference binary executes"
    return None
