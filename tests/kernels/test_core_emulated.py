"""The torch-free kernel core (kvserve/kernels/core) at the aarch64 levels, on an x86 host: the core
cross-compiled with a driver (tests/kernels/cpp/core_driver.cpp) for each level and run under
qemu-aarch64 as a CPU of that level, on every family's cases (tests/kernels/core_fixtures.py),
against the plain-torch references the x86 kernel tests use, with their tolerances, and a row's
bits against the same row in other row counts, tiles and prompt chunks.

The same driver built natively at avx2 runs the same cases first: there the kernels are known
good (test_kernels.py and the others test them through torch), so it validates the cases and
the driver. And `neon` has avx2's arithmetic paths (neither has an int8 dot), so its outputs
must be avx2's bit for bit, except where x86 computes a reciprocal estimate (_mm256_rcp_ps:
silu_and_mul, gelu_tanh_and_mul), which the ARM vocabulary computes exactly.

Each level's driver is compiled once and cached under the kvserve cache folder
(core-driver/), keyed by the sources' bytes, the command and the compiler's version; each level
runs all its cases in one process, once a session.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kvserve.kernels import build as kernel_build
from kvserve.paths import cache_root
from tests.kernels.core_fixtures import FAMILIES, Results, Suite, bits, build_suite
from tests.support import arm_emulation

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).parent / "cpp" / "core_driver.cpp"
CORE = ROOT / "kvserve" / "kernels" / "core"

# level -> (compiler, the build whose flags it takes, how to run it). The qemu CPUs: cortex-a53
# is ARMv8.0-A (no dotprod), neoverse-n1 has dotprod but not i8mm, `max` has both (SVE off: the
# core does not use it)
LEVELS = {
    "avx2-native": ("c++", "avx2", []),
    "neon": (arm_emulation.ARM_CXX, "neon", [arm_emulation.QEMU, "-cpu", "cortex-a53"]),
    "neon-dotprod": (arm_emulation.ARM_CXX, "neon-dotprod", [arm_emulation.QEMU, "-cpu", "neoverse-n1"]),
    "neon-i8mm": (arm_emulation.ARM_CXX, "neon-i8mm", [arm_emulation.QEMU, "-cpu", "max,sve=off"]),
}  # fmt: skip
# families whose x86 code takes _mm256_rcp_ps's estimate (refined by a Newton step), where the ARM
# vocabulary starts from the exact 1/x: the two agree to ~1e-7, not bit for bit
RECIPROCAL_ESTIMATE = ("silu_and_mul", "gelu_tanh_and_mul")


def _why_not(level: str) -> str | None:
    compiler, _, runner = LEVELS[level]
    return arm_emulation.why_not(compiler, *runner[:1], native=not runner)


def _command(level: str, out: Path) -> list[str]:
    """The compile command, with the level's build flags (kvserve/kernels/build.py)."""
    compiler, build_level, runner = LEVELS[level]
    isa = kernel_build.build_for(build_level).isa_flags
    ns = build_level.replace("-", "_")
    link = ["-static"] if runner else []  # qemu-aarch64 runs a static binary without an aarch64 sysroot
    return [compiler, "-std=c++17", "-O2", "-fopenmp", *link, *isa, f"-DKVSERVE_LEVEL_NS={ns}", str(DRIVER), "-o", str(out)]


