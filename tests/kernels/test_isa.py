"""ISA levels: what each CPU runs, forcing one, and what each level's build may hold.

The disassembly checks are what keeps a CPU from meeting an instruction it lacks: every
build is compiled here (a compiler builds any level, whatever this CPU runs) and objdump
reads every instruction of it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.describe import describe
from kvserve.errors import ConfigError
from kvserve.kernels import cpu_ops, isa
from kvserve.kernels.build import BUILDS, HERE, LEVEL_BUILD, build_for

ZEN3 = frozenset("avx avx2 fma f16c bmi1 bmi2 movbe popcnt sse4_2".split())
SKYLAKE_SP = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512cd".split())
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
ZEN4 = CASCADE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    "flags, native",
    [(frozenset({"sse4_2", "avx"}), None), (ZEN3, "avx2"), (SKYLAKE_SP, "avx512"), (CASCADE_LAKE, "avx512-vnni"),
     (ZEN4, "avx512-bf16"), (SAPPHIRE_RAPIDS, "amx")],
)  # fmt: skip
def test_native_level_is_the_highest_whose_flags_are_all_there(flags, native, monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    assert isa.native_level(flags) == native
    runs = isa.runnable_levels(flags)
    assert runs == isa.LEVELS[: isa.LEVELS.index(native) + 1] if native else runs == ()


def test_a_level_needs_every_lower_levels_flags(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    # BF16 without the AVX-512 base (no such CPU, but flags can be masked) runs avx2 only
    assert isa.native_level(ZEN3 | {"avx512_bf16", "avx512_vnni"}) == "avx2"
    assert isa.missing_flags("avx512-vnni", ZEN3) == ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"]


def test_no_level_off_x86_and_aarch64(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "riscv64")
    assert isa.runnable_levels(SAPPHIRE_RAPIDS | GRAVITON3) == ()
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    assert isa.runnable_levels(SAPPHIRE_RAPIDS) == ()  # x86 flags make no ARM level


# the "Features" lines of /proc/cpuinfo on these cores (Linux 6.x)
CORTEX_A53 = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid".split())
NEOVERSE_N1 = CORTEX_A53 | frozenset("atomics fphp asimdhp asimdrdm lrcpc dcpop asimddp ssbs".split())  # Graviton 2
GRAVITON3 = NEOVERSE_N1 | frozenset("sha3 sm3 sm4 asimdfhm dit uscat ilrcpc flagm sve svei8mm svebf16 i8mm bf16 dgh rng".split())


@pytest.mark.parametrize("flags, native", [(frozenset({"fp"}), None), (CORTEX_A53, "neon"), (NEOVERSE_N1, "neon-dotprod"),
                                           (GRAVITON3, "neon-i8mm"), (CORTEX_A53 | {"i8mm"}, "neon")])  # fmt: skip
def test_aarch64_levels_from_the_kernels_features(flags, native, monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    assert isa.native_level(flags) == native
    runs = isa.runnable_levels(flags)
    assert runs == (isa.ARM_LEVELS[: isa.ARM_LEVELS.index(native) + 1] if native else ())


def test_cpu_flags_read_the_x86_flags_or_the_arm_features_line():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm asimddp i8mm\nCPU implementer\t: 0x41\n"
    assert isa.flags_from_cpuinfo(x86) == {"fpu", "avx", "avx2", "fma"}
    assert isa.flags_from_cpuinfo(arm) == {"fp", "asimd", "evtstrm", "asimddp", "i8mm"}
    assert isa.flags_from_cpuinfo("processor\t: 0\n") == frozenset()


@pytest.mark.parametrize("sysctls, native", [
    ({"hw.optional.floatingpoint": 1, "hw.optional.AdvSIMD": 1, "hw.optional.arm.FEAT_DotProd": 1}, "neon-dotprod"),  # M1
    ({"hw.optional.floatingpoint": 1, "hw.optional.AdvSIMD": 1, "hw.optional.arm.FEAT_DotProd": 1,
      "hw.optional.arm.FEAT_I8MM": 1, "hw.optional.arm.FEAT_BF16": 1}, "neon-i8mm"),  # M2 and later
    ({"hw.optional.floatingpoint": 1, "hw.optional.AdvSIMD": 1}, "neon"),  # a macOS without the FEAT_ names
])  # fmt: skip
def test_macos_sysctls_name_the_same_levels(sysctls, native, monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "arm64")  # what macOS calls it
    flags = isa.darwin_flags(sysctls.get)
    assert isa.native_level(flags) == native


def test_openmp_flags_for_gcc_and_for_apple_clang(tmp_path):
    """Linux: -fopenmp. macOS: Apple clang's -Xclang -fopenmp, torch's own libomp (one OpenMP
    runtime in the process), its omp.h where the wheel ships it, else Homebrew's."""
    from kvserve.kernels.build import openmp_flags

    assert openmp_flags("linux") == (("-fopenmp",), ("-fopenmp",))
    torch_dir = tmp_path / "torch"
    (torch_dir / "include").mkdir(parents=True)
    compile_flags, link = openmp_flags("darwin", torch_dir, {"HOMEBREW_PREFIX": "/usr/local"})
    assert compile_flags == ("-Xclang", "-fopenmp", "-I/usr/local/opt/libomp/include")
    assert link == (f"-L{torch_dir}/lib", "-lomp", f"-Wl,-rpath,{torch_dir}/lib")
    (torch_dir / "include" / "omp.h").write_text("")
    assert openmp_flags("darwin", torch_dir, {})[0] == ("-Xclang", "-fopenmp", f"-I{torch_dir}/include")
    assert openmp_flags("darwin", tmp_path / "other", {})[0][-1] == "-I/opt/homebrew/opt/libomp/include"


