"""kvserve/kernels/core/neon/x86_vocabulary.h -- the x86 intrinsics the kernel core uses, in
AArch64 NEON -- against real x86: tests/kernels/cpp/x86_vocabulary_test.cpp runs every one over
the same pseudo-random and edge-case inputs, built natively (the x86 instructions) and for
aarch64 (the header, under qemu as a Cortex-A53: baseline ARMv8.0-A), and the two outputs must
agree line for line, bit for bit. The one exception is _mm256_rcp_ps, which the header computes
as the exact 1/x where x86 gives a ~12-bit estimate: its lanes must be the IEEE 1/x, and within
2^-11 relative of x86's estimate wherever that estimate is not a flushed 0 or inf
(2^-126 <= |x| < 2^126)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support import arm_emulation

SRC = Path(__file__).parent / "cpp" / "x86_vocabulary_test.cpp"
# -ffp-contract=off: the test is about the intrinsics, not where a compiler fuses a·b+c
FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off"]


def _why_not() -> str | None:
    return arm_emulation.why_not("c++", arm_emulation.ARM_CXX, arm_emulation.QEMU)


def _rcp_mismatches(x86_line: str, arm_line: str) -> str | None:
    """None if the ARM lanes are the exact 1/x and near x86's estimate, else why not."""
    xw, aw = x86_line.split()[2:], arm_line.split()[2:]
    if xw[:8] != aw[:8]:
        return "inputs differ"
    x = np.array([int(w, 16) for w in xw[:8]], dtype=np.uint32).view(np.float32)
    est = np.array([int(w, 16) for w in xw[8:]], dtype=np.uint32).view(np.float32)
    got = np.array([int(w, 16) for w in aw[8:]], dtype=np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        exact = np.float32(1) / x
    same = (got.view(np.uint32) == exact.view(np.uint32)) | (np.isnan(got) & np.isnan(exact))
    if not same.all():
        return f"lanes {np.flatnonzero(~same).tolist()} are not the exact 1/x"
    # VRCPPS reads a denormal x as 0 (±inf out) and gives 0 for |x| >= 2^126
    normal = (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) < np.float32(2.0**126))
    got64 = got.astype(np.float64)
    with np.errstate(all="ignore"):
        far = normal & ~(np.abs(got64 - est) <= 2.0**-11 * np.abs(got64))
    if far.any():
        return f"lanes {np.flatnonzero(far).tolist()} are further than 2^-11 from x86's estimate"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_neon_vocabulary_matches_x86(tmp_path):
    x86, arm = tmp_path / "vocab_x86", tmp_path / "vocab_arm"
    builds = [
        subprocess.Popen(["c++", *FLAGS, "-march=x86-64-v3", str(SRC), "-o", str(x86)], stderr=subprocess.PIPE, text=True),
        subprocess.Popen([arm_emulation.ARM_CXX, *FLAGS, "-static", "-march=armv8-a", str(SRC), "-o", str(arm)],
                         stderr=subprocess.PIPE, text=True),
    ]  # fmt: skip
    for b in builds:
        _, err = b.communicate(timeout=120)
        assert b.returncode == 0, f"{' '.join(b.args[:1])} failed:\n{err[-4000:]}"

    want = subprocess.run([str(x86)], capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    got = subprocess.run([arm_emulation.QEMU, "-cpu", "cortex-a53", str(arm)], capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()  # fmt: skip
    assert want and want[-1].startswith("end ") and int(want[-1].split()[1]) > 30000, want[-1:]
    assert len(got) == len(want), f"{len(got)} lines from aarch64, {len(want)} from x86: {got[-1:]}"

    bad = []
    for n, (w, g) in enumerate(zip(want, got), 1):
        if w == g:
            continue
        why = _rcp_mismatches(w, g) if w.startswith("_mm256_rcp_ps ") else "differs"
        if why is not None:
            bad.append(f"line {n}: {why}\n  x86:     {w}\n  aarch64: {g}")
    names = sorted({b.split("x86:")[1].split()[0] for b in bad})
    assert not bad, f"{len(bad)} lines differ ({', '.join(names)}); the first:\n" + "\n".join(bad[:8])