def _cached_binary(level: str) -> Path:
    """Where the level's driver is cached: keyed by the driver's and the core's bytes, the command
    and the compiler's version."""
    h = hashlib.sha256()
    for p in [DRIVER, *sorted(CORE.glob("*.cpp")), *sorted(CORE.glob("*.h")), *sorted(CORE.glob("neon/*.h"))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(" ".join(_command(level, Path("OUT"))).encode())
    compiler = LEVELS[level][0]
    h.update(subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.encode())
    return cache_root() / "core-driver" / f"{level}-{h.hexdigest()[:16]}"


class Runs:
    """The session's cases, each level's driver (built on first use, all levels' compiles at
    once) and each level's outputs (one driver run per level)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.suite: Suite = build_suite()
        self.cases = directory / "cases"
        self.cases.mkdir()
        self.suite.write(self.cases)
        self.binaries: dict[str, Path | str] | None = None  # level -> binary, or why it did not build
        self.outputs: dict[str, tuple[Results, str | None]] = {}
        self.timings: dict[str, str] = {}

    def _build_all(self) -> None:
        self.binaries, started = {}, {}
        t0 = time.perf_counter()
        for level in LEVELS:
            if _why_not(level):
                continue
            path = _cached_binary(level)
            if path.exists():
                self.binaries[level] = path
                self.timings[f"compile {level}"] = "cached"
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            started[level] = (subprocess.Popen(_command(level, tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True), tmp, path)  # fmt: skip
        for level, (proc, tmp, path) in started.items():
            out, _ = proc.communicate(timeout=600)
            self.timings[f"compile {level}"] = f"{time.perf_counter() - t0:.1f} s (in parallel)"
            if proc.returncode != 0:
                self.binaries[level] = f"the {level} driver did not compile:\n{' '.join(proc.args)}\n{out[-6000:]}"
            else:
                os.replace(tmp, path)
                self.binaries[level] = path

    def results(self, level: str) -> tuple[Results, str | None]:
        """The level's outputs, and what went wrong running it (None when it ran to the end)."""
        if level not in self.outputs:
            if self.binaries is None:
                self._build_all()
            binary = self.binaries[level]
            if isinstance(binary, str):
                pytest.fail(binary)
            out_dir = self.directory / f"out-{level}"
            out_dir.mkdir()
            t0 = time.perf_counter()
            ran = subprocess.run([*LEVELS[level][2], str(binary), str(self.cases), str(out_dir)], capture_output=True,
                                 text=True, timeout=600)  # fmt: skip
            self.timings[f"run {level}"] = f"{time.perf_counter() - t0:.1f} s"
            error = None
            if ran.returncode != 0 or not ran.stdout.rstrip().endswith(f"done {len(self.suite.cases)}"):
                done = [line.split()[1] for line in ran.stdout.splitlines() if line.startswith("ok ")]
                after = f"after case {done[-1]} ({self.suite.desc(done[-1])})" if done else "before the first case"
                error = f"the {level} driver stopped {after} with status {ran.returncode}:\n{ran.stderr[-3000:]}"
            self.outputs[level] = (self.suite.read(out_dir), error)
        return self.outputs[level]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("core-driver"))
    yield r
    if r.timings:  # shown with -s
        print("\ncore driver timings: " + "; ".join(f"{k}: {v}" for k, v in r.timings.items()))


def _report(failures: list[str], limit: int = 25) -> str:
    more = f"\n... and {len(failures) - limit} more" if len(failures) > limit else ""
    return "\n".join(failures[:limit]) + more


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("level", list(LEVELS))
def test_core_family_at_level(runs, level, family):
    """Every case of the family at this level: near the reference, and its rows bitwise the same
    in every row count, tile, chunk and order."""
    why = _why_not(level)
    if why:
        pytest.skip(why)
    res, error = runs.results(level)
    failures = runs.suite.run_checks(family, res)
    if error and failures:
        failures.insert(0, error)
    assert not failures, f"{family} at {level}:\n" + _report(failures)


@pytest.mark.parametrize("family", FAMILIES)
def test_neon_is_avx2_bit_for_bit(runs, family):
    """neon and avx2 take the same arithmetic paths (no int8 dot at either; the 8-bit panel from
    48 rows at both): the same bits, every output of every case."""
    if family in RECIPROCAL_ESTIMATE:
        pytest.skip("x86 starts from _mm256_rcp_ps's estimate, the ARM vocabulary from the exact 1/x")
    for level in ("avx2-native", "neon"):
        why = _why_not(level)
        if why:
            pytest.skip(f"{level}: {why}")
    (x86, _), (arm, _) = runs.results("avx2-native"), runs.results("neon")
    failures = []
    for case in runs.suite.cases:
        if case.family != family:
            continue
        if case.id not in x86 or case.id not in arm:
            failures.append(f"{case.id} ({case.desc}): no outputs from {'avx2' if case.id not in x86 else 'neon'}")
            continue
        for name in case.outputs:
            a, b = x86[case.id][name], arm[case.id][name]
            off = bits(a) != bits(b)
            if off.any():
                diff = (a.double() - b.double()).abs()
                finite = diff[torch.isfinite(diff)]
                worst = f", largest |difference| {finite.max().item():.3g}" if finite.numel() else ""
                failures.append(f"{case.id} ({case.desc}) {name}: {int(off.sum())} of {off.numel()} elements differ{worst}")
    assert not failures, f"{family}: neon against avx2:\n" + _report(failures)