def test_a_level_of_the_other_architecture_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    with pytest.raises(ConfigError, match=r"'neon-dotprod' needs instructions this CPU does not have: it is x86_64, not aarch64"):
        isa.check_level("neon-dotprod", "cpu_isa")
    isa.cpu_flags.cache_clear()
    monkeypatch.setattr(isa, "cpu_flags", lambda: NEOVERSE_N1)
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    with pytest.raises(ConfigError, match=r"'avx2' .* it is aarch64, not x86-64 \(the highest level it runs is 'neon-dotprod'\)"):
        isa.check_level("avx2", "cpu_isa")
    with pytest.raises(ConfigError, match=r"'neon-i8mm' .* it lacks i8mm"):
        isa.check_level("neon-i8mm", "cpu_isa")
    assert isa.check_level("neon", "cpu_isa") == "neon"


def test_every_level_has_a_build_and_lower_ones_share_theirs():
    assert set(LEVEL_BUILD) == set(isa.LEVELS)
    assert build_for("avx512") is BUILDS["avx2"]  # nothing of its own at avx512 yet
    for level, build in BUILDS.items():
        assert build.level == level
        assert not any("native" in f for f in build.cflags)


def test_an_unknown_level_is_a_config_error_naming_the_levels():
    with pytest.raises(ConfigError, match="unknown CPU kernel level 'avx9'.*avx2, avx512"):
        EngineConfig(cpu_isa="avx9", device="cpu")


def test_the_environment_variable_forces_a_level(monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, "avx2")
    assert isa.chosen_level() == "avx2"
    assert EngineConfig(device="cpu").kernel_level == "avx2"
    monkeypatch.setenv(isa.ENV_VAR, "avx9")
    with pytest.raises(ConfigError, match=isa.ENV_VAR):
        isa.chosen_level()


@pytest.mark.skipif(isa.native_level() in (None, "amx"), reason="this CPU runs every level (or none)")
def test_a_level_above_the_cpus_is_refused_with_what_it_lacks():
    with pytest.raises(ConfigError, match=r"'amx' needs instructions this CPU does not have: it lacks .*amx_tile") as err:
        EngineConfig(cpu_isa="amx", device="cpu")
    assert f"the highest level it runs is {isa.native_level()!r}" in str(err.value)


@pytest.mark.skipif(isa.native_level() is None, reason="the CPU runs no kernel level")
def test_dtype_auto_keeps_bf16_wherever_a_kernel_level_runs():
    import torch

    for level in isa.runnable_levels():
        assert EngineConfig(device="cpu", cpu_isa=level).torch_dtype == torch.bfloat16


# ---- what each build holds ------------------------------------------------------------------

# an EVEX prefix (0x62: AVX-512 encodings, zmm and mask registers, ymm16-31) opens the instruction
_EVEX = re.compile(r"^\s*[0-9a-f]+:\t62 ")
_AMX = re.compile(r"\t(tileloadd|tileloaddt1|tilestored|tilezero|tilerelease|ldtilecfg|sttilecfg|tdp\w+)\b")
_BF16 = re.compile(r"\t(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)\b")
_VNNI = re.compile(r"\t(vpdpbusds?|vpdpwssds?)\b")
_ZMM = re.compile(r"%zmm|%k[1-7]\b|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")


