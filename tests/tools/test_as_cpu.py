"""tools/as_cpu: a lower level's view of the CPU, as kvserve's own detection reads it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.kernels import isa
from tools import as_cpu

ROOT = Path(__file__).resolve().parents[2]

# a Sapphire Rapids' flags (a subset), so the tests do not depend on this machine's
SPR = frozenset(
    "fpu sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe popcnt avx512f avx512dq avx512cd avx512bw avx512vl "
    "avx512ifma avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 avx_vnni amx_bf16 amx_tile amx_int8".split()
)
CPUINFO = "".join(
    f"processor\t: {n}\nvendor_id\t: GenuineIntel\nflags\t\t: {' '.join(sorted(SPR))}\nbogomips\t: 4000.00\n\n"
    for n in range(2)
)
on_x86 = pytest.mark.skipif(isa.machine_arch() != "x86_64", reason="the levels it emulates are x86's")


def test_avx2_hides_every_avx512_amx_and_vnni_flag():
    hide = as_cpu.hidden_flags("avx2", SPR)
    assert {f for f in SPR - hide if f.startswith(("avx512", "amx", "avx_vnni"))} == set()
    assert {"avx", "avx2", "fma", "f16c", "bmi2", "sse4_2"} <= SPR - hide


def test_a_middle_level_keeps_its_own_flags_and_loses_those_above():
    kept = SPR - as_cpu.hidden_flags("avx512-vnni", SPR)
    assert {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= kept
    assert not kept & {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
    assert as_cpu.hidden_flags("amx", SPR) == frozenset()


@on_x86
@pytest.mark.parametrize("level", isa.X86_LEVELS)
def test_kvserves_detection_reads_the_masked_text_as_that_level(level):
    text = as_cpu.masked_cpuinfo(CPUINFO, as_cpu.hidden_flags(level, SPR))
    assert isa.native_level(isa.flags_from_cpuinfo(text)) == level
    # only the flags lines change
    keep = [line for line in CPUINFO.splitlines() if not line.startswith("flags")]
    assert [line for line in text.splitlines() if not line.startswith("flags")] == keep


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="neon"):
        as_cpu.hidden_flags("neon", SPR)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.as_cpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@on_x86
@pytest.mark.skipif(isa.native_level() is None, reason="this CPU runs no kernel level")
@pytest.mark.skipif(not _can_unshare(), reason="needs root and a mount namespace (unshare -m)")
def test_a_command_sees_avx2_and_torch_is_held_there():
    probe = "import torch; from kvserve.kernels import isa; print(isa.native_level(), torch.backends.cpu.get_cpu_capability())"
    done = _run("avx2", "--", sys.executable, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2", "AVX2"]
    assert "as_cpu: level avx2:" in done.stderr
    # the namespace is the command's alone
    assert isa.native_level(isa.flags_from_cpuinfo(Path("/proc/cpuinfo").read_text())) == isa.native_level()


@on_x86
def test_a_level_above_this_cpus_is_a_clear_error():
    above = [lv for lv in isa.X86_LEVELS if lv not in isa.runnable_levels()]
    if not above:
        pytest.skip("this CPU runs every x86 level: none to ask for above it")
    done = _run(above[0], "--", "true")
    assert done.returncode == 2
    assert above[0] in done.stderr and "Traceback" not in done.stderr


def test_no_command_is_a_clear_error():
    done = _run("avx2")
    assert done.returncode == 2 and "no command" in done.stderr
