"""The AMX tile GEMM (kernels/core/amx/) on CPUs without AMX: its torch-free core compiled with
the tile instructions emulated in C++ (tests/kernels/cpp/amx_emulation.h) and run by a driver
that checks every epilogue, row count and depth chunking against a reference summing in the
instruction's order. On an AMX machine the kernel tests also run the real build at the `amx`
level (tests/kernels/test_kernels.py, marked needs_amx)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPP = Path(__file__).parent / "cpp"


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_amx_linear_core_on_emulated_tiles(tmp_path):
    exe = tmp_path / "amx_linear_test"
    # -ffp-contract=off: the driver's reference and the emulated instruction sum in one order,
    # which fused multiply-adds would change differently in the two
    cmd = ["c++", "-std=c++17", "-O2", "-fopenmp", "-march=x86-64-v3", "-ffp-contract=off",
           "-DKVSERVE_LEVEL_NS=amx_emulated", "-DKVSERVE_AMX_EMULATED", "-include", str(CPP / "amx_emulation.h"),
           str(ROOT / "kvserve/kernels/core/amx/amx_linear_core.cpp"), str(CPP / "amx_linear_test.cpp"), "-o", str(exe)]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.startswith("ok "), ran.stdout[-3000:] + ran.stderr[-1000:]
    assert int(ran.stdout.split()[1]) > 2000  # every case ran