# A build for a level above this CPU's cannot be loaded here and costs a minute to link;
# its flags are checked on one family source compiled alone, one that must use the level's
# own instructions (VPDPBUSD in quant_linear, VDPBF16PS in the bf16 GEMV, tiles in amx_linear).
_REPRESENTATIVE = {"avx2": "core/quant_linear_core.cpp", "avx512-vnni": "core/quant_linear_core.cpp",
                   "avx512-bf16": "core/gemv_core.cpp", "amx": "core/amx/amx_linear_core.cpp"}


def _objdump(path: str, tool: str = "objdump") -> list[str]:
    # -w: each instruction on one line, its bytes first (the EVEX check reads them)
    out = subprocess.run([tool, "-d", "-w", path], check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "\t" in line]


def _instructions(level: str, tmp_path_factory, whole_build: bool | None = None) -> list[str]:
    """`whole_build`: objdump the loaded module (default where this CPU runs the level), else
    one family source compiled alone with the level's flags."""
    build = BUILDS[level]
    if whole_build if whole_build is not None else level in isa.runnable_levels():
        module = cpu_ops(level)  # the tests load it anyway
        assert module is not None, f"the {level} build failed"
        lines = _objdump(module.__file__)
        assert len(lines) > 1000  # the whole module was read
        return lines
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    source = HERE / _REPRESENTATIVE[level]
    obj = tmp_path_factory.mktemp(f"isa-{level}") / "family.o"
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    cmd = ["c++", "-std=c++17", "-fPIC", *build.cflags, *includes, "-c", str(source), "-o", str(obj)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return _objdump(str(obj))


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("c++") is None, reason="no objdump or compiler")
@pytest.mark.parametrize("level", [lv for lv, b in BUILDS.items() if b.arch == "x86_64"])
def test_a_build_holds_no_instruction_above_its_level(level, tmp_path_factory):
    lines = _instructions(level, tmp_path_factory)
    forbidden: list[tuple[str, re.Pattern]] = []
    if level == "avx2":
        forbidden += [("EVEX-encoded (AVX-512)", _EVEX), ("AVX-512 registers", _ZMM), ("VNNI", _VNNI)]
    if level in ("avx2", "avx512-vnni"):
        forbidden.append(("AVX512-BF16", _BF16))
    if level != "amx":
        forbidden.append(("AMX", _AMX))
    _assert_instructions(level, lines, forbidden, {"avx512-vnni": _VNNI, "avx512-bf16": _BF16, "amx": _AMX}.get(level))


def _assert_instructions(level: str, lines: list[str], forbidden: list[tuple[str, re.Pattern]], own: re.Pattern | None):
    """None of the forbidden instructions, and (the flags in force) the level's own where it has one."""
    for what, pattern in forbidden:
        hits = [line for line in lines if pattern.search(line)]
        assert not hits, f"the {level} build holds {len(hits)} {what} instructions, e.g. {hits[:3]}"
    if own is not None:
        assert any(own.search(line) for line in lines), f"the {level} build uses none of its level's instructions"


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("c++") is None, reason="no objdump or compiler")
@pytest.mark.parametrize("level", [lv for lv in BUILDS if lv in isa.runnable_levels()])
def test_the_single_source_check_that_other_cpus_run_holds_here_too(level, tmp_path_factory):
    # the test above reads the whole build where the CPU runs the level, one source where it
    # does not: this runs the one-source form on the levels this CPU runs, so a machine of
    # a lower level does not meet it untried
    lines = _instructions(level, tmp_path_factory, whole_build=False)
    own = {"avx512-vnni": _VNNI, "avx512-bf16": _BF16, "amx": _AMX}.get(level)
    assert own is None or any(own.search(line) for line in lines)
    assert level != "avx2" or not any(_EVEX.search(line) for line in lines)


def test_each_build_reports_its_level_and_families():
    for level in isa.runnable_levels():
        module = cpu_ops(level)
        build = build_for(level)
        assert module.isa_level() == build.level
        families = module.families()
        assert set(families.values()) == {build.level}
        assert module.amx_available() is False or build.level == "amx"


def test_module_names_differ_by_level():
    assert len({b.module_name() for b in BUILDS.values()}) == len(BUILDS)


@pytest.mark.parametrize("level", isa.runnable_levels())
def test_the_start_up_report_names_the_forced_level(level, tiny_model_dirs):
    from kvserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model_dirs["llama-gqa"], dtype="bfloat16", device="cpu",
                                    kv_cache_memory="4MiB", cpu_isa=level))  # fmt: skip
    build = build_for(level)
    assert engine.kernels.level == build.level
    report = describe(engine)
    assert f"kernels: kvserve CPU kernels at the {build.level} level" in report
    # families sorted by name: amx_linear leads the line at the amx level, argmax at the others
    families = next(line for line in report.splitlines() if line.strip().startswith("families: "))
    assert f"argmax {build.level}" in families


# ---- the aarch64 builds: cross-compiled here, disassembled with the cross binutils ------------

_ARM_CXX, _ARM_OBJDUMP = shutil.which("aarch64-linux-gnu-g++"), shutil.which("aarch64-linux-gnu-objdump")
_SDOT = re.compile(r"\t[su]dot\t")
_I8MM = re.compile(r"\t(usdot|sudot|smmla|ummla|usmmla)\t")
_ARM_BF16 = re.compile(r"\t(bfdot|bfmmla|bfmlal[bt]|bfcvtn2?)\t")
_SVE = re.compile(r"\bz\d+\.[bhsdq]\b|\bp\d+/[zm]\b")


@pytest.mark.skipif(_ARM_CXX is None or _ARM_OBJDUMP is None,
                    reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu; `make test` does, as root)")  # fmt: skip
@pytest.mark.parametrize("level", [lv for lv, b in BUILDS.items() if b.arch == "aarch64"])
def test_an_arm_build_holds_no_instruction_above_its_level(level, tmp_path):
    # the core is torch-free, so its family sources cross-compile alone with the build's flags;
    # quant_linear's int8 dots are where each ARM level's own instruction shows
    build = BUILDS[level]
    lines = []
    for source in ("core/quant_linear_core.cpp", "core/gemv_core.cpp", "core/decode_attention_core.cpp"):
        obj = tmp_path / (Path(source).stem + ".o")
        cmd = [_ARM_CXX, "-std=c++17", *build.cflags, "-c", str(HERE / source), "-o", str(obj)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        lines += _objdump(str(obj), _ARM_OBJDUMP)
    assert len(lines) > 1000
    forbidden = [("SVE", _SVE), ("BF16 (BFDOT/BFMMLA)", _ARM_BF16)]
    if level == "neon":
        forbidden.append(("dot-product (SDOT/UDOT)", _SDOT))
    if level != "neon-i8mm":
        forbidden.append(("I8MM (USDOT/SMMLA)", _I8MM))
    _assert_instructions(level, lines, forbidden, {"neon-dotprod": _SDOT, "neon-i8mm": _I8MM}.get(level))


def test_the_bf16_tile_format_follows_the_vendor_unless_forced():
    """isa.bf16_pair_dots: VDPBF16PS pair dots on AMD (measured twice the widened rate on Zen 4)
    and on vendors not measured; on Intel (measured 0.54-0.73x there from 4 rows) weights
    widened to fp32 FMAs wherever the tiles serve every row count; $KVSERVE_BF16_DOTS=pair|widen
    overrides, anything else is refused by name."""
    assert isa.vendor_from_cpuinfo("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t: avx2\n") == "AuthenticAMD"
    assert isa.vendor_from_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\n") is None
    assert isa.bf16_pair_dots("AuthenticAMD", "")[0] is True
    assert isa.bf16_pair_dots("CentaurHauls", "")[0] is True  # a vendor not measured keeps them
    on, why = isa.bf16_pair_dots("GenuineIntel", "")
    assert on is False and "Intel" in why
    # at amx the tiles serve only the GEMV's rows (AMX the rest) unless --deterministic
    assert isa.bf16_pair_dots("GenuineIntel", "", "amx", tiles_serve_every_row=False)[0] is True
    assert isa.bf16_pair_dots("GenuineIntel", "", "amx", tiles_serve_every_row=True)[0] is False
    assert isa.bf16_pair_dots("GenuineIntel", "", "avx512-bf16", tiles_serve_every_row=True)[0] is False
    assert isa.bf16_pair_dots("AuthenticAMD", "", "avx512-bf16")[0] is True
    assert isa.bf16_pair_dots("GenuineIntel", "pair") == (True, "KVSERVE_BF16_DOTS=pair")
    assert isa.bf16_pair_dots("AuthenticAMD", " WIDEN ") == (False, "KVSERVE_BF16_DOTS=widen")
    with pytest.raises(ConfigError, match="KVSERVE_BF16_DOTS.*'pair' or 'widen'"):
        isa.bf16_pair_dots("AuthenticAMD", "fast")
